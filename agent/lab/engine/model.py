"""A decoder-only transformer with seeded random weights, and its byte-level tokenizer.

The model does not know how KV is stored: each layer hands its queries, keys and values to an
`AttentionFn` (the paged attention of `kvwatch.lab.engine.attention` in the engine, a contiguous
reference in the tests), which returns the attention output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from kvwatch.lab.engine.config import ModelShape

# (layer index, q, k, v), each [tokens, heads, head_dim] -> attention output of the same shape.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_INIT_STD = 0.3


class ByteTokenizer:
    """Token i < 256 is the byte i; token 256 is BOS. No vocabulary file, nothing to download.

    Generation is restricted to printable ASCII and newline, so every generated token is exactly
    one character of valid UTF-8 and streams cleanly.
    """

    BOS = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def decode_token(self, token_id: int) -> str:
        return chr(token_id) if token_id < 128 else ""

    def output_token_ids(self) -> list[int]:
        return [10, *range(32, 127)]


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.n_heads = shape.n_heads
        self.head_dim = shape.head_dim
        self.attn_norm = nn.LayerNorm(shape.d_model)
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model)
        self.attn_out = nn.Linear(shape.d_model, shape.d_model)
        self.mlp_norm = nn.LayerNorm(shape.d_model)
        self.mlp_in = nn.Linear(shape.d_model, shape.d_ff)
        self.mlp_out = nn.Linear(shape.d_ff, shape.d_model)

    def forward(self, x: torch.Tensor, layer_index: int, attend: AttentionFn) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(self.attn_norm(x)).view(tokens, 3, self.n_heads, self.head_dim)
        attended = attend(layer_index, qkv[:, 0], qkv[:, 1], qkv[:, 2])
        x = x + self.attn_out(attended.reshape(tokens, -1))
        out: torch.Tensor = x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))
        return out


class TransformerModel(nn.Module):
    """Token and learned position embeddings, `n_layers` decoder layers, a tied output head.

    Weights are drawn on the CPU from a generator seeded with `seed`, then moved to the device,
    so the same seed gives the same model on every device.
    """

    def __init__(self, shape: ModelShape, vocab_size: int, seed: int) -> None:
        super().__init__()
        self.shape = shape
        self.token_embedding = nn.Embedding(vocab_size, shape.d_model)
        self.position_embedding = nn.Embedding(shape.max_model_len, shape.d_model)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.n_layers))
        self.final_norm = nn.LayerNorm(shape.d_model)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if "norm" in name:
                    continue
                param.copy_(torch.randn(param.shape, generator=generator) * _INIT_STD)

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttentionFn
    ) -> torch.Tensor:
        """Hidden states [tokens, d_model] of a flat batch of tokens at the given positions."""
        x = self.token_embedding(token_ids) + self.position_embedding(positions)
        for index, layer in enumerate(self.layers):
            x = layer(x, index, attend)
        normed: torch.Tensor = self.final_norm(x)
        return normed

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.token_embedding.weight.T

"""A tiny llama-architecture GGUF model with random weights, written with the `gguf` package:
what llama-cpp-python's server needs to run on a CPU in a test, with no download."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, TokenType

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
EOS_TOKEN_ID = 2
FIRST_BYTE_TOKEN_ID = len(SPECIAL_TOKENS)


def ascii_forever_bias() -> dict[str, float]:
    """A request's `logit_bias` for random weights: never end early (no end-of-sequence) and
    emit only ASCII — random bytes of 0x80 and up are incomplete UTF-8, which llama-cpp-python's
    streaming holds back and re-decodes every token (400 tokens then take 45 s, not 0.2 s)."""
    banned = [EOS_TOKEN_ID, *(FIRST_BYTE_TOKEN_ID + b for b in range(0x80, 0x100))]
    return {str(token): -100.0 for token in banned}


@dataclass(frozen=True)
class TinyLlama:
    """The geometry of the generated model (grouped-query attention: fewer KV heads)."""

    context_length: int = 32768
    embedding: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    feed_forward: int = 128

    @property
    def head_size(self) -> int:
        return self.embedding // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, f16 — llama.cpp's default cache type."""
        return self.layers * 2 * self.kv_heads * self.head_size * 2


def write_tiny_llama(path: Path, model: TinyLlama = TinyLlama(), seed: int = 0) -> Path:
    """Writes the model to `path`: a byte-fallback SentencePiece-style vocabulary (special
    tokens, 256 byte tokens, the lowercase letters) and random f32 weights."""
    tokens = [*SPECIAL_TOKENS, *(f"<0x{b:02X}>" for b in range(256))]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    for letter in "abcdefghijklmnopqrstuvwxyz":
        tokens += [letter, f"\u2581{letter}"]
        types += [TokenType.NORMAL, TokenType.NORMAL]
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("kvwatch-tiny-llama")
    writer.add_context_length(model.context_length)
    writer.add_embedding_length(model.embedding)
    writer.add_block_count(model.layers)
    writer.add_feed_forward_length(model.feed_forward)
    writer.add_head_count(model.heads)
    writer.add_head_count_kv(model.kv_heads)
    writer.add_rope_dimension_count(model.head_size)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_unk_token_id(0)
    rng = np.random.default_rng(seed)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    vocab, width, kv_width = len(tokens), model.embedding, model.kv_heads * model.head_size
    tensor("token_embd.weight", vocab, width)
    tensor("output_norm.weight", width)
    tensor("output.weight", vocab, width)
    for layer in range(model.layers):
        block = f"blk.{layer}"
        tensor(f"{block}.attn_norm.weight", width)
        tensor(f"{block}.attn_q.weight", width, width)
        tensor(f"{block}.attn_k.weight", kv_width, width)
        tensor(f"{block}.attn_v.weight", kv_width, width)
        tensor(f"{block}.attn_output.weight", width, width)
        tensor(f"{block}.ffn_norm.weight", width)
        tensor(f"{block}.ffn_gate.weight", model.feed_forward, width)
        tensor(f"{block}.ffn_up.weight", model.feed_forward, width)
        tensor(f"{block}.ffn_down.weight", width, model.feed_forward)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

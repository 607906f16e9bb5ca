"""Attention through block tables equals attention over contiguous KV."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from kvwatch.lab.engine.attention import PagedAttention, PagedKVStorage, build_paged_batch
from kvwatch.lab.engine.config import MODEL_SHAPES
from kvwatch.lab.engine.model import ByteTokenizer, TransformerModel

pytestmark = pytest.mark.engine

SHAPE = MODEL_SHAPES["tiny"]
BLOCK_SIZE = 4
NUM_BLOCKS = 64
CPU = torch.device("cpu")


def contiguous_attention(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """The reference: one whole sequence, keys and values side by side, causal mask."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
    )
    return out[0].transpose(0, 1)


def scattered_tables(lengths: list[int], rng: random.Random) -> list[list[int]]:
    """Block tables whose blocks are spread over the pool in random order."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lengths]


def test_paged_attention_matches_contiguous_for_a_mixed_batch() -> None:
    """Several sequences: some new (prefill from 0), some continuing (tokens already cached)."""
    rng = random.Random(7)
    torch.manual_seed(7)
    heads, head_dim = SHAPE.n_heads, SHAPE.head_dim
    lengths = [9, 1, 23, 16]
    firsts = [0, 0, 20, 15]  # positions before `first` were written by earlier steps
    tables = scattered_tables(lengths, rng)
    storage = PagedKVStorage(SHAPE, NUM_BLOCKS, BLOCK_SIZE, torch.float64, CPU)
    full = [torch.randn(3, n, heads, head_dim, dtype=torch.float64) for n in lengths]
    for (q, k, v), first, table in zip(full, firsts, tables, strict=True):
        if first:
            earlier = build_paged_batch([0], [first], [table], BLOCK_SIZE, CPU)
            PagedAttention(storage, earlier)(0, q[:first], k[:first], v[:first])
    batch = build_paged_batch(
        firsts, [n - f for n, f in zip(lengths, firsts, strict=True)], tables, BLOCK_SIZE, CPU
    )
    new = [t[:, f:] for t, f in zip(full, firsts, strict=True)]
    out = PagedAttention(storage, batch)(0, *(torch.cat([t[i] for t in new]) for i in range(3)))
    expected = torch.cat(
        [contiguous_attention(0, q, k, v)[f:] for (q, k, v), f in zip(full, firsts, strict=True)]
    )
    torch.testing.assert_close(out, expected)


def test_model_logits_through_paged_kv_match_a_full_contiguous_pass() -> None:
    """Prefill part of a prompt, then decode token by token through scattered blocks: every
    step's hidden state equals the one-pass contiguous forward at that position."""
    tokenizer = ByteTokenizer()
    model = TransformerModel(SHAPE, tokenizer.vocab_size, seed=3).to(torch.float64).eval()
    tokens = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    positions = torch.arange(len(tokens))
    with torch.inference_mode():
        reference = model(torch.tensor(tokens), positions, contiguous_attention)
        storage = PagedKVStorage(SHAPE, NUM_BLOCKS, BLOCK_SIZE, torch.float64, CPU)
        table = scattered_tables([len(tokens)], random.Random(11))[0]
        prefill = 13
        steps = [(0, prefill)] + [(p, 1) for p in range(prefill, len(tokens))]
        for first, count in steps:
            batch = build_paged_batch([first], [count], [table], BLOCK_SIZE, CPU)
            hidden = model(
                torch.tensor(tokens[first : first + count]),
                positions[first : first + count],
                PagedAttention(storage, batch),
            )
            torch.testing.assert_close(hidden, reference[first : first + count])

"""The deterministic "model": the next token of a sequence is a function of the whole sequence
so far, so a request that lost, repeated or reordered a token (or resumed from the wrong
place) produces a different continuation from then on."""

from __future__ import annotations

from collections.abc import Sequence

VOCAB_SIZE = 32000
FIRST_TOKEN = 100  # clear of special ids


def next_token(history: Sequence[int]) -> int:
    """The token that follows `history` (prompt and output so far)."""
    value = 1469598103934665603
    for position, token in enumerate(history):
        value = ((value ^ (token + 7 * position)) * 1099511628211) % (1 << 64)
    return FIRST_TOKEN + value % (VOCAB_SIZE - FIRST_TOKEN)


def expected_output(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The output an unheld request with `prompt` produces: what every test compares with."""
    sequence = list(prompt)
    for _ in range(max_tokens):
        sequence.append(next_token(sequence))
    return sequence[len(prompt) :]

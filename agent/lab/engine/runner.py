"""Runs the model for a set of scheduled sequences and samples their next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwatch.lab.engine.attention import PagedAttention, PagedKVStorage, build_paged_batch
from kvwatch.lab.engine.kv_cache import KVCacheManager
from kvwatch.lab.engine.model import TransformerModel
from kvwatch.lab.engine.scheduler import Sequence


@dataclass
class Sampling:
    """How to pick a request's next token: greedy when `temperature` is 0, else sampled with
    the request's own generator (so a seeded request samples the same tokens in any batch)."""

    temperature: float = 0.0
    generator: torch.Generator | None = None

    @classmethod
    def drawn(cls, temperature: float, seed: int | None, device: torch.device) -> Sampling:
        """Greedy at temperature 0; else sampled with a new generator on `device`, seeded
        with `seed` (or randomly)."""
        if temperature <= 0.0:
            return cls()
        generator = torch.Generator(device=device)
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()
        return cls(temperature, generator)


class ModelRunner:
    """Turns sequences into one forward call and sampled tokens.

    Ownership: used by the engine thread only. It writes KV only into the rows of the blocks in
    each sequence's block table, which the scheduler reserved before the step.
    """

    def __init__(
        self,
        model: TransformerModel,
        storage: PagedKVStorage,
        kv: KVCacheManager,
        output_token_ids: list[int],
        device: torch.device,
    ) -> None:
        self.model = model
        self.storage = storage
        self.kv = kv
        self.device = device
        mask = torch.full((model.token_embedding.num_embeddings,), float("-inf"))
        mask[output_token_ids] = 0.0
        self._logit_mask = mask.to(device)

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], sampling: list[Sampling]) -> list[int]:
        """Computes every uncomputed token of each sequence; returns one next token each."""
        firsts = [seq.num_computed_tokens for seq in seqs]
        counts = [seq.num_uncomputed for seq in seqs]
        token_ids: list[int] = []
        positions: list[int] = []
        for seq, first in zip(seqs, firsts, strict=True):
            token_ids.extend(seq.token_ids[first:])
            positions.extend(range(first, len(seq.token_ids)))
        batch = build_paged_batch(
            firsts,
            counts,
            [self.kv.block_table(seq.request_id) for seq in seqs],
            self.storage.block_size,
            self.device,
        )
        hidden = self.model(
            torch.tensor(token_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            PagedAttention(self.storage, batch),
        )
        last_rows = torch.tensor(counts, device=self.device).cumsum(0) - 1
        logits = self.model.logits(hidden[last_rows]).float() + self._logit_mask
        return self._sample(logits, sampling)

    def _sample(self, logits: torch.Tensor, sampling: list[Sampling]) -> list[int]:
        chosen = logits.argmax(dim=-1)
        for row, spec in enumerate(sampling):
            if spec.temperature > 0.0:
                probs = torch.softmax(logits[row] / spec.temperature, dim=-1)
                chosen[row] = torch.multinomial(probs, 1, generator=spec.generator)[0]
        return [int(t) for t in chosen.tolist()]

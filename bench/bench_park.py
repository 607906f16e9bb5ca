"""Parking a request (issue #23): how to bring its KV back, and what a park and a release
cost on the real engine.

1. Restore: (a) copy the request's KV blocks to host memory on park and back on resume, or
   (b) free them and recompute the context on resume (what preemption does). For one request
   at 64, 512 and 2048 tokens of context, on the engine's own parts (model, paged storage,
   block tables; `kvwatch engine`'s default model, float32 on the CPU): what a park costs,
   what a resume costs (b: the recompute step, less the decode step an unparked request would
   run anyway), and the host bytes held while parked. Exactness: 50 prompts, greedy and
   sampled with a seed, generated unparked and with a park in the middle under (a) and (b),
   in float32 (the CPU default) and bfloat16 (the CUDA default); identical means the same
   token ids. And how far recomputed KV is from the KV computed token by token.
2. Round trips on the real engine (the default model, CPU): a request at 64, 512 and 2048
   tokens of context, blocked on a reader that reads nothing, is parked (`Engine.park`, from
   the call to its answer: the copy done and the blocks free) and released (`Engine.release`,
   from the call to its answer, and to `on_resumed`: admitted again, its KV copied back),
   ROUND_TRIPS times each; medians. A release is the agent's, or the engine hook's when the
   agent's lease runs out (docs/protocol.md, "Pause and release").

Measured here (2 shared cores, small model): a park costs 0.26/1.4/2.9 ms at 64/512/2048
tokens with the copy, a resume 0.8/1.9/8.8 ms more than an unparked step, holding 0.6/4.3/16.9
MB of host memory; recomputing costs 8.6/85/673 ms more. Copy: 100 of 100 runs identical in
both dtypes. Recompute: identical in float32 (its KV off by up to 4e-4), 84 of 100 in bfloat16
(off by up to 0.27). Round trips on the engine: a park 0.6/1.1/15 ms (2.5 ms in quieter runs),
a release 0.1/0.1/0.3 ms, the KV back 0.5/1.3/5.1 ms after it.

Run: `python -m bench.bench_park`. Writes bench/results/park.json.
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench.common import write_result
from kvwatch.lab.engine.attention import PagedKVStorage
from kvwatch.lab.engine.config import DEFAULT_MODEL_SIZE, MODEL_SHAPES, EngineConfig
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.engine.kv_cache import KVCacheManager
from kvwatch.lab.engine.model import ByteTokenizer, TransformerModel
from kvwatch.lab.engine.requests import GenerationRequest
from kvwatch.lab.engine.runner import ModelRunner, Sampling
from kvwatch.lab.engine.scheduler import Sequence

CONTEXTS = (64, 512, 2048)
COST_REPEATS = 7
EXACT_PROMPTS = 50
EXACT_TOKENS = 96
KV_DIFFERENCE_PROMPTS = 10
PARK_AFTER_TOKENS = 24
BLOCK_SIZE = 16
POOL_BLOCKS = 512
SAMPLING_TEMPERATURE = 0.8
SCRIBBLE = 1e4
WORDS = ("kv", "cache", "block", "stall", "window", "token", "stream", "engine", "park")

ROUND_TRIPS = 7
READ_TIMEOUT_SECONDS = 60.0


@dataclass
class Restore:
    """How a parked request gets its KV back: `park` runs after its blocks are read, before
    they are freed, and returns what is kept; `resume` runs once new blocks are reserved."""

    name: str
    park: Callable[[str], torch.Tensor | None]
    resume: Callable[[Sequence, torch.Tensor | None], None]


class OneRequest:
    """The engine's model, paged storage and block tables, driving one request at a time."""

    def __init__(self, model_size: str, dtype: torch.dtype) -> None:
        shape = MODEL_SHAPES[model_size]
        tokenizer = ByteTokenizer()
        model = TransformerModel(shape, tokenizer.vocab_size, seed=0).to(dtype=dtype).eval()
        self.storage = PagedKVStorage(shape, POOL_BLOCKS, BLOCK_SIZE, dtype, torch.device("cpu"))
        self.kv = KVCacheManager(POOL_BLOCKS, BLOCK_SIZE)
        self.runner = ModelRunner(
            model, self.storage, self.kv, tokenizer.output_token_ids(), torch.device("cpu")
        )
        self.restores = (
            Restore("host_copy", self._copy_out, self._copy_in),
            Restore("recompute", self._drop, self._recompute),
        )

    def step(self, seq: Sequence, sampling: Sampling) -> float:
        """One step as the engine runs it; returns its seconds."""
        self.kv.ensure_capacity(seq.request_id, len(seq.token_ids))
        start = time.perf_counter()
        token = self.runner.step([seq], [sampling])[0]
        seconds = time.perf_counter() - start
        seq.num_computed_tokens = len(seq.token_ids)
        seq.token_ids.append(token)
        return seconds

    def park(self, seq: Sequence, restore: Restore) -> tuple[torch.Tensor | None, float]:
        """Parks the request: keeps what `restore` needs, frees its blocks, and scribbles
        over the whole pool (a restore that missed a row would show; finite, since masked
        rows still meet a zero weight). Returns the kept copy and the park's seconds."""
        start = time.perf_counter()
        kept = restore.park(seq.request_id)
        self.kv.free(seq.request_id)
        seconds = time.perf_counter() - start
        for rows in (*self.storage.keys, *self.storage.values):
            rows.fill_(SCRIBBLE)
        return kept, seconds

    def resume(self, seq: Sequence, restore: Restore, kept: torch.Tensor | None) -> float:
        """Reserves the request's blocks again and restores its KV; returns the seconds."""
        start = time.perf_counter()
        self.kv.ensure_capacity(seq.request_id, len(seq.token_ids))
        restore.resume(seq, kept)
        return time.perf_counter() - start

    def generate(
        self, prompt: list[int], tokens: int, sampling: Sampling, restore: Restore | None
    ) -> list[int]:
        """`tokens` tokens after `prompt`, parked and resumed after PARK_AFTER_TOKENS when
        `restore` is given."""
        seq = Sequence("bench", list(prompt), len(prompt), tokens)
        for _ in range(tokens):
            if restore is not None and seq.num_generated == PARK_AFTER_TOKENS:
                kept, _seconds = self.park(seq, restore)
                self.resume(seq, restore, kept)
            self.step(seq, sampling)
        self.kv.free(seq.request_id)
        return seq.token_ids[len(prompt) :]

    def _copy_out(self, request_id: str) -> torch.Tensor:
        return self.storage.copy_out(self.kv.block_table(request_id)).blocks

    def _copy_in(self, seq: Sequence, kept: torch.Tensor | None) -> None:
        assert kept is not None
        self.storage.copy_in(self.kv.block_table(seq.request_id), kept)

    @staticmethod
    def _drop(request_id: str) -> None:
        return None

    @staticmethod
    def _recompute(seq: Sequence, kept: torch.Tensor | None) -> None:
        seq.num_computed_tokens = 0  # as Scheduler._preempt: the next step recomputes it all


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def restore_costs(engine_parts: OneRequest) -> list[dict[str, Any]]:
    """Per context length and restore: park, resume and the first step after the resume."""
    rows: list[dict[str, Any]] = []
    greedy = Sampling()
    for context in CONTEXTS:
        prompt = [256, *([ord("a")] * (context - 1))]
        for restore in engine_parts.restores:
            parks, resumes, first_steps, decodes = [], [], [], []
            held_bytes = 0
            for _ in range(COST_REPEATS):
                seq = Sequence("bench", list(prompt), context, 8)
                engine_parts.step(seq, greedy)  # prefill: the context's KV is in the cache
                decodes.append(engine_parts.step(seq, greedy))
                kept, park_seconds = engine_parts.park(seq, restore)
                held_bytes = 0 if kept is None else kept.numel() * kept.element_size()
                parks.append(park_seconds)
                resumes.append(engine_parts.resume(seq, restore, kept))
                first_steps.append(engine_parts.step(seq, greedy))
                engine_parts.kv.free(seq.request_id)
            extra = [
                resume + first - decode
                for resume, first, decode in zip(resumes, first_steps, decodes, strict=True)
            ]
            rows.append(
                {
                    "context_tokens": context,
                    "restore": restore.name,
                    "park_ms": _median_ms(parks),
                    "resume_ms": _median_ms(resumes),
                    "first_step_after_resume_ms": _median_ms(first_steps),
                    "decode_step_ms": _median_ms(decodes),
                    "resume_extra_ms": _median_ms(extra),
                    "host_bytes_held": held_bytes,
                }
            )
    return rows


def exactness(engine_parts: OneRequest, prompts: list[list[int]]) -> dict[str, Any]:
    """How many prompts give the same tokens parked (per restore) as unparked, greedy and
    sampled with a seed; and the largest difference between recomputed and stepwise KV."""
    result: dict[str, Any] = {
        "recompute_kv_max_abs_difference": kv_difference(engine_parts, prompts)
    }
    device = torch.device("cpu")
    for mode, temperature in (("greedy", 0.0), ("sampled_seeded", SAMPLING_TEMPERATURE)):
        identical = {restore.name: 0 for restore in engine_parts.restores}
        first_divergence: dict[str, list[int]] = {name: [] for name in identical}
        for index, prompt in enumerate(prompts):
            seeded = Sampling.drawn(temperature, index, device)
            baseline = engine_parts.generate(prompt, EXACT_TOKENS, seeded, None)
            for restore in engine_parts.restores:
                seeded = Sampling.drawn(temperature, index, device)
                parked = engine_parts.generate(prompt, EXACT_TOKENS, seeded, restore)
                if parked == baseline:
                    identical[restore.name] += 1
                else:
                    pairs = zip(parked, baseline, strict=True)
                    first_divergence[restore.name].append(
                        next(i for i, (got, want) in enumerate(pairs) if got != want)
                    )
        result[mode] = {
            name: {"identical": count, "first_divergent_token": first_divergence[name]}
            for name, count in identical.items()
        }
    return result


def kv_difference(engine_parts: OneRequest, prompts: list[list[int]]) -> float:
    """The largest difference, over the first KV_DIFFERENCE_PROMPTS prompts, between the KV a
    request computed token by token up to the park and the KV a recompute gives it."""
    largest = 0.0
    for prompt in prompts[:KV_DIFFERENCE_PROMPTS]:
        seq = Sequence("bench", list(prompt), len(prompt), PARK_AFTER_TOKENS)
        while seq.num_generated < PARK_AFTER_TOKENS:
            engine_parts.step(seq, Sampling())
        computed = seq.num_computed_tokens
        stepwise = engine_parts.storage.copy_out(engine_parts.kv.block_table("bench")).blocks
        seq.num_computed_tokens = 0
        engine_parts.step(seq, Sampling())
        recomputed = engine_parts.storage.copy_out(engine_parts.kv.block_table("bench")).blocks
        engine_parts.kv.free("bench")
        rows = [
            kv.flatten(2, 3)[:, :, :computed].float()
            for kv in (stepwise, recomputed[:, :, : stepwise.shape[2]])
        ]
        largest = max(largest, (rows[0] - rows[1]).abs().max().item())
    return largest


def round_trips() -> list[dict[str, Any]]:
    """Part 2: park and release on a running engine, per context length (see the module)."""
    config = EngineConfig(model_size=DEFAULT_MODEL_SIZE, device="cpu", kv_blocks=POOL_BLOCKS)
    engine = Engine(config)
    engine.start()
    rows: list[dict[str, Any]] = []
    try:
        for context in CONTEXTS:
            parks, releases, resumes = [], [], []
            for repeat in range(ROUND_TRIPS):
                park, release, resume = round_trip(engine, f"rt-{context}-{repeat}", context)
                parks.append(park)
                releases.append(release)
                resumes.append(resume)
            rows.append(
                {
                    "context_tokens": context,
                    "park_ms": _median_ms(parks),
                    "release_ms": _median_ms(releases),
                    "release_to_kv_back_ms": _median_ms(resumes),
                }
            )
    finally:
        engine.stop()
    return rows


def round_trip(engine: Engine, request_id: str, context: int) -> tuple[float, float, float]:
    """One request parked once blocked on its reader, then released: the seconds of the park,
    of the release, and from the release to its KV back (`on_resumed`)."""
    resumed = threading.Event()
    request = GenerationRequest(
        request_id,
        [256, *([ord("a")] * (context - 1))],
        max_tokens=8,
        on_resumed=lambda blocks, recomputed: resumed.set(),
    )
    handle = engine.submit(request)
    while not any(
        r.request_id == request_id and r.state == "egress_blocked" for r in engine.stats().requests
    ):
        time.sleep(0.001)
    start = time.perf_counter()
    if engine.park(request_id, "bench").status != "parked":
        raise RuntimeError(f"{request_id} was not parked")
    park = time.perf_counter() - start
    handle.channel.wait_batch(0)  # its reader takes what was queued: it may run once released
    start = time.perf_counter()
    if engine.release(request_id, "bench").status != "released":
        raise RuntimeError(f"{request_id} was not released")
    release = time.perf_counter() - start
    if not resumed.wait(READ_TIMEOUT_SECONDS):
        raise RuntimeError(f"{request_id} never resumed")
    resume = time.perf_counter() - start
    handle.collect(READ_TIMEOUT_SECONDS)
    return park, release, resume


def main() -> None:
    torch.set_num_threads(EngineConfig().cpu_threads)
    rng = random.Random(23)
    prompts = [
        ByteTokenizer().encode(" ".join(rng.choices(WORDS, k=rng.randint(1, 120))))
        for _ in range(EXACT_PROMPTS)
    ]
    results: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "model_size": DEFAULT_MODEL_SIZE,
        "restore_costs": {
            "dtype": "float32",
            "rows": restore_costs(OneRequest(DEFAULT_MODEL_SIZE, torch.float32)),
        },
        "exactness": {
            "prompts": EXACT_PROMPTS,
            "prompt_tokens": f"{min(map(len, prompts))}..{max(map(len, prompts))}",
            "tokens": EXACT_TOKENS,
            "parked_after_tokens": PARK_AFTER_TOKENS,
            **{
                name: exactness(OneRequest(DEFAULT_MODEL_SIZE, dtype), prompts)
                for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
            },
        },
    }
    results["round_trips"] = {"repeats": ROUND_TRIPS, "rows": round_trips()}
    path = write_result("park", results)
    print(path.read_text())


if __name__ == "__main__":
    main()

"""The reference engine's own costs: scheduler + block-manager overhead per step at 64 running
requests (no model compute), the host-side cost of building the paged-attention index tensors,
the tokens/s of the models on this machine's CPU, and the engine's time per step outside the
model runner. On a shared machine the numbers move with the load: compare runs side by side.

Run: `python -m bench.bench_engine`. Writes bench/results/engine.json.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Any

import torch

from bench.common import write_result
from kvwatch.lab.engine.attention import build_paged_batch
from kvwatch.lab.engine.config import DEFAULT_MODEL_SIZE, EngineConfig
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.engine.kv_cache import KVCacheManager
from kvwatch.lab.engine.requests import GenerationRequest
from kvwatch.lab.engine.runner import Sampling
from kvwatch.lab.engine.scheduler import Scheduler, Sequence

RUNNING = 64
BLOCK_SIZE = 16
SCHEDULER_STEPS = 3000
INDEX_STEPS = 300


def _percentiles_us(samples_seconds: list[float]) -> dict[str, float]:
    ordered = sorted(samples_seconds)
    return {
        "mean_us": round(statistics.fmean(ordered) * 1e6, 2),
        "p50_us": round(ordered[len(ordered) // 2] * 1e6, 2),
        "p99_us": round(ordered[int(len(ordered) * 0.99)] * 1e6, 2),
    }


def _new_sequence(rng: random.Random, counter: int) -> Sequence:
    prompt = rng.randint(16, 256)
    return Sequence(f"s{counter}", [1] * prompt, prompt, max_tokens=rng.randint(64, 512))


def scheduler_overhead() -> dict[str, Any]:
    """One engine step without the model: schedule (admit, reserve slots, preempt), then the
    per-token bookkeeping the step executor does, finishing and replacing requests so that
    64 stay running. The pool is sized so that preemptions happen now and then."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=RUNNING * 20, block_size=BLOCK_SIZE)
    scheduler = Scheduler(kv, RUNNING, max_prefill_tokens=4096, is_egress_blocked=lambda s: False)
    counter = 0
    for counter in range(RUNNING * 2):
        scheduler.add(_new_sequence(rng, counter))
    samples: list[float] = []
    for _ in range(SCHEDULER_STEPS):
        start = time.perf_counter()
        plan = scheduler.schedule()
        for seq in plan.prefills + plan.decodes:
            seq.num_computed_tokens = len(seq.token_ids)
            seq.token_ids.append(1)
            if seq.num_generated >= seq.max_tokens:
                scheduler.remove(seq)
        samples.append(time.perf_counter() - start)
        while len(scheduler.running) + len(scheduler.waiting) < RUNNING * 2:
            counter += 1
            scheduler.add(_new_sequence(rng, counter))
    return {
        "running_requests": RUNNING,
        "steps": SCHEDULER_STEPS,
        "preemptions": scheduler.num_preemptions,
        **_percentiles_us(samples),
    }


def paged_index_overhead() -> dict[str, Any]:
    """Host time to build the slot mapping, block tables and mask of a 64-request decode."""
    rng = random.Random(1)
    lengths = [rng.randint(64, 1024) for _ in range(RUNNING)]
    blocks = iter(range(10**6))
    tables = [[next(blocks) for _ in range(-(-n // BLOCK_SIZE))] for n in lengths]
    samples: list[float] = []
    for _ in range(INDEX_STEPS):
        start = time.perf_counter()
        build_paged_batch(
            [n - 1 for n in lengths], [1] * RUNNING, tables, BLOCK_SIZE, torch.device("cpu")
        )
        samples.append(time.perf_counter() - start)
    return {"running_requests": RUNNING, "context_tokens": "64..1024", **_percentiles_us(samples)}


def throughput(model_size: str, concurrent: int, max_tokens: int) -> dict[str, Any]:
    """Generated tokens per second with `concurrent` requests decoding side by side, and the
    engine's own time per step: wall time per step minus the time spent in the model runner
    (scheduling, block tables, index tensors, queues, metrics, stats)."""
    engine = Engine(EngineConfig(model_size=model_size, egress="decoupled", device="cpu"))
    runner = engine._steps._runner  # timing around the model, for the overhead figure
    model_step = runner.step
    model_seconds = [0.0]

    def timed_step(seqs: list[Sequence], sampling: list[Sampling]) -> list[int]:
        start = time.perf_counter()
        try:
            return model_step(seqs, sampling)
        finally:
            model_seconds[0] += time.perf_counter() - start

    runner.step = timed_step  # type: ignore[method-assign]
    engine.start()
    try:
        warm = engine.submit(GenerationRequest("warm", [256, 1, 2], max_tokens=8))
        warm.collect(60)
        model_seconds[0], steps_before = 0.0, engine.stats().steps
        start = time.perf_counter()
        handles = [
            engine.submit(GenerationRequest(f"r{i}", [256, *f"prompt {i}".encode()], max_tokens))
            for i in range(concurrent)
        ]
        tokens = sum(len(handle.collect(600).token_ids) for handle in handles)
        seconds = time.perf_counter() - start
        steps = engine.stats().steps - steps_before
    finally:
        engine.stop()
    return {
        "model_size": model_size,
        "concurrent_requests": concurrent,
        "max_tokens": max_tokens,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 1),
        "steps": steps,
        "engine_overhead_per_step_us": round((seconds - model_seconds[0]) / steps * 1e6, 1),
    }


def main() -> None:
    torch.set_num_threads(EngineConfig().cpu_threads)  # what every engine below runs with
    results: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "default_model_size": DEFAULT_MODEL_SIZE,
        "scheduler_step_overhead": scheduler_overhead(),
        "paged_index_build": paged_index_overhead(),
        "throughput": [
            throughput(size, concurrent, max_tokens=128)
            for size in ("tiny", "small")
            for concurrent in (1, 64)
        ],
    }
    path = write_result("engine", results)
    print(path.read_text())


if __name__ == "__main__":
    main()

"""Parking a request whose client stops reading (issue #23): how to bring its KV back, and how
often a slow reader is parked.

1. Restore: (a) copy the request's KV blocks to host memory on park and back on resume, or
   (b) free them and recompute the context on resume (what preemption does). For one request
   at 64, 512 and 2048 tokens of context, on the engine's own parts (model, paged storage,
   block tables; `kvwatch engine`'s default model, float32 on the CPU): what a park costs,
   what a resume costs (b: the recompute step, less the decode step an unparked request would
   run anyway), and the host bytes held while parked. Exactness: 50 prompts, greedy and
   sampled with a seed, generated unparked and with a park in the middle under (a) and (b),
   in float32 (the CPU default) and bfloat16 (the CUDA default); identical means the same
   token ids. And how far recomputed KV is from the KV computed token by token.
2. Re-parks: a reader at 4 KB/s on average (4 KB receive buffer, 4 KB server send buffer)
   streams a long answer from a real engine over HTTP, steadily or in bursts with pauses; a
   stand-in for the agent parks the request once it has been blocked on its client, with no
   progress, for `policy.park_seconds` (2 s, the agent's default). Measured with parking off,
   with the resumed request's queue widened (the default), and without widening
   (`park_resume_buffer_tokens` 0): parks, resumes, when the reader got [DONE], its longest
   wait for data, and the KV block-seconds the request held.

Measured here (2 shared cores, small model): a park costs 0.16/0.44/1.1 ms at 64/512/2048
tokens with the copy, a resume 0.5/0.8/1.6 ms more than an unparked step, holding 0.6/4.3/16.9
MB of host memory; recomputing costs 5.9/62/448 ms more. Copy: 100 of 100 runs identical in
both dtypes. Recompute: identical in float32 (its KV off by up to 4e-4), 91 of 100 in bfloat16
(off by up to 0.27). Bursty reader: 7 parks unwidened, 1 widened; [DONE] after 27.2 s off,
24.1 s widened; KV held 483 block-seconds off, 354 unwidened, 42 widened; the longest wait
for data 6-9 ms in every run.

Run: `python -m bench.bench_park`. Writes bench/results/park.json.
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench.common import write_result
from kvwatch.engine.attention import PagedKVStorage
from kvwatch.engine.config import DEFAULT_MODEL_SIZE, MODEL_SHAPES, EngineConfig
from kvwatch.engine.engine import Engine
from kvwatch.engine.engine_server import EngineServer
from kvwatch.engine.kv_cache import KVCacheManager
from kvwatch.engine.model import ByteTokenizer, TransformerModel
from kvwatch.engine.runner import ModelRunner, Sampling
from kvwatch.engine.scheduler import Sequence

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

READER_BYTES_PER_SECOND = 4096
READER_CHUNK_BYTES = 1024
# Steady (1 KB every 0.25 s: ACKs never stop for park_seconds) and bursty (12 KB, then 3 s
# without reading: each pause is back-pressure with no progress for more than park_seconds).
READER_BURSTS_BYTES = (1024, 12 * 1024)
READER_RCVBUF_BYTES = 4096
SERVER_SNDBUF_BYTES = 4096
SLOW_MAX_TOKENS = 600
PARK_SECONDS = 2.0
AGENT_LOOK_SECONDS = 0.05
READ_TIMEOUT_SECONDS = 300.0


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
        return self.storage.copy_out(self.kv.block_table(request_id))

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
        stepwise = engine_parts.storage.copy_out(engine_parts.kv.block_table("bench"))
        seq.num_computed_tokens = 0
        engine_parts.step(seq, Sampling())
        recomputed = engine_parts.storage.copy_out(engine_parts.kv.block_table("bench"))
        engine_parts.kv.free("bench")
        rows = [
            kv.flatten(2, 3)[:, :, :computed].float()
            for kv in (stepwise, recomputed[:, :, : stepwise.shape[2]])
        ]
        largest = max(largest, (rows[0] - rows[1]).abs().max().item())
    return largest


class AgentStandIn:
    """Parks the slow request once the engine has shown it blocked on its client for
    PARK_SECONDS (the agent judges the socket; the engine's state is the same fact seen from
    inside), and adds up the KV block-seconds it held. Looks every AGENT_LOOK_SECONDS."""

    def __init__(self, engine: Engine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.outcomes: list[str] = []
        self.block_seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        blocked_since: float | None = None
        while not self._stop.wait(AGENT_LOOK_SECONDS):
            now = time.monotonic()
            mine = [r for r in self.engine.stats().requests if r.request_id == self.request_id]
            if not mine:
                blocked_since = None
                continue
            self.block_seconds += mine[0].kv_blocks * AGENT_LOOK_SECONDS
            if mine[0].state != "egress_blocked":
                blocked_since = None
            elif blocked_since is None:
                blocked_since = now
            elif now - blocked_since >= PARK_SECONDS:
                self.outcomes.append(self.engine.park(self.request_id, "backpressure").status)
                blocked_since = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def read_slowly(address: tuple[str, int], request_id: str, burst_bytes: int) -> dict[str, Any]:
    """Streams SLOW_MAX_TOKENS tokens at READER_BYTES_PER_SECOND on average: `burst_bytes` as
    fast as they come, then a pause as long as they take at that rate. Returns when [DONE]
    came, the longest wait for data (pauses aside), and the text."""
    body = json.dumps({"prompt": "park me", "max_tokens": SLOW_MAX_TOKENS, "stream": True})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address[0]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"X-Request-Id: {request_id}\r\n\r\n"
    )
    data = bytearray()
    longest_wait = 0.0
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, READER_RCVBUF_BYTES)
        client.settimeout(READ_TIMEOUT_SECONDS)
        client.connect(address)
        started = time.monotonic()
        client.sendall(head.encode() + body.encode())
        burst = 0
        while b"data: [DONE]" not in data[-64:]:
            asked = time.monotonic()
            chunk = client.recv(min(READER_CHUNK_BYTES, burst_bytes - burst))
            longest_wait = max(longest_wait, time.monotonic() - asked)
            if not chunk:
                raise RuntimeError("the engine closed the stream before [DONE]")
            data += chunk
            burst += len(chunk)
            if burst >= burst_bytes:
                time.sleep(burst / READER_BYTES_PER_SECOND)  # deliberate: the reader's pace
                burst = 0
        done = time.monotonic() - started
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: {")]
    texts = [json.loads(event)["choices"][0]["text"] for event in events]
    return {
        "done_seconds": round(done, 2),
        "longest_wait_seconds": round(longest_wait, 3),
        "bytes": len(data),
        "tokens": sum(1 for text in texts if text),
        "text": "".join(texts),
    }


def slow_reader(name: str, burst_bytes: int, **settings: Any) -> dict[str, Any]:
    """One slow reader against a fresh engine with these settings, the agent stand-in on."""
    config = EngineConfig(model_size=DEFAULT_MODEL_SIZE, device="cpu", kv_blocks=256, **settings)
    server = EngineServer(Engine(config), "127.0.0.1", 0, sndbuf_bytes=SERVER_SNDBUF_BYTES)
    server.start_in_thread()
    agent = AgentStandIn(server.engine, "cmpl-slow")
    try:
        read = read_slowly(server.address, "slow", burst_bytes)
    finally:
        agent.stop()
        stats = server.engine.stats()
        server.stop()
    return {
        "config": name,
        "burst_bytes": burst_bytes,
        "pause_seconds": burst_bytes / READER_BYTES_PER_SECOND,
        **read,
        "park_answers": {status: agent.outcomes.count(status) for status in set(agent.outcomes)},
        "parks": stats.num_parks,
        "resumes": stats.num_resumes,
        "kv_block_seconds": round(agent.block_seconds, 1),
    }


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
    runs = [
        run
        for burst_bytes in READER_BURSTS_BYTES
        for run in (
            slow_reader("park off", burst_bytes, park=False),
            slow_reader("park, resumed queue widened (default)", burst_bytes),
            slow_reader("park, queue not widened", burst_bytes, park_resume_buffer_tokens=0),
        )
    ]
    texts = {run.pop("text") for run in runs}
    results["slow_reader"] = {
        "reader_bytes_per_second": READER_BYTES_PER_SECOND,
        "reader_rcvbuf_bytes": READER_RCVBUF_BYTES,
        "server_sndbuf_bytes": SERVER_SNDBUF_BYTES,
        "max_tokens": SLOW_MAX_TOKENS,
        "park_seconds": PARK_SECONDS,
        "same_text_in_every_run": len(texts) == 1,
        "runs": runs,
    }
    path = write_result("park", results)
    print(path.read_text())


if __name__ == "__main__":
    main()

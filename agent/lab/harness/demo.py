"""`kvwatch demo`: the reference engine with its defaults, healthy, slow and stopping clients,
and the agent — first observing only, then enforcing — with the numbers that show what a
client that stops reading costs and what pacing it by its reader gives back. Every part is a
real process on loopback; nothing is mocked.

The clients keep the kernel's default receive buffers, as browsers and SDKs do; the engine
keeps its default socket buffers and writes its events in ~1 KB chunks (its default). The
stopping clients ask for long answers (a reasoning model's), stop reading after their first
tokens and come back `away_seconds` later for the rest. Observing, the engine decodes their
answers for nobody into the buffers, their KV held all the while. Enforcing, the agent
pauses each one once its reader is a few seconds of its stream behind, parks it (its KV
freed) and releases it when its reader comes back: it gets its whole answer, unchanged.

A phase runs until its events have happened — every stopping client came back and got its
answer, and the healthy clients finished enough requests — within a bound. The enforcing
phase runs first and sets the length (its stopping clients get the rest of their answer
only after they come back); the observing phase then runs exactly as long, so the two
columns compare the same load over the same time on a machine of any speed.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.lab.harness.stack import Stack
from kvwatch.lab.loadgen import LoadPlan, LoadReport, run_load
from kvwatch.lab.loadgen.report import ClassStats, ClientClass


def engine_args(kv_blocks: int) -> tuple[str, ...]:
    """The reference engine as the demo, the end-to-end tests and the benchmarks run it: the
    tiny model, coupled egress (a stream its writer cannot send pins its KV), its default
    socket buffers and write coalescing."""
    return ("--model-size", "tiny", "--egress", "coupled", "--kv-blocks", str(kv_blocks))


ENGINE_ARGS = engine_args(kv_blocks=160)
# The demo's pool: a stopping client's request holds ~130 blocks (its prompt and an answer of
# ~1,500 tokens), so three of them hold most of it and healthy requests queue behind them.
DEMO_KV_BLOCKS = 448
PROMPT = (
    "Summarise the following maintenance log of a lighthouse. " + "The lamp was "
    "cleaned, the lens polished and the log signed at dawn. " * 8
)
# The slow client reads 8 KB/s: slower than its stream, so the agent paces it (paused while
# it is behind, released as it drains), never cuts it.
SLOW_BYTES_PER_SECOND = 8192
PROGRESS_SECONDS = 0.5


@dataclass
class DemoSettings:
    """The load of both phases. Each stopping client sends one request and reads
    `stop_after_tokens` tokens; `returning` of them come back `away_seconds` later for the
    rest, the others never do (a closed laptop, a crashed script: the connection stays). The
    enforcing phase ends once every returning client got its answer and the healthy clients
    finished `healthy_requests` requests, within `max_seconds`; the observing phase then
    runs as long."""

    healthy: int = 4
    slow: int = 1
    stopping: int = 3
    returning: int = 1
    max_tokens: int = 300
    long_max_tokens: int = 1400  # with the 602-token prompt, within the 2048 context
    stop_after_tokens: int = 50
    away_seconds: float = 20.0
    healthy_requests: int = 20
    max_seconds: float = 150.0
    pause_seconds: float = 2.0
    park_seconds: float = 2.0
    slow_bytes_per_second: int = SLOW_BYTES_PER_SECOND


@dataclass
class StoppedReader:
    """What became of one stopping client's request while its reader was away: the tokens it
    had read when it stopped, the most the engine had generated for it since, and the most
    KV blocks it held meanwhile."""

    read: int
    generated: int = 0
    peak_blocks: int = 0


@dataclass
class PhaseResult:
    """One run of the load with the agent in one mode."""

    mode: str
    report: LoadReport
    returning: int = 0
    seconds: float = 0.0
    events_happened: bool = False
    peak_waiting: float = 0.0
    peak_unread_kv_bytes: float = 0.0
    away: dict[str, StoppedReader] = field(default_factory=dict)
    returned_whole: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def decoded_for_nobody(self) -> int:
        """Tokens the engine generated for stopping clients while they were away."""
        return sum(max(0, r.generated - r.read) for r in self.away.values())


def scrape(url: str) -> dict[str, float]:
    """A /metrics page as {name{labels}: value}, summing nothing."""
    text = httpx.get(url, timeout=2.0).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


class PhaseWatch:
    """Looks at the engine every PROGRESS_SECONDS while a phase runs: the requests waiting,
    and each stopping client's request while its reader is away."""

    def __init__(self, stack: Stack, result: PhaseResult, settings: DemoSettings) -> None:
        self.stack = stack
        self.result = result
        self.settings = settings
        self.block_bytes = 0.0

    def look(self, stopping: ClassStats) -> None:
        engine = scrape(f"{self.stack.engine_url}/metrics")
        self.block_bytes = engine.get("kvwatch_engine:kv_cache_block_size_bytes", 0.0)
        waiting = engine.get("kvwatch_engine:num_requests_waiting", 0.0)
        self.result.peak_waiting = max(self.result.peak_waiting, waiting)
        away = [r for r in stopping.records if r.stopped_at is not None and not r.resumed]
        if not away:
            return
        reports = httpx.get(f"{self.stack.engine_url}/v1/requests", timeout=2.0).json()["data"]
        by_id = {report["request_id"]: report for report in reports}
        unread_blocks = 0
        for record in away:
            report = by_id.get(f"cmpl-{record.request_id}")
            if report is None:
                continue
            seen = self.result.away.setdefault(
                record.request_id, StoppedReader(record.stopped_tokens)
            )
            seen.generated = max(seen.generated, report["tokens_generated"])
            seen.peak_blocks = max(seen.peak_blocks, report["kv_blocks"])
            unread_blocks += report["kv_blocks"]
        unread_bytes = unread_blocks * self.block_bytes
        self.result.peak_unread_kv_bytes = max(self.result.peak_unread_kv_bytes, unread_bytes)

    def events_happened(self, stopping: ClassStats, healthy: ClassStats) -> bool:
        """Every returning client came back and got a whole answer, and the healthy clients
        finished enough requests."""
        returned = [r for r in stopping.records if r.resumed and r.outcome == "finished"]
        self.result.returned_whole = len(returned)
        enough_healthy = healthy.outcomes["finished"] >= self.settings.healthy_requests
        return len(returned) >= self.settings.returning and enough_healthy


def run_phase(
    settings: DemoSettings,
    mode: str,
    workdir: Path,
    say: Callable[[str], None],
    seconds: float | None = None,
) -> PhaseResult:
    """One phase: until its events happened (within `settings.max_seconds`), or for exactly
    `seconds` when given."""
    with Stack(workdir / mode) as stack:
        stack.start_agent(
            "--mode", mode, "--grace-seconds", "0",
            "--pause-seconds", str(settings.pause_seconds),
            "--park-seconds", str(settings.park_seconds),
        )  # fmt: skip
        stack.start_engine(
            *engine_args(DEMO_KV_BLOCKS), "--max-tokens-limit", str(settings.long_max_tokens)
        )
        stack.wait_engine_connected()
        length = f"{seconds:.0f} s" if seconds else "until its events happened"
        say(
            f"[{mode}] {settings.healthy} healthy, {settings.slow} slow and "
            f"{settings.stopping} stopping clients (kernel-default buffers), {length}"
        )
        plan = LoadPlan(
            url=stack.engine_url,
            healthy=settings.healthy,
            slow=settings.slow,
            slow_bytes_per_second=settings.slow_bytes_per_second,
            stalled=settings.stopping,
            stall_after_tokens=settings.stop_after_tokens,
            resume_after_seconds=settings.away_seconds,
            returning=settings.returning,
            stalled_requests=1,
            duration_seconds=seconds or settings.max_seconds,
            max_tokens=settings.max_tokens,
            long_max_tokens=settings.long_max_tokens,
            rcvbuf_bytes=0,
            prompt=PROMPT,
        )
        result = PhaseResult(mode, report=None, returning=settings.returning)  # type: ignore[arg-type]
        watch = PhaseWatch(stack, result, settings)

        def progress(stats: dict[ClientClass, ClassStats]) -> bool:
            watch.look(stats["stalled"])
            done = watch.events_happened(stats["stalled"], stats["healthy"])
            return done and seconds is None

        result.report = asyncio.run(
            run_load(plan, on_stats=progress, progress_interval_seconds=PROGRESS_SECONDS)
        )
        result.seconds = result.report.duration_seconds
        result.events_happened = result.returned_whole >= settings.returning
        result.metrics = scrape(f"{stack.agent_url}/metrics")
    return result


def run_demo(settings: DemoSettings, say: Callable[[str], None]) -> list[PhaseResult]:
    """The enforcing phase until its events happened, then the observing phase as long; the
    results in the order people read them: observing, enforcing."""
    with tempfile.TemporaryDirectory(prefix="kvwatch-demo-") as tmp:
        for mode in ("observe", "enforce"):
            (Path(tmp) / mode).mkdir()
        enforced = run_phase(settings, "enforce", Path(tmp), say)
        observed = run_phase(settings, "observe", Path(tmp), say, seconds=enforced.seconds)
        return [observed, enforced]


def counted(result: PhaseResult, metric: str, *labels: str) -> float:
    """The sum of a metric's series that carry every label given (`name=value`)."""
    return sum(
        value
        for key, value in result.metrics.items()
        if key.split("{")[0] == metric and all(label in key for label in labels)
    )


def decided(result: PhaseResult, action: str) -> float:
    """Holds the agent made (or would have made, observing) of one kind, from its decision
    counts: `reader_behind` pauses, `reader_still_behind` parks."""
    reason = {"pause": "reader_behind", "park": "reader_still_behind"}[action]
    return counted(result, "kvwatch_policy_decisions_total", f"reason={reason}") - counted(
        result, "kvwatch_policy_decisions_total", f"reason={reason}", "verdict=skip"
    )


def done(result: PhaseResult, action: str, status: str) -> float:
    return counted(result, "kvwatch_actions_total", f"action={action}", f"result={status}")


def summary_rows(results: list[PhaseResult]) -> list[tuple[str, list[str]]]:
    """The before/after table: one row per measure, one column per phase."""

    def ttft_p99_ms(result: PhaseResult) -> str:
        p99 = result.report.classes["healthy"].ttft_seconds.p99
        return f"{p99 * 1000:.0f}" if p99 is not None else "-"

    mib = 1 << 20

    def rows(name: str, value: Callable[[PhaseResult], Any]) -> tuple[str, list[str]]:
        return name, [str(value(r)) for r in results]

    return [
        rows("phase length (s)", lambda r: f"{r.seconds:.0f}"),
        rows("healthy TTFT p99 (ms)", ttft_p99_ms),
        rows("healthy tokens/s", lambda r: f"{r.report.classes['healthy'].tokens_per_second:.0f}"),
        rows("peak requests waiting", lambda r: f"{r.peak_waiting:.0f}"),
        rows("tokens decoded for nobody (stopped readers)", lambda r: str(r.decoded_for_nobody)),
        rows(
            "peak KV held for unread streams (MiB)",
            lambda r: f"{r.peak_unread_kv_bytes / mib:.1f}",
        ),
        rows(
            "streams paused, slow reader's too (observing: would pause)",
            lambda r: (
                f"{decided(r, 'pause') if r.mode == 'observe' else done(r, 'pause', 'paused'):.0f}"
            ),
        ),
        rows(
            "streams parked, KV freed (observing: would park)",
            lambda r: (
                f"{decided(r, 'park') if r.mode == 'observe' else done(r, 'park', 'parked'):.0f}"
            ),
        ),
        rows(
            "released when their reader caught up",
            lambda r: f"{done(r, 'release', 'released'):.0f}",
        ),
        rows(
            "returning readers who got the whole answer",
            lambda r: f"{r.returned_whole} of {r.returning}",
        ),
        rows(
            "cut (the proof that a reader is gone)",
            lambda r: f"{done(r, 'cancel', 'cancelled'):.0f}",
        ),
        rows("slow readers cut", lambda r: str(r.report.classes["slow"].reset)),
    ]

"""`kvwatch demo`: the reference engine, slow and stalled clients, and the agent — first
observing only, then enforcing — with the numbers that show what a stalled client costs and
what freeing its KV gives back. Every part is a real process on loopback; nothing is mocked.

The clients keep the kernel's default receive buffers, as browsers and SDKs do: a client that
stops reading then pins its request's KV only once its answer outgrows what the buffers hold,
so the slow and stalled clients ask for long answers (a reasoning model's). Enforcing, the
agent parks each stalled request within seconds of its back-pressure (its KV freed, nothing
cut) and cuts it only after the proof that its reader is gone, which for such a buffer takes
half a minute or more (`DemoSettings`): the enforcing phase is long enough to show it.
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

from kvwatch.harness.stack import Stack
from kvwatch.loadgen import LoadPlan, LoadReport, run_load


# A small pool and long prompts (a retrieval-augmented request carries its context): three
# stalled requests pin most of the pool, so healthy ones queue behind them. A small send
# buffer makes a stalled stream block after ~60 tokens, as a long (reasoning) generation
# would with the kernel's default buffers.
def engine_args(kv_blocks: int) -> tuple[str, ...]:
    """The reference engine as the demo, the end-to-end tests and the benchmarks run it:
    the tiny model, coupled egress (a blocked stream pins its KV), an 8 KiB send buffer."""
    return (
        "--model-size", "tiny", "--egress", "coupled", "--kv-blocks", str(kv_blocks),
        "--sndbuf-bytes", "8192",
    )  # fmt: skip


ENGINE_ARGS = engine_args(kv_blocks=160)
# The demo's pool: each stalled request pins ~90 blocks (its prompt and the ~1000 tokens the
# buffers took), so three of them hold most of it and healthy requests queue behind them.
DEMO_KV_BLOCKS = 448
PROMPT = (
    "Summarise the following maintenance log of a lighthouse. " + "The lamp was "
    "cleaned, the lens polished and the log signed at dawn. " * 8
)


# The slow client reads 8 KB/s through a 4 KiB receive buffer: slower than the stream, so its
# window closes again and again, yet it never goes 2 s without ACK progress (0 of 5 demo runs
# acted on it). At 2 KB/s (the loadgen's default) its window can stay shut for over 2 s
# between reopenings, which the demo's 2 s threshold calls stalled: 2 of 4 demo runs cancelled
# such a client. A threshold must exceed the slowest legitimate reader's refill gap
# (docs/collector.md).
SLOW_BYTES_PER_SECOND = 8192


@dataclass
class DemoSettings:
    """`seconds` of observing, then `enforce_seconds` of enforcing: long enough for the proof
    that cuts a stalled client with a default receive buffer on loopback. The demo's reader
    guarantee is `min_reader_bytes_per_second` (6 KB/s: its slow client reads 8 KB/s): the
    ~128 KB such a client holds would drain in 21 s, and the kernel's next zero-window probe
    proves it did not, ~30-40 s into the stall. With the default 4 KB/s that probe comes ~63 s
    in (measured here): too long for a demo, not for the KV, which the park freed."""

    seconds: float = 12.0
    enforce_seconds: float = 50.0
    healthy: int = 4
    slow: int = 1
    stalled: int = 3
    max_tokens: int = 300
    long_max_tokens: int = 1400  # with the 602-token prompt, within the 2048 context
    stall_seconds: float = 2.0
    park_seconds: float = 2.0
    min_reader_bytes_per_second: int = 6144
    slow_bytes_per_second: int = SLOW_BYTES_PER_SECOND

    def phase_seconds(self, mode: str) -> float:
        return self.enforce_seconds if mode == "enforce" else self.seconds


@dataclass
class PhaseResult:
    """One run of the load with the agent in one mode."""

    mode: str
    report: LoadReport
    peak_waiting: float = 0.0
    peak_backed_up_kv_bytes: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    park_seconds: list[float] = field(default_factory=list)
    cut_seconds: list[float] = field(default_factory=list)


def scrape(url: str) -> dict[str, float]:
    """A /metrics page as {name{labels}: value}, summing nothing."""
    text = httpx.get(url, timeout=2.0).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def run_phase(
    settings: DemoSettings, mode: str, workdir: Path, say: Callable[[str], None]
) -> PhaseResult:
    seconds = settings.phase_seconds(mode)
    with Stack(workdir / mode) as stack:
        stack.start_agent(
            "--mode", mode, "--stall-seconds", str(settings.stall_seconds), "--grace-seconds",
            "0", "--park-seconds", str(settings.park_seconds), "--min-reader-rate",
            str(settings.min_reader_bytes_per_second),
        )  # fmt: skip
        stack.start_engine(
            *engine_args(DEMO_KV_BLOCKS), "--max-tokens-limit", str(settings.long_max_tokens)
        )
        say(
            f"[{mode}] engine and agent up; {settings.healthy} healthy, {settings.slow} slow, "
            f"{settings.stalled} stalled clients (kernel-default receive buffers) for "
            f"{seconds:.0f} s"
        )
        plan = LoadPlan(
            url=stack.engine_url,
            healthy=settings.healthy,
            slow=settings.slow,
            slow_bytes_per_second=settings.slow_bytes_per_second,
            stalled=settings.stalled,
            duration_seconds=seconds,
            max_tokens=settings.max_tokens,
            long_max_tokens=settings.long_max_tokens,
            rcvbuf_bytes=0,
            prompt=PROMPT,
        )
        result = PhaseResult(mode, report=None)  # type: ignore[arg-type]

        def sample(_: LoadReport) -> None:
            engine_metrics = scrape(f"{stack.engine_url}/metrics")
            agent_metrics = scrape(f"{stack.agent_url}/metrics")
            result.peak_waiting = max(
                result.peak_waiting, engine_metrics.get("kvwatch_engine:num_requests_waiting", 0.0)
            )
            result.peak_backed_up_kv_bytes = max(
                result.peak_backed_up_kv_bytes,
                sum(
                    agent_metrics.get(f"kvwatch_streams_kv_held_bytes{{state={state}}}", 0.0)
                    for state in ("zero_window", "stalled")
                ),
            )

        result.report = asyncio.run(
            run_load(plan, on_progress=sample, progress_interval_seconds=0.5)
        )
        result.metrics = scrape(f"{stack.agent_url}/metrics")
        result.park_seconds, result.cut_seconds = freeing_times(stack.audit_entries())
    return result


def freeing_times(entries: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Seconds from the start of each stream's back-pressure to its KV freed by a park, and
    to its cut (the cancel's acknowledgement), from the agent's audit log."""
    decisions = {e["decision_id"]: e for e in entries if e["kind"] == "decision"}
    parks: list[float] = []
    cuts: list[float] = []
    for outcome in (e for e in entries if e["kind"] == "outcome"):
        decision = decisions[outcome["decision_id"]]
        took = (outcome["monotonic_ns"] - decision["monotonic_ns"]) / 1e9
        seconds = round(decision["evidence"]["stalled_seconds"] + took, 2)
        if outcome["result"]["status"] == "parked":
            parks.append(seconds)
        elif outcome["result"]["status"] == "cancelled":
            cuts.append(seconds)
    return parks, cuts


def run_demo(settings: DemoSettings, say: Callable[[str], None]) -> list[PhaseResult]:
    with tempfile.TemporaryDirectory(prefix="kvwatch-demo-") as tmp:
        results = []
        for mode in ("observe", "enforce"):
            (Path(tmp) / mode).mkdir()
            results.append(run_phase(settings, mode, Path(tmp), say))
        return results


def counted(result: PhaseResult, metric: str, *labels: str) -> float:
    """The sum of a metric's series that carry every label given (`name=value`)."""
    return sum(
        value
        for key, value in result.metrics.items()
        if key.split("{")[0] == metric and all(label in key for label in labels)
    )


def decided(result: PhaseResult, reason: str) -> float:
    """Decisions to act (or that would act, observing) for `reason`: `backpressure` parks,
    `stalled` cuts."""
    return counted(result, "kvwatch_policy_decisions_total", f"reason={reason}") - counted(
        result, "kvwatch_policy_decisions_total", f"reason={reason}", "verdict=skip"
    )


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[len(ordered) // 2]:.1f} ({ordered[0]:.1f}-{ordered[-1]:.1f})"


def summary_rows(results: list[PhaseResult]) -> list[tuple[str, list[str]]]:
    """The before/after table: one row per measure, one column per phase."""

    def ttft_p99_ms(result: PhaseResult) -> str:
        p99 = result.report.classes["healthy"].ttft_seconds.p99
        return f"{p99 * 1000:.0f}" if p99 is not None else "-"

    mib = 1 << 20
    return [
        ("healthy TTFT p99 (ms)", [ttft_p99_ms(r) for r in results]),
        (
            "healthy tokens/s",
            [f"{r.report.classes['healthy'].tokens_per_second:.0f}" for r in results],
        ),
        ("peak requests waiting", [f"{r.peak_waiting:.0f}" for r in results]),
        (
            "peak KV held by backed-up streams (MiB)",
            [f"{r.peak_backed_up_kv_bytes / mib:.1f}" for r in results],
        ),
        (
            "streams parked (observing: would park)",
            [f"{decided(r, 'backpressure'):.0f}" for r in results],
        ),
        (
            "KV freed by parks (MiB)",
            [f"{counted(r, 'kvwatch_parks_freed_kv_bytes_total') / mib:.1f}" for r in results],
        ),
        ("back-pressure to KV freed by park (s)", [spread(r.park_seconds) for r in results]),
        (
            "parked requests resumed (client read again)",
            [f"{counted(r, 'kvwatch_parks_resumed_total'):.0f}" for r in results],
        ),
        ("stalled requests proven (would cut)", [f"{decided(r, 'stalled'):.0f}" for r in results]),
        (
            "stalled requests cut after the proof",
            [
                f"{counted(r, 'kvwatch_actions_total', 'action=cancel', 'result=cancelled'):.0f}"
                for r in results
            ],
        ),
        ("back-pressure to cut (s)", [spread(r.cut_seconds) for r in results]),
        (
            "slow-but-draining clients cut",
            [str(r.report.classes["slow"].reset) for r in results],
        ),
    ]

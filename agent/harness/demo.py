"""`kvwatch demo`: the reference engine, slow and stalled clients, and the agent — first
observing only, then enforcing — with the numbers that show what a stalled client costs and
what freeing its KV gives back. Every part is a real process on loopback; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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
    seconds: float = 15.0
    healthy: int = 4
    slow: int = 1
    stalled: int = 3
    max_tokens: int = 300
    stall_seconds: float = 2.0
    slow_bytes_per_second: int = SLOW_BYTES_PER_SECOND


@dataclass
class PhaseResult:
    """One run of the load with the agent in one mode."""

    mode: str
    report: LoadReport
    peak_waiting: float = 0.0
    peak_stalled_kv_bytes: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


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
    with Stack(workdir / mode) as stack:
        stack.start_agent(
            "--mode", mode, "--stall-seconds", str(settings.stall_seconds), "--grace-seconds", "0"
        )
        stack.start_engine(*ENGINE_ARGS)
        say(
            f"[{mode}] engine and agent up; {settings.healthy} healthy, {settings.slow} slow, "
            f"{settings.stalled} stalled clients for {settings.seconds:.0f} s"
        )
        plan = LoadPlan(
            url=stack.engine_url,
            healthy=settings.healthy,
            slow=settings.slow,
            slow_bytes_per_second=settings.slow_bytes_per_second,
            stalled=settings.stalled,
            duration_seconds=settings.seconds,
            max_tokens=settings.max_tokens,
            prompt=PROMPT,
        )
        result = PhaseResult(mode, report=None)  # type: ignore[arg-type]

        def sample(_: LoadReport) -> None:
            engine_metrics = scrape(f"{stack.engine_url}/metrics")
            agent_metrics = scrape(f"{stack.agent_url}/metrics")
            result.peak_waiting = max(
                result.peak_waiting, engine_metrics.get("kvwatch_engine:num_requests_waiting", 0.0)
            )
            result.peak_stalled_kv_bytes = max(
                result.peak_stalled_kv_bytes,
                agent_metrics.get("kvwatch_streams_stalled_kv_held_bytes", 0.0),
            )

        result.report = asyncio.run(
            run_load(plan, on_progress=sample, progress_interval_seconds=0.5)
        )
        result.metrics = scrape(f"{stack.agent_url}/metrics")
    return result


def run_demo(settings: DemoSettings, say: Callable[[str], None]) -> list[PhaseResult]:
    with tempfile.TemporaryDirectory(prefix="kvwatch-demo-") as tmp:
        results = []
        for mode in ("observe", "enforce"):
            (Path(tmp) / mode).mkdir()
            results.append(run_phase(settings, mode, Path(tmp), say))
        return results


def cancels(result: PhaseResult) -> float:
    return sum(
        v
        for k, v in result.metrics.items()
        if k.startswith("kvwatch_actions_total") and "result=cancelled" in k
    )


def would_cancel(result: PhaseResult) -> float:
    return sum(
        v
        for k, v in result.metrics.items()
        if k.startswith("kvwatch_policy_decisions_total") and "verdict=would_act" in k
    )


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
            "peak KV held by stalled streams (MiB)",
            [f"{r.peak_stalled_kv_bytes / mib:.1f}" for r in results],
        ),
        ("stalled requests found (would cancel)", [f"{would_cancel(r):.0f}" for r in results]),
        ("stalled requests cancelled", [f"{cancels(r):.0f}" for r in results]),
        (
            "KV reclaimed (MiB)",
            [
                f"{r.metrics.get('kvwatch_actions_reclaimed_kv_bytes_total', 0) / mib:.1f}"
                for r in results
            ],
        ),
        (
            "slow-but-draining clients cancelled",
            [str(r.report.classes["slow"].reset) for r in results],
        ),
    ]

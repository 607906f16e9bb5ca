"""`kvwatch demo`: the reference engine, slow and stalled clients, and the agent — first
observing only, then enforcing — with the numbers that show what a stalled client costs and
what freeing its KV gives back. Every part is a real process on loopback; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.errors import KvwatchError
from kvwatch.loadgen import LoadPlan, LoadReport, run_load

# A small pool and long prompts (a retrieval-augmented request carries its context): three
# stalled requests pin most of the pool, so healthy ones queue behind them. A small send
# buffer makes a stalled stream block after ~60 tokens, as a long (reasoning) generation
# would with the kernel's default buffers.
ENGINE_ARGS = (
    "--model-size",
    "tiny",
    "--egress",
    "coupled",
    "--kv-blocks",
    "160",
    "--sndbuf-bytes",
    "8192",
)
PROMPT = (
    "Summarise the following maintenance log of a lighthouse. " + "The lamp was "
    "cleaned, the lens polished and the log signed at dawn. " * 8
)
STARTUP_SECONDS = 60.0


@dataclass
class DemoSettings:
    seconds: float = 15.0
    healthy: int = 4
    slow: int = 1
    stalled: int = 3
    max_tokens: int = 300
    stall_seconds: float = 2.0
    engine_port: int = 18000
    agent_port: int = 19431


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


def wait_until_up(url: str, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise KvwatchError(
                f"{what} exited with status {process.returncode} at start-up",
                "run it by hand to see its error (kvwatch engine / kvwatch run)",
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        time.sleep(0.2)
    raise KvwatchError(
        f"{what} did not answer at {url} within {STARTUP_SECONDS:.0f} s",
        "check the machine's load and the ports in use",
    )


@contextlib.contextmanager
def running(args: list[str], health_url: str, what: str, log: Path) -> Iterator[None]:
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvwatch.cli", *args], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_until_up(health_url, process, what)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_phase(
    settings: DemoSettings, mode: str, workdir: Path, say: Callable[[str], None]
) -> PhaseResult:
    socket_path = workdir / f"engine-{mode}.sock"
    engine_url = f"http://127.0.0.1:{settings.engine_port}"
    agent_url = f"http://127.0.0.1:{settings.agent_port}"
    engine = [
        "engine",
        "--port",
        str(settings.engine_port),
        *ENGINE_ARGS,
        "--kvwatch-socket",
        str(socket_path),
    ]
    agent = [
        "run",
        "--mode",
        mode,
        "--port",
        str(settings.engine_port),
        "--stall-seconds",
        str(settings.stall_seconds),
        "--grace-seconds",
        "0",
        "--hook-socket",
        str(socket_path),
        "--listen",
        f"127.0.0.1:{settings.agent_port}",
        "--audit-log",
        str(workdir / f"audit-{mode}.jsonl"),
    ]
    with (
        running(agent, f"{agent_url}/healthz", "the agent", workdir / f"agent-{mode}.log"),
        running(engine, f"{engine_url}/health", "the engine", workdir / f"engine-{mode}.log"),
    ):
        say(
            f"[{mode}] engine and agent up; {settings.healthy} healthy, {settings.slow} slow, "
            f"{settings.stalled} stalled clients for {settings.seconds:.0f} s"
        )
        plan = LoadPlan(
            url=engine_url,
            healthy=settings.healthy,
            slow=settings.slow,
            stalled=settings.stalled,
            duration_seconds=settings.seconds,
            max_tokens=settings.max_tokens,
            prompt=PROMPT,
        )
        result = PhaseResult(mode, report=None)  # type: ignore[arg-type]

        def sample(_: LoadReport) -> None:
            engine_metrics = scrape(f"{engine_url}/metrics")
            agent_metrics = scrape(f"{agent_url}/metrics")
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
        result.metrics = scrape(f"{agent_url}/metrics")
    return result


def run_demo(settings: DemoSettings, say: Callable[[str], None]) -> list[PhaseResult]:
    with tempfile.TemporaryDirectory(prefix="kvwatch-demo-") as tmp:
        return [run_phase(settings, mode, Path(tmp), say) for mode in ("observe", "enforce")]


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

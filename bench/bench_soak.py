"""Soak: the agent under connection churn and engine streams for minutes; its RSS must plateau.

A child process opens and resets TCP connections to a watched loopback port at CHURN_PER_SECOND
(SO_LINGER 0: a reset, no TIME_WAIT to exhaust the ephemeral ports); another accepts and closes
them. An engine hook in this process keeps ANNOUNCED_STREAMS streams announced on that port,
updates them every second and replaces a tenth of them every second with new request ids
(connections the collector never sees: their timelines must expire). /metrics is scraped every
SCRAPE_SECONDS, as Prometheus would. The agent's RSS is sampled every second and its CPU share
over each SAMPLE_WINDOW_SECONDS.

Run as root: `python -m bench.bench_soak [SECONDS]` (default 300). Writes
bench/results/soak.json and soak.png. Not part of `make test`, nor of `make bench` (it takes
minutes). "Plateau": the peak RSS of the second half is at most PLATEAU_GROWTH above the peak of
the second quarter.
"""

from __future__ import annotations

import multiprocessing
import socket
import sys
import tempfile
import time
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import RESULTS, write_result
from kvwatch.harness.demo import scrape
from kvwatch.harness.stack import Stack
from kvwatch.hook import CancelOutcome, EngineHook, EngineInfo

DEFAULT_SECONDS = 300.0
CHURN_PER_SECOND = 4000
ANNOUNCED_STREAMS = 500
REPLACED_PER_SECOND = ANNOUNCED_STREAMS // 10
SCRAPE_SECONDS = 5.0
SAMPLE_WINDOW_SECONDS = 10.0
WARMUP_SECONDS = 15.0
PLATEAU_GROWTH = 1.05
PLATEAU_SLACK_MB = 2.0
MB = 1_000_000
# What the last scrape said about the agent's own tables, reported with the run.
REPORTED_SERIES = (
    "kvwatch_streams_engine_announced",
    "kvwatch_agent_timelines{state=live}",
    "kvwatch_agent_timelines{state=finished}",
    "kvwatch_hook_events_total{event=opens}",
    "kvwatch_hook_events_total{event=closes}",
    "kvwatch_bpf_sockets_tracked",
    "kvwatch_bpf_events_sent_total",
    "kvwatch_bpf_events_dropped_total",
)


def accept_and_close(listener: socket.socket) -> None:
    """Child process: accepts every connection and closes it at once."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        conn.close()


def churn(port: int, per_second: int, made: Synchronized[int]) -> None:
    """Child process: connects and resets `per_second` connections a second, counting them."""
    linger = (1).to_bytes(4, "little") + (0).to_bytes(4, "little")
    while True:
        second = time.monotonic()
        for _ in range(per_second):
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            try:
                client.connect(("127.0.0.1", port))
            except OSError:
                client.close()
                continue
            client.close()
            made.value += 1
            if time.monotonic() - second >= 1.0:
                break
        time.sleep(max(0.0, 1.0 - (time.monotonic() - second)))


class Streams:
    """ANNOUNCED_STREAMS live streams on `port`, renewed a tenth a second."""

    def __init__(self, hook: EngineHook, port: int) -> None:
        self.hook = hook
        self.port = port
        self.next_id = 0
        self.live: list[str] = []
        self.opened = 0

    def open_one(self) -> None:
        request_id = f"soak-{self.next_id}"
        remote_port = 1024 + self.next_id % 60000
        self.hook.stream_opened(
            request_id, ("127.0.0.1", self.port), ("127.0.0.2", remote_port), kv_blocks=4
        )
        self.live.append(request_id)
        self.next_id += 1
        self.opened += 1

    def tick(self, second: int) -> None:
        for request_id in self.live[:REPLACED_PER_SECOND]:
            self.hook.stream_closed(request_id, "finished")
        self.live = self.live[REPLACED_PER_SECOND:]
        while len(self.live) < ANNOUNCED_STREAMS:
            self.open_one()
        for request_id in self.live:
            self.hook.stream_updated(request_id, kv_blocks=4, tokens_out=second)


def _no_request(request_id: str, reason: str) -> CancelOutcome:
    return CancelOutcome(request_id, "unknown_request", 0, 0, detail=reason)


def run_soak(seconds: float) -> dict[str, Any]:
    context = multiprocessing.get_context("fork")
    listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
    port = listener.getsockname()[1]
    made: Synchronized[int] = context.Value("q", 0)
    children = [
        context.Process(target=accept_and_close, args=(listener,), daemon=True),
        context.Process(target=churn, args=(port, CHURN_PER_SECOND, made), daemon=True),
    ]
    with tempfile.TemporaryDirectory(prefix="kvwatch-soak-") as tmp, Stack(Path(tmp)) as stack:
        service = stack.start_agent("--mode", "observe", "--max-sockets", "65536", port=port)
        agent = psutil.Process(service.pid)
        hook = EngineHook(
            EngineInfo("soak", "m", 1, 16, "cpu", 1 << 20), _no_request, str(stack.hook_socket)
        )
        hook.start()
        streams = Streams(hook, port)
        for child in children:
            child.start()
        try:
            samples, metrics, failed_scrapes = sample(agent, stack, streams, made, seconds)
        finally:
            hook.stop()
            for child in children:
                child.kill()
        health = httpx.get(f"{stack.agent_url}/healthz", timeout=5).json()
    listener.close()
    result = summarize(samples, seconds, made.value, streams.opened, health["backend"])
    last_scrape = {name: metrics.get(name) for name in REPORTED_SERIES}
    return {**result, "failed_scrapes": failed_scrapes, "last_scrape": last_scrape}


def sample(
    agent: psutil.Process,
    stack: Stack,
    streams: Streams,
    made: Synchronized[int],
    seconds: float,
) -> tuple[list[dict[str, float]], dict[str, float], int]:
    """One row per second (time, RSS, descriptors, connections so far; CPU per window), the
    last successful scrape and how many scrapes failed (2 s timeout, as `scrape` has)."""
    start = time.monotonic()
    rows: list[dict[str, float]] = []
    window_cpu, window_start = sum(agent.cpu_times()[:2]), start
    cpu_percent = 0.0
    next_scrape = start
    metrics: dict[str, float] = {}
    failed_scrapes = 0
    second = 0
    while (now := time.monotonic()) - start < seconds:
        streams.tick(second)
        if now >= next_scrape:
            try:
                metrics = scrape(f"{stack.agent_url}/metrics")
            except httpx.HTTPError:
                failed_scrapes += 1
            next_scrape += SCRAPE_SECONDS
        if now - window_start >= SAMPLE_WINDOW_SECONDS:
            cpu = sum(agent.cpu_times()[:2])
            cpu_percent = 100 * (cpu - window_cpu) / (now - window_start)
            window_cpu, window_start = cpu, now
        rows.append(
            {
                "t": round(now - start, 1),
                "rss_mb": round(agent.memory_info().rss / MB, 2),
                "cpu_percent_of_core": round(cpu_percent, 1),
                "descriptors": agent.num_fds(),
                "connections": made.value,
                "streams_opened": streams.opened,
            }
        )
        second += 1
        time.sleep(max(0.0, start + second - time.monotonic()))
    return rows, metrics, failed_scrapes


def summarize(
    rows: list[dict[str, float]], seconds: float, connections: int, opened: int, backend: str
) -> dict[str, Any]:
    def peak(low: float, high: float) -> float:
        return max(r["rss_mb"] for r in rows if low * seconds <= r["t"] < high * seconds)

    warm = [r for r in rows if r["t"] >= WARMUP_SECONDS]
    second_quarter, second_half = peak(0.25, 0.5), peak(0.5, 1.01)
    cpu = [r["cpu_percent_of_core"] for r in warm if r["cpu_percent_of_core"]]
    return {
        "seconds": seconds,
        "backend": backend,
        "churn_target_per_second": CHURN_PER_SECOND,
        "connections_made": connections,
        "connections_per_second": round(connections / seconds),
        "announced_streams": ANNOUNCED_STREAMS,
        "streams_opened_in_total": opened,
        "rss_mb": {
            "start": warm[0]["rss_mb"],
            "peak_second_quarter": second_quarter,
            "peak_second_half": second_half,
            "end": rows[-1]["rss_mb"],
        },
        "rss_plateaus": second_half <= second_quarter * PLATEAU_GROWTH + PLATEAU_SLACK_MB,
        "cpu_percent_of_core": {
            "mean": round(sum(cpu) / len(cpu), 1) if cpu else 0.0,
            "max": max(cpu, default=0.0),
        },
        "descriptors_max": max(r["descriptors"] for r in rows),
        "samples": rows,
    }


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["samples"]
    times = [r["t"] for r in rows]
    fig, (memory, cpu) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    memory.plot(times, [r["rss_mb"] for r in rows], color="tab:green")
    memory.set_ylabel("agent RSS (MB)")
    memory.set_title(
        f"soak: {result['connections_per_second']:,} connections/s, "
        f"{result['announced_streams']} announced streams ({result['backend']})"
    )
    cpu.plot(times, [r["cpu_percent_of_core"] for r in rows], color="tab:blue")
    cpu.set_ylabel("agent CPU (% of a core)")
    cpu.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(RESULTS / "soak.png", dpi=100)


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_SECONDS
    result = run_soak(seconds)
    path = write_result("soak", result)
    plot(result)
    rss = result["rss_mb"]
    print(
        f"{result['connections_made']:,} connections ({result['connections_per_second']:,}/s), "
        f"{result['streams_opened_in_total']:,} streams opened; RSS {rss['start']} MB at start, "
        f"peak {rss['peak_second_quarter']} MB in the second quarter, "
        f"{rss['peak_second_half']} MB in the second half, {rss['end']} MB at the end "
        f"(plateau: {result['rss_plateaus']}); CPU {result['cpu_percent_of_core']}"
    )
    print(f"written to {path}")


if __name__ == "__main__":
    main()

"""The whole agent's CPU per token, for bench_collector: `kvwatch run` (observe mode, BPF
collector) watching a TokenLoad's port, as a node runs it. The collector's table read, which
bench/collector_cpu.py times alone, is part of it; so are the daemon's scan (owners, stream
states, the join), its timers and its event loop. The agent's own programs are attached
while it runs; their cost lands on the load's processes, not the agent's, so it is not
counted twice."""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.token_load import TokenLoad
from kvwatch.lab.harness.stack import Stack

SETTLE_SECONDS = 6.0  # the first scans convert every record: not steady state
WINDOWS = 6
WINDOW_SECONDS = 5.0


def agent_windows(load: TokenLoad) -> tuple[list[float], float]:
    """ns of the agent's CPU per token written, in each of WINDOWS windows, and its RSS (MB)
    at the end."""
    with tempfile.TemporaryDirectory(prefix="kvwatch-bench-") as tmp, Stack(Path(tmp)) as stack:
        agent = stack.start_agent("--mode", "observe", port=load.port)
        process = psutil.Process(agent.pid)
        time.sleep(SETTLE_SECONDS)
        costs: list[float] = []
        for _ in range(WINDOWS):
            cpu_before, tokens_before = cpu_seconds(process), load.read().tokens
            time.sleep(WINDOW_SECONDS)
            cpu_after, tokens_after = cpu_seconds(process), load.read().tokens
            costs.append((cpu_after - cpu_before) * 1e9 / max(1, tokens_after - tokens_before))
        return costs, process.memory_info().rss / 1e6


def cpu_seconds(process: psutil.Process) -> float:
    """CPU time of the process's threads, from the scheduler's ns counters (cpu_times() ticks
    at 10 ms: a third of a window's total at this load)."""
    total_ns = 0
    for task in Path(f"/proc/{process.pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            total_ns += int((task / "schedstat").read_text().split()[0])
    return total_ns / 1e9


def summarize_agent(costs: list[float], rss_mb: float) -> dict[str, Any]:
    return {
        "windows": len(costs),
        "window_seconds": WINDOW_SECONDS,
        "ns_per_token": round(statistics.median(costs), 1),
        "ns_per_token_range": [round(min(costs), 1), round(max(costs), 1)],
        "rss_mb": round(rss_mb, 1),
    }

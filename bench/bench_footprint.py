"""Footprint: the agent's CPU and memory while it tracks 0, 1,000 and 10,000 sockets.

The agent (`kvwatch run`, observe mode, BPF collector) watches the port of a loopback
server (kvwatch.lab.harness.scenario.Scenario) that idle clients connect to: connected, nothing sent
after their first line, as keep-alive connections to an inference server sit. The clients
live in a child process, so neither process needs more than ~10,000 file descriptors. The
counts grow in steps (0, then 1,000, then 10,000) in one agent process; after each step
settles, its CPU time and RSS are read with psutil over MEASURE_SECONDS. /metrics is scraped at the
start and the end of each window (as a Prometheus server would, every ~15 s): the scrapes'
cost is part of the measure, and the scrape says how many sockets the agent tracks.

Run as root (BPF): `python -m bench.bench_footprint` (or `make bench`). Writes
bench/results/footprint.json and footprint.png. Targets (issue 4): <= 1% of a core at 1,000
sockets, <= 5% at 10,000, RSS <= 80 MB.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import socket
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

from bench.common import RESULTS, write_result
from kvwatch.errors import KvwatchError
from kvwatch.lab.harness.demo import scrape
from kvwatch.lab.harness.scenario import Scenario
from kvwatch.lab.harness.stack import Stack

STEPS = (0, 1_000, 10_000)
MEASURE_SECONDS = 20.0
SETTLE_SECONDS = 3.0
TRACK_TIMEOUT_SECONDS = 20.0
FILES_NEEDED = max(STEPS) + 1024  # one end of every connection per process
MB = 1_000_000  # the target says MB: decimal, the stricter reading
TARGET_CPU_PERCENT = {1_000: 1.0, 10_000: 5.0}
TARGET_RSS_MB = 80.0


def raise_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= FILES_NEEDED:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FILES_NEEDED, max(hard, FILES_NEEDED)))
    except (ValueError, OSError) as exc:
        raise KvwatchError(
            f"cannot open {FILES_NEEDED} files (limit {soft}/{hard}): {exc}",
            f"raise the hard limit to {FILES_NEEDED} or more (ulimit -Hn; LimitNOFILE= "
            "under systemd) and run again",
        ) from exc


def hold_idle_clients(port: int, orders: Connection) -> None:
    """Child process: for each count it is sent, opens idle connections up to that count
    and answers with the count; holds them until told None (or the parent goes away)."""
    raise_file_limit()
    clients: list[socket.socket] = []
    while (count := orders.recv()) is not None:
        while len(clients) < count:
            client = socket.create_connection(("127.0.0.1", port))
            client.sendall(b"idle\n")
            clients.append(client)
        orders.send(len(clients))
    for client in clients:
        client.close()


def tracked(stack: Stack) -> int:
    return int(scrape(f"{stack.agent_url}/metrics").get("kvwatch_bpf_sockets_tracked", 0))


def wait_tracked(stack: Stack, count: int) -> None:
    deadline = time.monotonic() + TRACK_TIMEOUT_SECONDS
    while (seen := tracked(stack)) < count:
        if time.monotonic() > deadline:
            raise KvwatchError(
                f"the agent tracks {seen} sockets, {count} expected",
                f"read the agent's log in {stack.workdir}",
            )
        time.sleep(0.5)


def measure_window(agent: psutil.Process, stack: Stack) -> dict[str, Any]:
    """CPU share and memory of the agent over MEASURE_SECONDS, scrapes included."""
    before, start = agent.cpu_times(), time.monotonic()
    seen = tracked(stack)
    rss_peak = 0
    while time.monotonic() - start < MEASURE_SECONDS:
        rss_peak = max(rss_peak, agent.memory_info().rss)
        time.sleep(0.5)
    seen = max(seen, tracked(stack))
    after, elapsed = agent.cpu_times(), time.monotonic() - start
    user, system = after.user - before.user, after.system - before.system
    memory = agent.memory_info()
    return {
        "tracked_sockets": seen,
        "seconds": round(elapsed, 2),
        "cpu_percent_of_core": round(100 * (user + system) / elapsed, 2),
        "cpu_user_percent": round(100 * user / elapsed, 2),
        "cpu_system_percent": round(100 * system / elapsed, 2),
        "rss_mb": round(memory.rss / MB, 1),
        "rss_peak_mb": round(max(rss_peak, memory.rss) / MB, 1),
        "threads": agent.num_threads(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }


def measure_steps(stack: Stack, scenario: Scenario, orders: Connection) -> list[dict[str, Any]]:
    agent = psutil.Process(stack.start_agent("--mode", "observe", port=scenario.port).pid)
    steps: list[dict[str, Any]] = []
    for count in STEPS:
        orders.send(count)
        orders.recv()
        scenario.wait_for_server_sockets(count, timeout_seconds=TRACK_TIMEOUT_SECONDS)
        wait_tracked(stack, count)
        time.sleep(SETTLE_SECONDS)
        steps.append({"sockets": count, **measure_window(agent, stack)})
    return steps


def measure() -> dict[str, Any]:
    raise_file_limit()
    context = multiprocessing.get_context("spawn")
    orders, child_end = context.Pipe()
    with (
        tempfile.TemporaryDirectory(prefix="kvwatch-bench-") as tmp,
        Stack(Path(tmp)) as stack,
        Scenario() as scenario,
    ):
        clients = context.Process(target=hold_idle_clients, args=(scenario.port, child_end))
        clients.start()
        try:
            steps = measure_steps(stack, scenario, orders)
        finally:
            orders.send(None)
            clients.join(timeout=10)
            if clients.is_alive():
                clients.kill()
    met: dict[str, bool] = {}
    for step in steps:
        if step["sockets"] in TARGET_CPU_PERCENT:
            met[f"cpu_{step['sockets']}"] = (
                step["cpu_percent_of_core"] <= TARGET_CPU_PERCENT[step["sockets"]]
            )
    met["rss"] = all(step["rss_peak_mb"] <= TARGET_RSS_MB for step in steps)
    return {
        "measure_seconds": MEASURE_SECONDS,
        "steps": steps,
        "targets": {
            "cpu_percent_of_core_max": {str(k): v for k, v in TARGET_CPU_PERCENT.items()},
            "rss_mb_max": TARGET_RSS_MB,
        },
        "met": met,
    }


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps"]
    labels = [f"{s['sockets']:,}" for s in steps]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(labels, [s["cpu_user_percent"] for s in steps], label="user", color="tab:blue")
    left.bar(
        labels,
        [s["cpu_system_percent"] for s in steps],
        bottom=[s["cpu_user_percent"] for s in steps],
        label="system",
        color="tab:orange",
    )
    for index, step in enumerate(steps):
        target = TARGET_CPU_PERCENT.get(step["sockets"])
        if target is not None:
            left.hlines(target, index - 0.4, index + 0.4, colors="red", linestyles="--")
    left.set_xlabel("tracked sockets")
    left.set_ylabel("% of one core")
    left.set_title("agent CPU (red: target)")
    left.legend()
    right.bar(labels, [s["rss_peak_mb"] for s in steps], color="tab:green")
    right.axhline(TARGET_RSS_MB, color="red", linestyle="--", label="target 80 MB")
    right.set_xlabel("tracked sockets")
    right.set_ylabel("RSS (MB)")
    right.set_title("agent memory")
    right.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "footprint.png", dpi=100)


def main() -> None:
    result = measure()
    path = write_result("footprint", result)
    plot(result)
    for step in result["steps"]:
        target = TARGET_CPU_PERCENT.get(step["sockets"])
        print(
            f"{step['sockets']:>6} sockets ({step['tracked_sockets']} tracked): "
            f"CPU {step['cpu_percent_of_core']}% of a core"
            + (f" (target <= {target}%)" if target is not None else "")
            + f", RSS {step['rss_mb']} MB (peak {step['rss_peak_mb']}), "
            f"{step['threads']} threads"
        )
    print(f"targets met: {result['met']}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()

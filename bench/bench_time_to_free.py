"""Time to free: from a client's last read to its request's KV freed, with park on and off,
for clients as the world has them.

The reference engine runs in the server namespace of a test network (agent/lab/netlab.py:
a veth pair, MTU 1500, so MSS 1448), the agent enforcing on the host with real BPF, and the
clients in the client namespace. Each configuration runs STALLED_CLIENTS clients, started
ARRIVAL_SECONDS apart, that read their first bytes and then stop reading for good, in a fresh
engine and agent:
- buffers "default": the kernel's default receive buffer (tcp_rmem[1], autotuning), what a
  browser or an SDK gets; "4k": a 4 KB SO_RCVBUF, the demo's old stalled client;
- park "on": the agent parks after PARK_SECONDS of back-pressure (docs/agent.md, "Park") and
  cuts after the proof; "off": only the cut, after the proof (cancel through the hook).
Measured per stalled client, from the agent's audit log and the readers' own clocks (both
CLOCK_MONOTONIC on this machine):
  last read -> KV freed    = the freeing outcome's time (park "parked", else the cancel's
                             "cancelled") minus the moment the client stopped reading;
  pressure -> KV freed     = the same from when its back-pressure began (the decision's time
                             minus its `stalled_seconds`): the engine goes on generating into
                             the buffers between the two (until they are full, the engine is not
                             held by the client and declines a park: it is asked again);
REPEATS repetitions; p50/p99 over all stalls of a configuration and the spread of the
per-repetition p99. What parking costs a live 4 KB/s reader is bench/bench_park.py's.

Target (issue #23): KV freed p99 <= park_seconds + 0.5 s, from the start of back-pressure.

Run as root: `python -m bench.bench_time_to_free` (or `make bench`). Writes
bench/results/time_to_free.json and time_to_free.png.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_result
from kvwatch.lab.labs import MAX_TOKENS, SERVER_PORT, Agent, EngineLab
from kvwatch.lab.loadgen.report import percentile
from kvwatch.lab.netlab import Link
from kvwatch.lab.readers import Buffer, Reader
from kvwatch.lab.waiting import wait_until

PARK_SECONDS = 2.0
STALLED_CLIENTS = 6
ARRIVAL_SECONDS = 1.0
REPEATS = 3
FREE_TIMEOUT_SECONDS = 120.0
BUFFERS: tuple[Buffer, ...] = ("default", "4k")
PARK = ("on", "off")
FREEING = {"park": "parked", "cancel": "cancelled"}


def freed_at(agent: Agent, request_id: str) -> tuple[int, int] | None:
    """(when the KV was freed, when back-pressure began) for one request, or None yet."""
    outcomes = [
        e
        for e in agent.audit_entries("outcome")
        if e["request_id"] == request_id and FREEING.get(e["action"]) == e["result"]["status"]
    ]
    if not outcomes:
        return None
    decision = next(
        e for e in agent.audit_entries("decision") if e["decision_id"] == outcomes[0]["decision_id"]
    )
    pressure_ns = decision["monotonic_ns"] - int(decision["evidence"]["stalled_seconds"] * 1e9)
    return outcomes[0]["monotonic_ns"], pressure_ns


def configuration(buffer: Buffer, park: str, workdir: Path) -> dict[str, Any]:
    """One engine and agent, and STALLED_CLIENTS stalled clients."""
    lab = EngineLab(workdir, Link())
    agent = Agent(workdir)
    try:
        agent.hook_socket = lab.hook_socket
        agent.start_agent(
            "--mode", "enforce", "--grace-seconds", "0", "--park", park,
            "--park-seconds", str(PARK_SECONDS), "--max-cancels-per-minute", "1000",
            port=SERVER_PORT, audit="audit.jsonl",
        )  # fmt: skip
        agent.wait_engine_connected()
        stalled = []
        for index in range(STALLED_CLIENTS):
            name = f"stalled-{index}"
            stalled.append(lab.request(Reader(name, buffer, 0, read_seconds=0), name))
            time.sleep(ARRIVAL_SECONDS)
        wait_until(
            lambda: all(freed_at(agent, f"cmpl-{r.name}") for r in stalled),
            FREE_TIMEOUT_SECONDS,
            "every stalled client's KV freed",
        )
        from_read, from_pressure = [], []
        for reader in stalled:
            freed = freed_at(agent, f"cmpl-{reader.name}")
            assert freed is not None
            from_read.append((freed[0] - reader.stopped_ns) / 1e9)
            from_pressure.append((freed[0] - freed[1]) / 1e9)
        return {
            "buffer": buffer,
            "park": park,
            "last_read_to_free_seconds": [round(v, 3) for v in from_read],
            "pressure_to_free_seconds": [round(v, 3) for v in from_pressure],
            "park_tries": [
                max(
                    (
                        e["result"]["attempt"]
                        for e in agent.audit_entries("outcome")
                        if e["request_id"] == f"cmpl-{r.name}" and e["action"] == "park"
                    ),
                    default=0,
                )
                for r in stalled
            ],
        }
    finally:
        agent.close()
        lab.close()


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p99 over every stall of the configuration, and the spread of per-run p99s."""

    def at(values: list[float], fraction: float) -> float:
        value = percentile(values, fraction)
        assert value is not None, "every run frees every stalled client's KV"
        return round(value, 3)

    def stats(key: str) -> dict[str, float]:
        p99s = [at(row[key], 0.99) for row in rows]
        values = [v for row in rows for v in row[key]]
        return {
            "p50": at(values, 0.5),
            "p99": at(values, 0.99),
            "p99_min": min(p99s),
            "p99_max": max(p99s),
        }

    tries = [t for row in rows for t in row["park_tries"]]
    return {
        "last_read_to_free": stats("last_read_to_free_seconds"),
        "pressure_to_free": stats("pressure_to_free_seconds"),
        "park_tries_max": max(tries, default=0),
    }


def measure() -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(REPEATS):
        for buffer in BUFFERS:
            for park in PARK:
                name = f"{buffer}_park_{park}"
                print(f"repetition {repeat + 1} of {REPEATS}: {name}", flush=True)
                with tempfile.TemporaryDirectory(prefix="kvwatch-bench-") as tmp:
                    runs.setdefault(name, []).append(configuration(buffer, park, Path(tmp)))
    summaries = {name: summary(rows) for name, rows in runs.items()}
    target = PARK_SECONDS + 0.5
    return {
        "park_seconds": PARK_SECONDS,
        "stalled_clients": STALLED_CLIENTS,
        "max_tokens": MAX_TOKENS,
        "link": "veth pair, MTU 1500 (MSS 1448), no delay",
        "repetitions": runs,
        "summary": summaries,
        "target_pressure_to_free_p99_seconds": target,
        "met": {
            name: s["pressure_to_free"]["p99"] <= target
            for name, s in summaries.items()
            if name.endswith("park_on")
        },
    }


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["repetitions"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for axis, key, title in (
        (axes[0], "last_read_to_free_seconds", "from the client's last read"),
        (axes[1], "pressure_to_free_seconds", "from the start of back-pressure"),
    ):
        data = [[v for row in result["repetitions"][n] for v in row[key]] for n in names]
        axis.boxplot(data, tick_labels=[n.replace("_park_", "\npark ") for n in names])
        axis.axhline(
            result["park_seconds"], color="tab:green", linestyle="--", label="park_seconds"
        )
        axis.set_title(f"KV freed, {title}")
        axis.set_yscale("log")
        axis.legend(fontsize=8)
    axes[0].set_ylabel("seconds")
    fig.suptitle(
        f"{STALLED_CLIENTS} stalled clients per run over a veth pair (MSS 1448), "
        f"{REPEATS} repetitions"
    )
    fig.tight_layout()
    fig.savefig(RESULTS / "time_to_free.png", dpi=100)


def main() -> None:
    result = measure()
    path = write_result("time_to_free", result)
    plot(result)
    print("configuration          last read -> free p50/p99   pressure -> free p50/p99   "
          "park tries")  # fmt: skip
    for name, s in result["summary"].items():
        read, pressure = s["last_read_to_free"], s["pressure_to_free"]
        print(
            f"{name:<22}{read['p50']:>12.2f} /{read['p99']:>6.2f}"
            f"{pressure['p50']:>17.2f} /{pressure['p99']:>6.2f}"
            f"   {s['park_tries_max']}"
        )
    print(f"written to {path}")


if __name__ == "__main__":
    main()

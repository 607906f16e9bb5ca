"""Behind a proxy: from a client's last read to its request's KV freed, behind nginx and
behind haproxy (Debian's, configured for SSE with small client socket buffers, as in
tests/proxy), side by side in one run.

For each proxy: the reference engine, the proxy in front of it and the agent (enforce,
cancel, watching both ports) run as processes; clients arrive one after another, each reads
the first bytes of a long stream through the proxy and stops. Measured per client, all on
CLOCK_MONOTONIC:
  time to act   = the agent's decision - the client's last read (the reader guarantee:
                  at least stall_seconds, and until the kernel shows a reader at the
                  guaranteed rate would have moved);
  time to free  = the cancel outcome (written when the engine acknowledges the freed KV)
                  - the client's last read;
  client reset  = whether the client's socket was reset at the proxy.

Run as root: `python -m bench.bench_proxy`. Writes bench/results/proxy.json and proxy.png.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_result
from kvwatch.config.schema import DEFAULT_MIN_READER_BYTES_PER_SECOND
from kvwatch.lab.harness.cut_stack import STALL_SECONDS, CutStack
from kvwatch.lab.proxies import PROXIES, Proxy, client, start_proxy, through

CLIENTS_PER_PROXY = 8
WAIT_SECONDS = 15.0


GUARANTEE = DEFAULT_MIN_READER_BYTES_PER_SECOND  # the agent's default
LONG_TOKENS = 1400  # ~250 KB: an answer the proxy's and the kernel's buffers cannot hold


def one_client(stack: CutStack, proxy: Proxy, name: str) -> dict[str, Any]:
    reader = through(proxy, client(name, "4k", GUARANTEE, 0), LONG_TOKENS)
    request_id = f"cmpl-{name}"
    try:
        deadline = time.monotonic() + WAIT_SECONDS
        outcome = None
        while time.monotonic() < deadline and outcome is None:
            outcome = next(
                (
                    o for o in stack.audit_entries("outcome")
                    if o["request_id"] == request_id and o["action"] == "cancel"
                ),
                None,
            )  # fmt: skip
            time.sleep(0.05)
        time.sleep(0.3)  # the reset that follows the cancel
    finally:
        reader.close()
    decision = next(
        (d for d in stack.audit_entries("decision") if d["request_id"] == request_id), None
    )
    if outcome is None or decision is None or not reader.stopped_ns:
        return {"client": name, "freed": False}
    return {
        "client": name,
        "freed": outcome["result"]["status"] == "cancelled",
        "freed_bytes": outcome["result"]["freed_bytes"],
        "time_to_act_s": round((decision["monotonic_ns"] - reader.stopped_ns) / 1e9, 3),
        "time_to_free_s": round((outcome["monotonic_ns"] - reader.stopped_ns) / 1e9, 3),
        "required_s": decision["evidence"]["stall_required_seconds"],
        "chain": decision["evidence"]["relay"]["chain"] if decision["evidence"]["relay"] else None,
        "client_reset": bool(reader.reset_ns or reader.ended_ns),
    }


def run_proxy(name: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"kvwatch-bench-{name}-") as workdir:
        stack = CutStack(Path(workdir))
        proxy = None
        try:
            stack.start_engine()
            proxy = start_proxy(name, Path(workdir), stack.engine_port, small_buffers=True)
            stack.start_agent(
                "--mode", "enforce", "--port", str(stack.engine_port), port=proxy.port
            )  # fmt: skip
            stack.wait_engine_connected()
            clients = [one_client(stack, proxy, f"{name}-{i}") for i in range(CLIENTS_PER_PROXY)]
        finally:
            if proxy is not None:
                proxy.stop()
            stack.close()
    freed = [c for c in clients if c["freed"]]
    frees = [c["time_to_free_s"] for c in freed]
    cancels_ms = [1000 * (c["time_to_free_s"] - c["time_to_act_s"]) for c in freed]
    return {
        "clients": clients,
        "freed": len(freed),
        "of": len(clients),
        "time_to_free_median_s": round(statistics.median(frees), 3) if frees else None,
        "time_to_free_max_s": max(frees) if frees else None,
        "cancel_after_decision_median_ms": (
            round(statistics.median(cancels_ms), 1) if cancels_ms else None
        ),
        "clients_reset": sum(1 for c in clients if c.get("client_reset")),
    }


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for index, name in enumerate(PROXIES):
        clients = [c for c in result["proxies"][name]["clients"] if c["freed"]]
        for offset, key, marker, label, color in (
            (-0.1, "time_to_act_s", "o", "decision", "tab:blue"),
            (0.1, "time_to_free_s", "x", "KV freed", "tab:red"),
        ):
            ax.scatter(
                [index + offset] * len(clients),
                [c[key] for c in clients],
                marker=marker,
                label=label if index == 0 else None,
                color=color,
            )
    ax.axhline(STALL_SECONDS, color="grey", linestyle=":", label="stall_seconds")
    ax.set_xticks(range(len(PROXIES)), PROXIES)
    ax.set_ylabel("seconds after the client's last read")
    ax.set_title("Behind a proxy: client stops reading → engine KV freed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "proxy.png", dpi=100)


def main() -> None:
    proxies = {name: run_proxy(name) for name in PROXIES}
    result = {
        "stall_seconds": STALL_SECONDS,
        "min_reader_bytes_per_second": GUARANTEE,
        "proxies": proxies,
    }
    path = write_result("proxy", result)
    plot(result)
    for name, found in proxies.items():
        print(
            f"{name}: freed {found['freed']}/{found['of']}, "
            f"median {found['time_to_free_median_s']} s, max {found['time_to_free_max_s']} s, "
            f"cancel after decision {found['cancel_after_decision_median_ms']} ms, "
            f"clients reset {found['clients_reset']}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

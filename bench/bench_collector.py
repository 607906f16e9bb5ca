"""The price of watching, per token: the CPU a token costs with the BPF collector and
without, each BPF handler's ns per event next to this kernel's floor, the table read at
10,000 sockets, and the agent's footprint, side by side in one run.

1. CPU per token (bench/collector_cpu.py), at 64 and 1,000 streams, in many short phases
   with the programs attached and detached in turn (ABBA). On a shared machine the CPU a
   token costs moves by tens of percent from one second to the next, so the overhead is
   measured as a ratio inside one process: a token pump (bench/token_load.py) serves a
   watched and a control set of streams in turns, and what a watched token costs beyond a
   control token, programs attached against detached, is what tracking adds (median,
   bootstrap 95% interval). Added to it: the dispatch floor every socket pays (events per
   token x the empty program's ns) and the agent's table reads; divided by the CPU an SSE
   token costs with the programs detached (an asyncio SSE server and its reader in a
   cgroup, kernel time included). That SSE load also gives
   the direct on/off ratio of its CPU per token and of its throughput (secondary figures).
2. ns per event, from the kernel's BPF statistics (kernel.bpf_stats_enabled), for both record
   layouts (socket-local storage and the LRU hash), next to reference programs on the same
   attach points and traffic (bench/bpf/calibrate.bpf.c): an empty program (the floor: the
   cost of being attached and measured), one LRU lookup, one socket-storage lookup.
3. One read of the whole table (and of the samples made from it) at 10,000 idle sockets.
4. The agent's footprint at 0, 1,000 and 10,000 sockets (bench/bench_footprint.py).

Run as root: `python -m bench.bench_collector` (or `make bench`). Writes
bench/results/collector.json and collector.png.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import bench_footprint, collector_cpu
from bench.common import RESULTS, write_result
from bench.token_load import TokenLoad, TokenPump
from kvwatch.collect.bpf.collector import BpfCollector
from kvwatch.collect.bpf.libbpf import check_ptr, check_rc, libbpf
from kvwatch.collect.bpf.loader import STORAGES, CollectorSettings
from kvwatch.collect.bpf.runstats import ProgramRunStats, program_run_stats, set_stats_enabled

STREAM_COUNTS = (64, 1_000)
# The node's token rate, shared by its streams: paced as decode steps pace them, below what
# this 2-core machine can serve, so batching (and with it the CPU a token costs) is steady.
TOKENS_PER_SECOND = 16_000
WARM_UP_SECONDS = 2.0
STATS_SECONDS = 4.0
SNAPSHOT_SOCKETS = 10_000
SNAPSHOT_READS = 15
CALIBRATE_OBJECT = Path(__file__).parent / "bpf" / "calibrate.bpf.o"
# The floor each kvwatch attach point is compared with: an empty program on the same
# tracepoint.
FLOOR = {"send": "calibrate_empty_send", "ack": "calibrate_empty", "read": "calibrate_empty_read"}
UNFILTERED_POINTS = {"read"}
TARGETS = {
    "handler_over_empty_max": 2.5,
    "cpu_overhead_percent_max": 1.0,
    "snapshot_ms_max": 20.0,
}


@contextmanager
def calibration_programs() -> Iterator[dict[str, int]]:
    """The reference programs, loaded and attached: name -> program fd."""
    lib = libbpf()
    handle = check_ptr(
        lib.bpf_object__open_file(str(CALIBRATE_OBJECT).encode(), None),
        f"open {CALIBRATE_OBJECT} (run `make -C bench/bpf`)",
    )
    links: list[int] = []
    try:
        check_rc(lib.bpf_object__load(handle), "load the calibration programs")
        programs: dict[str, int] = {}
        program = lib.bpf_object__next_program(handle, None)
        while program:
            name = lib.bpf_program__name(program).decode()
            links.append(check_ptr(lib.bpf_program__attach(program), f"attach {name}"))
            programs[name] = lib.bpf_program__fd(program)
            program = lib.bpf_object__next_program(handle, program)
        yield programs
    finally:
        for link in links:
            lib.bpf_link__destroy(link)
        lib.bpf_object__close(handle)


def costs_window(load: TokenLoad, order: tuple[str, ...]) -> tuple[dict[str, Any], int]:
    """Run counts and times over STATS_SECONDS of both record layouts' programs, attached in
    `order` (the first program on an attach point finds the socket's cache lines cold), then
    the reference programs; and the tokens written meanwhile."""
    collectors = {
        storage: BpfCollector(CollectorSettings(ports=(load.port,), storage=storage))
        for storage in order
    }
    previous = set_stats_enabled(True)
    try:
        with calibration_programs() as reference:
            fds = {
                f"{storage}.{point}": fd
                for storage, collector in collectors.items()
                for point, fd in collector.programs.program_fds().items()
            }
            fds.update(reference)
            before = {name: program_run_stats(fd) for name, fd in fds.items()}
            start = load.read()
            time.sleep(STATS_SECONDS)
            end = load.read()
            after = {name: program_run_stats(fd) for name, fd in fds.items()}
    finally:
        set_stats_enabled(previous)
        for collector in collectors.values():
            collector.close()
    deltas = {
        name: ProgramRunStats(
            after[name].run_count - before[name].run_count,
            after[name].run_time_ns - before[name].run_time_ns,
        )
        for name in fds
    }
    return deltas, end.tokens - start.tokens


def handler_costs(load: TokenLoad) -> dict[str, Any]:
    """ns per event and events per token of each attach point in both record layouts,
    attached side by side on the same traffic (two windows, each layout first once), and of
    the reference programs, which run last and so find the socket warm."""
    totals: dict[str, ProgramRunStats] = {}
    tokens = 0
    for order in (STORAGES, STORAGES[::-1]):
        deltas, written = costs_window(load, order)
        tokens += written
        for name, delta in deltas.items():
            seen = totals.get(name, ProgramRunStats(0, 0))
            totals[name] = ProgramRunStats(
                seen.run_count + delta.run_count, seen.run_time_ns + delta.run_time_ns
            )

    def cost(stats: ProgramRunStats) -> dict[str, float]:
        return {
            "ns_per_event": round(stats.average_ns, 1),
            "events_per_token": round(stats.run_count / tokens, 3) if tokens else 0.0,
        }

    reference = {name: cost(s) for name, s in totals.items() if name.startswith("calibrate")}
    result: dict[str, Any] = {}
    for storage in STORAGES:
        points = {
            name.split(".", 1)[1]: cost(s)
            for name, s in totals.items()
            if name.startswith(f"{storage}.")
        }
        ns_per_token = sum(points[h]["ns_per_event"] * points[h]["events_per_token"] for h in FLOOR)
        result[storage] = {**points, **reference, "bpf_ns_per_token": round(ns_per_token, 1)}
    return result


def at_streams(streams: int) -> dict[str, Any]:
    with TokenPump(streams) as pump:
        time.sleep(WARM_UP_SECONDS)
        pump_result = collector_cpu.pump_pairs(pump)
    with TokenLoad(streams, TOKENS_PER_SECOND / streams) as load:
        deadline = time.monotonic() + 30
        while load.read().tokens == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(WARM_UP_SECONDS)
        sse_result = collector_cpu.sse_pairs(load)
        handlers = handler_costs(load)
    default = handlers["sk_storage"]
    # What every socket pays, watched or not: the empty program's dispatch on the attach
    # points that drop unwatched sockets at their first instructions (send, ACK), and the
    # whole handler on the read attach point, which has no port filter (it tests the reading
    # process's kv_writers bit first; the SSE clients write to no tracked socket, so that is
    # what they pay).
    floor_ns = sum(
        default[point]["events_per_token"]
        * default[point if point in UNFILTERED_POINTS else floor]["ns_per_event"]
        for point, floor in FLOOR.items()
    )
    return {
        "streams": streams,
        "overhead_percent_total": collector_cpu.overhead_percent(pump_result, sse_result, floor_ns),
        "floor_ns_per_token": round(floor_ns, 1),
        "pump": collector_cpu.summarize_pump(pump_result),
        "sse": collector_cpu.summarize_sse(sse_result),
        "handlers": handlers,
    }


def accept_all(listener: socket.socket, count: int, into: list[socket.socket]) -> None:
    while len(into) < count:
        into.append(listener.accept()[0])


def hold_clients(port: int, count: int, done: Any) -> None:
    """Child process: `count` idle connections, held until the parent goes away."""
    bench_footprint.raise_file_limit()
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    done.send(len(clients))
    done.recv()


def timed_ms(read: Any) -> tuple[float, float]:
    """Wall and CPU milliseconds of one call."""
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    read()
    return (time.perf_counter_ns() - wall) / 1e6, (time.thread_time_ns() - cpu) / 1e6


def snapshot_reads(count: int = SNAPSHOT_SOCKETS) -> dict[str, Any]:
    """The table read whole, and turned into samples, at `count` idle sockets, per layout."""
    import multiprocessing

    bench_footprint.raise_file_limit()
    listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
    port = listener.getsockname()[1]
    collectors = {s: BpfCollector(CollectorSettings(ports=(port,), storage=s)) for s in STORAGES}
    accepted: list[socket.socket] = []
    acceptor = threading.Thread(target=accept_all, args=(listener, count, accepted), daemon=True)
    acceptor.start()
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    child = multiprocessing.get_context("fork").Process(
        target=hold_clients, args=(port, count, theirs)
    )
    child.start()
    try:
        ours.recv()
        acceptor.join(timeout=60)
        result: dict[str, Any] = {"sockets": count}
        for storage, collector in collectors.items():
            table = collector.programs.table
            records = len(table.read_raw())
            raw = [timed_ms(table.read_raw) for _ in range(SNAPSHOT_READS)]
            collector._converted = {}
            cold = timed_ms(collector.samples)
            warm = [timed_ms(collector.samples) for _ in range(SNAPSHOT_READS)]
            result[storage] = {
                "records": records,
                "table_read_ms": round(statistics.median(w for w, _ in raw), 2),
                "table_read_cpu_ms": round(statistics.median(c for _, c in raw), 2),
                "samples_first_read_ms": round(cold[0], 2),
                "samples_read_ms": round(statistics.median(w for w, _ in warm), 2),
                "samples_read_cpu_ms": round(statistics.median(c for _, c in warm), 2),
            }
        return result
    finally:
        ours.send(None)
        child.join(timeout=30)
        for sock in accepted:
            sock.close()
        listener.close()
        for collector in collectors.values():
            collector.close()


def judged(result: dict[str, Any]) -> dict[str, Any]:
    """Each target, met or not, with the figure it was judged on."""
    met: dict[str, Any] = {}
    for row in result["streams"]:
        handlers = row["handlers"]["sk_storage"]
        for point, floor in FLOOR.items():
            times = round(handlers[point]["ns_per_event"] / handlers[floor]["ns_per_event"], 2)
            met[f"{point}_over_empty_at_{row['streams']}"] = {
                "value": times,
                "met": times <= TARGETS["handler_over_empty_max"],
            }
        total = row["overhead_percent_total"]
        met[f"cpu_overhead_at_{row['streams']}"] = {
            "value": total,
            "met": total["median"] <= TARGETS["cpu_overhead_percent_max"],
        }
    snapshot = result["snapshot"]["sk_storage"]["samples_read_ms"]
    met["snapshot_10k"] = {"value": snapshot, "met": snapshot <= TARGETS["snapshot_ms_max"]}
    met.update({f"footprint_{k}": v for k, v in result["footprint"]["met"].items()})
    return met


def measure() -> dict[str, Any]:
    result: dict[str, Any] = {"streams": [at_streams(count) for count in STREAM_COUNTS]}
    result["snapshot"] = snapshot_reads()
    result["footprint"] = bench_footprint.measure()
    result["targets"] = {**TARGETS, **result["footprint"]["targets"]}
    result["met"] = judged(result)
    return result


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    row = result["streams"][0]
    handlers = row["handlers"]
    bars: dict[str, dict[str, float]] = {}
    for point, floor in FLOOR.items():
        bars[f"{point} (sk_storage)"] = handlers["sk_storage"][point]
        bars[f"{point} (lru_hash)"] = handlers["lru_hash"][point]
        bars[f"floor: empty {point}"] = handlers["sk_storage"][floor]
    bars["ref: storage get"] = handlers["sk_storage"]["calibrate_storage"]
    bars["ref: LRU lookup"] = handlers["sk_storage"]["calibrate_lookup"]
    colours = ["grey" if name.startswith(("floor", "ref")) else "tab:orange" for name in bars]
    left.bar(list(bars), [b["ns_per_event"] for b in bars.values()], color=colours)
    for index, floor in enumerate(FLOOR.values()):
        limit = TARGETS["handler_over_empty_max"] * handlers["sk_storage"][floor]["ns_per_event"]
        left.hlines(limit, 3 * index - 0.4, 3 * index + 2.4, colors="red", linestyles="--")
    left.tick_params(axis="x", labelrotation=45)
    left.set_ylabel("ns per event")
    left.set_title(f"BPF cost per event, {row['streams']} streams (red: 2.5x empty)")
    labels = [str(r["streams"]) for r in result["streams"]]
    views = {
        "total: tracked extra (pump) + floor + table reads": [
            r["overhead_percent_total"] for r in result["streams"]
        ],
        "direct: SSE CPU per token, on/off": [
            r["sse"]["direct_overhead_percent"] for r in result["streams"]
        ],
    }
    for offset, (name, values) in enumerate(views.items()):
        xs = [i + 0.4 * offset for i in range(len(values))]
        errors = [
            [v["median"] - v["ci95_low"] for v in values],
            [v["ci95_high"] - v["median"] for v in values],
        ]
        right.bar(xs, [v["median"] for v in values], width=0.4, yerr=errors, capsize=4, label=name)
    right.set_xticks([i + 0.2 for i in range(len(labels))], [f"{s} streams" for s in labels])
    right.axhline(TARGETS["cpu_overhead_percent_max"], color="red", linestyle="--", label="1%")
    right.axhline(0, color="black", linewidth=0.5)
    right.set_ylabel("extra CPU per token (%), median, 95% CI")
    right.set_title("extra CPU per SSE token (red: 1% target)")
    right.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "collector.png", dpi=100)


def main() -> None:
    result = measure()
    path = write_result("collector", result)
    plot(result)
    print(json.dumps(result, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()

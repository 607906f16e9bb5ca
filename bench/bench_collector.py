"""The cost of watching: SSE-style token streaming over loopback with and without the BPF
collector attached, side by side in one run, plus each program's ns per event.

Throughput phases alternate (off, on, off, on ...) so drift and neighbours hit both sides
alike; the ratio is of the medians. ns per event comes from the kernel's BPF statistics,
next to reference programs on the same tracepoint (bench/bpf/calibrate.bpf.c: an empty
handler, one clock read, one LRU lookup) that show this machine's floor.

Run as root: `python -m bench.bench_collector` (or `make bench`). Writes
bench/results/collector.json and collector.png. Targets: throughput ratio >= 0.98,
<= 150 ns per event per handler.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import selectors
import socket
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.common import RESULTS, write_result
from kvwatch.bpf.collector import BpfCollector
from kvwatch.bpf.libbpf import check_ptr, check_rc, libbpf
from kvwatch.bpf.loader import CollectorSettings
from kvwatch.bpf.runstats import ProgramRunStats, program_run_stats, set_stats_enabled

CONNECTIONS = 64
PHASE_SECONDS = 1.5
ROUNDS = 8
STATS_SECONDS = 4.0
CALIBRATE_OBJECT = Path(__file__).parent / "bpf" / "calibrate.bpf.o"


def drain_forever(port: int, connections: int) -> None:
    """Child process: opens the client connections and reads everything as it arrives."""
    selector = selectors.DefaultSelector()
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if not key.fileobj.recv(1 << 16):  # type: ignore[union-attr]
                return


@dataclass
class TokenServer:
    """Streams one SSE event per token to every connection, counting tokens written."""

    tokens: int = 0

    async def serve(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = 0
        try:
            while True:
                chunk = {"id": "cmpl-bench", "choices": [{"index": 0, "text": f"tok{index}"}]}
                writer.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await writer.drain()
                await asyncio.sleep(0)  # the next token comes from the engine: yield
                index += 1
                self.tokens += 1
        except (ConnectionError, asyncio.CancelledError):
            writer.close()

    async def phase(self, seconds: float) -> float:
        start_tokens, start = self.tokens, time.perf_counter()
        await asyncio.sleep(seconds)
        return (self.tokens - start_tokens) / (time.perf_counter() - start)


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


async def throughput(server: TokenServer, port: int) -> tuple[list[float], list[float], str]:
    off: list[float] = []
    on: list[float] = []
    send_mode = ""
    for _ in range(ROUNDS):
        off.append(await server.phase(PHASE_SECONDS))
        collector = BpfCollector(CollectorSettings(ports=(port,)))
        send_mode = collector.report.send_mode
        on.append(await server.phase(PHASE_SECONDS))
        collector.close()
    return off, on, send_mode


async def handler_costs(server: TokenServer, port: int) -> dict[str, ProgramRunStats]:
    collector = BpfCollector(CollectorSettings(ports=(port,)))
    previous = set_stats_enabled(True)
    try:
        with calibration_programs() as reference:
            await server.phase(STATS_SECONDS)
            fds = {**collector.programs.program_fds(), **reference}
            return {name: program_run_stats(fd) for name, fd in fds.items()}
    finally:
        set_stats_enabled(previous)
        collector.close()


async def measure() -> dict[str, object]:
    server = TokenServer()
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    reader = multiprocessing.Process(target=drain_forever, args=(port, CONNECTIONS), daemon=True)
    reader.start()
    await server.phase(1.0)  # warm up
    off, on, send_mode = await throughput(server, port)
    costs = await handler_costs(server, port)
    reader.kill()
    listener.close()
    return {
        "connections": CONNECTIONS,
        "phase_seconds": PHASE_SECONDS,
        "send_mode": send_mode,
        "tokens_per_second_off": [round(x) for x in off],
        "tokens_per_second_on": [round(x) for x in on],
        "throughput_ratio": round(statistics.median(on) / statistics.median(off), 4),
        "throughput_spread_off": round(statistics.pstdev(off) / statistics.mean(off), 3),
        "ns_per_event": {name: round(s.average_ns, 1) for name, s in costs.items()},
        "events": {name: s.run_count for name, s in costs.items()},
        "targets": {"throughput_ratio_min": 0.98, "ns_per_event_max": 150},
    }


def plot(result: dict[str, object]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = result["ns_per_event"]
    assert isinstance(ns, dict)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    off, on = result["tokens_per_second_off"], result["tokens_per_second_on"]
    assert isinstance(off, list) and isinstance(on, list)
    left.bar(
        ["without", "with collector"],
        [statistics.median(off), statistics.median(on)],
        color=["grey", "tab:blue"],
    )
    left.set_ylabel("SSE tokens / s (64 connections)")
    left.set_title(f"throughput ratio {result['throughput_ratio']}")
    colours = ["tab:grey" if name.startswith("calibrate") else "tab:orange" for name in ns]
    right.bar(list(ns), list(ns.values()), color=colours)
    right.tick_params(axis="x", labelrotation=45)
    right.axhline(150, color="red", linestyle="--", label="target 150 ns")
    right.set_ylabel("ns per event")
    right.set_title("BPF handler cost (kernel.bpf_stats_enabled)")
    right.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "collector.png", dpi=100)


def main() -> None:
    result = asyncio.run(measure())
    path = write_result("collector", result)
    plot(result)
    print(json.dumps(result, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()

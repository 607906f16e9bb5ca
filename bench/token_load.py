"""Token stream loads for the collector benchmark, and the CPU they cost.

`TokenPump` serves two sets of streams, watched and control, in turns from one thread and
times each set's turns: whatever slows the machine (a neighbour, the hypervisor) slows both
alike, so the ratio of their costs per token resolves a fraction of a percent where either
cost alone moves by tens of percent from one second to the next on a shared machine.

`TokenLoad` is the shape of an inference server's HTTP side: a token server (one SSE event
per token to every connection, paced) and a reader that drains every connection run as two
child processes in their own cpuacct cgroup. The cgroup's `cpuacct.usage` is the CPU time, in
nanoseconds, of both processes, kernel time included: on this kernel (no
IRQ_TIME_ACCOUNTING) the loopback softirq that carries each segment, and with it every BPF
program on the send and ACK paths, runs in the context of the process that sent it and is
charged to it. Tokens are counted in shared memory by the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import resource
import selectors
import socket
import time
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from types import TracebackType
from typing import Any

from kvwatch.errors import KvwatchError

# Ahead of ordinary neighbours (a shared machine), so they preempt the load less often.
NICE = -10
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
CGROUP2 = Path("/sys/fs/cgroup/unified")


def serve_tokens(
    listener: socket.socket, streams: int, rate: float, tokens: Synchronized[int]
) -> None:
    """Child process: accepts `streams` connections and writes one SSE event per token to
    each, `rate` tokens a second per stream (as an engine's decode steps pace them), the
    streams' ticks spread evenly over one interval."""

    async def stream(writer: asyncio.StreamWriter, offset: float) -> None:
        loop = asyncio.get_running_loop()
        index = 0
        counter = tokens.get_obj()
        due = loop.time() + offset
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            chunk = {"id": "cmpl-bench", "choices": [{"index": 0, "text": f"tok{index}"}]}
            writer.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await writer.drain()
            index += 1
            counter.value += 1
            due += 1.0 / rate

    async def main() -> None:
        allow_files(streams + 64)
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        tasks: list[asyncio.Task[None]] = []
        for _ in range(streams):
            conn, _ = await loop.sock_accept(listener)
            _, writer = await asyncio.open_connection(sock=conn)
            offset = len(tasks) / streams / rate
            tasks.append(asyncio.create_task(stream(writer, offset)))
        await asyncio.gather(*tasks)

    asyncio.run(main())


def allow_files(count: int) -> None:
    """Raises this process's descriptor limit to at least `count` (root may)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count:
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, max(hard, count)))


def connect_pairs(
    listener: socket.socket, streams: int
) -> list[tuple[socket.socket, socket.socket]]:
    """`streams` connections to `listener`: (server end, client end) each."""
    allow_files(4 * streams + 64)
    pairs = []
    for _ in range(streams):
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pairs.append((server, client))
    listener.close()
    return pairs


def pump_tokens(watched: socket.socket, control: socket.socket, streams: int, totals: Any) -> None:
    """Child process: two sets of `streams` connections, one to the watched port and one to
    a control port the collector filters out, served in turns by one thread. Each token is
    built as the SSE server builds it, written on the server end and read at once on the
    client end (the loopback softirq and the ACK it causes run inside those calls), so every
    token costs the same work. The time of each turn goes to its set: [watched ns, watched
    tokens, control ns, control tokens]. The turns alternate order (ABBA) a few hundred
    times a second, so whatever slows the machine slows both sets alike."""
    sets = (connect_pairs(watched, streams), connect_pairs(control, streams))
    index = 0
    while True:
        for which in (0, 1) if index % 2 == 0 else (1, 0):
            text = f"tok{index}"
            started = time.perf_counter_ns()
            for server, client in sets[which]:
                chunk = {"id": "cmpl-bench", "choices": [{"index": 0, "text": text}]}
                server.send(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                client.recv(1 << 16)
            totals[2 * which] += time.perf_counter_ns() - started
            totals[2 * which + 1] += len(sets[which])
        index += 1


@dataclass(frozen=True)
class PumpReading:
    """Time spent and tokens written by each set of the pump so far."""

    watched_ns: int
    watched_tokens: int
    control_ns: int
    control_tokens: int


class TokenPump:
    """`pump_tokens` in a child process until closed; owns it. `port` is the watched set's
    (the collector filters on it); `control_port` the other's."""

    def __init__(self, streams: int) -> None:
        context = multiprocessing.get_context("fork")
        watched, control = (
            socket.create_server(("127.0.0.1", 0), backlog=streams) for _ in range(2)
        )
        self.port: int = watched.getsockname()[1]
        self.control_port: int = control.getsockname()[1]
        self._totals = context.RawArray("Q", 4)
        self._child = context.Process(
            target=pump_tokens, args=(watched, control, streams, self._totals), daemon=True
        )
        self._child.start()
        watched.close()
        control.close()
        assert self._child.pid is not None
        os.setpriority(os.PRIO_PROCESS, self._child.pid, NICE)

    def read(self) -> PumpReading:
        return PumpReading(*self._totals[:4])

    def close(self) -> None:
        self._child.kill()
        self._child.join(timeout=5)

    def __enter__(self) -> TokenPump:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drain_streams(port: int, streams: int) -> None:
    """Child process: opens the connections and reads everything as it arrives."""
    allow_files(streams + 64)
    selector = selectors.DefaultSelector()
    for _ in range(streams):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if not key.fileobj.recv(1 << 16):  # type: ignore[union-attr]
                return


class CpuCgroup:
    """A cgroup of its own whose CPU time (ns, all tasks, kernel time included) can be read:
    cgroup v1 cpuacct, else cgroup v2 cpu.stat. Removed on close."""

    def __init__(self, name: str) -> None:
        if CPUACCT.is_dir():
            self.path, self._usage = CPUACCT / name, "cpuacct.usage"
        elif CGROUP2.is_dir() or (Path("/sys/fs/cgroup") / "cgroup.controllers").is_file():
            root = CGROUP2 if CGROUP2.is_dir() else Path("/sys/fs/cgroup")
            self.path, self._usage = root / name, "cpu.stat"
        else:
            raise KvwatchError("no cpuacct or cgroup v2 hierarchy", "mount cgroups, run as root")
        self.path.mkdir(exist_ok=True)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def cpu_ns(self) -> int:
        text = (self.path / self._usage).read_text()
        if self._usage == "cpuacct.usage":
            return int(text)
        fields = dict(line.split() for line in text.splitlines())
        return int(fields["usage_usec"]) * 1000

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a task still exiting: the cgroup goes with it
            self.path.rmdir()


@dataclass(frozen=True)
class Reading:
    """Tokens written and CPU spent by the load so far, and when (monotonic ns)."""

    tokens: int
    cpu_ns: int
    at_ns: int


class TokenLoad:
    """`streams` token streams over loopback, `rate` tokens a second each, until closed.
    Owns both children and the cgroup. `port` is the server's: the collector watches it."""

    def __init__(self, streams: int, rate: float, cpu: int | None = None) -> None:
        context = multiprocessing.get_context("fork")
        listener = socket.create_server(("127.0.0.1", 0), backlog=streams)
        self.port: int = listener.getsockname()[1]
        self.streams = streams
        self._tokens = context.Value("Q", 0)
        self._cgroup = CpuCgroup(f"kvwatch-bench-{os.getpid()}")
        self._server = context.Process(
            target=serve_tokens, args=(listener, streams, rate, self._tokens), daemon=True
        )
        self._reader = context.Process(target=drain_streams, args=(self.port, streams), daemon=True)
        self._server.start()
        listener.close()
        self._reader.start()
        for process in (self._server, self._reader):
            assert process.pid is not None
            self._cgroup.add(process.pid)
            if cpu is not None:
                os.sched_setaffinity(process.pid, {cpu})
            os.setpriority(os.PRIO_PROCESS, process.pid, NICE)

    def read(self) -> Reading:
        return Reading(self._tokens.value, self._cgroup.cpu_ns(), time.monotonic_ns())

    def close(self) -> None:
        for process in (self._server, self._reader):
            process.kill()
            process.join(timeout=5)
        self._cgroup.close()

    def __enter__(self) -> TokenLoad:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

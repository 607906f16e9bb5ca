"""What the server sees of a reader that stops: the lab behind bench/bench_visibility.py and
tests/verdicts/test_visibility.py.

One *case* is one TCP connection: a writer emitting SSE-like token events at a token rate,
one write per token or coalesced into chunks, and a reader that reads for a while and then
stops (or a healthy reader that never stops). Many cases run side by side in one process
(threads); a sampler reads every case's two ends every 50 ms:

- the server socket, as kvwatch sees it: `tcp_info` (the peer's window `tcpi_snd_wnd`,
  `tcpi_bytes_acked`, `tcpi_notsent_bytes`, parsed by the agent's own sock_diag parser), and
  the unacknowledged bytes (`SIOCOUTQ` - `SIOCOUTQNSD`, what BPF reads as
  snd_nxt - snd_una);
- the truth: bytes written minus bytes the client read (counted by the two threads), the
  client's unread bytes (`FIONREAD`), its receive buffer and the memory its queue takes
  (`SO_MEMINFO`), its `rcv_ssthresh` and, where the kernel has it, `tcpi_rcv_wnd`.

The backlog estimator the agent will use is computed from the server's samples only:
`estimate = (max window seen - window) + unacked + not sent`, and the right edge
`bytes_acked + window`. Stdlib only besides the agent's tcp_info parser, so that it starts
quickly in the kernel matrix's emulated VMs: `python -m bench.visibility_lab --grid vm
--out FILE` runs the VM grid over loopback and writes its results as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import platform
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvwatch.collect.diag.wire import parse_tcp_info

SAMPLE_SECONDS = 0.05
SIOCOUTQ = termios.TIOCOUTQ  # write_seq - snd_una: unacked + not sent
SIOCOUTQNSD = 0x894B  # write_seq - snd_nxt: not sent
SO_MEMINFO = 55  # u32[]: rmem_alloc, rcvbuf, wmem_alloc, sndbuf, fwd_alloc, wmem_queued, ...
TCPI_RCV_SSTHRESH, TCPI_RCV_SPACE, TCPI_RCV_WND = 64, 96, 232  # rcv_wnd: Linux 6.2+
TCP_INFO_BYTES = 256
RECV_BYTES = 1 << 16
READ_QUANTUM_BYTES = 1024
TICK_SECONDS = 0.02
SSE_EVENT_BYTES = 214  # one token, one SSE event (issue 37's measurement)
VLLM_EVENT_BYTES = 300  # an OpenAI-style completion chunk as vLLM writes it
MAX_TOKENS_BEHIND = 3  # a writer blocked longer than this many tokens skips them (engine paused)

ReaderKind = Literal["stop", "continuous", "paced", "bursty"]


@dataclass(frozen=True)
class WriterSpec:
    """Token events of `event_bytes` at `tokens_per_second`. `coalesce_bytes` None: one write
    per token; else tokens gather in a chunk written when it reaches that many bytes or its
    oldest token has waited `flush_seconds`, whichever first; the stream's first token never
    waits. TCP_NODELAY either way."""

    tokens_per_second: float
    event_bytes: int = SSE_EVENT_BYTES
    coalesce_bytes: int | None = None
    flush_seconds: float = 0.25

    @property
    def bytes_per_second(self) -> float:
        return self.tokens_per_second * self.event_bytes

    def label(self) -> str:
        if self.coalesce_bytes is None:
            return "per-token"
        return f"coalesce {self.coalesce_bytes} B / {self.flush_seconds * 1000:g} ms"


@dataclass(frozen=True)
class ReaderSpec:
    """`stop`: reads what arrives for `read_seconds`, then never again (connection kept
    open); `continuous`: reads what arrives; `paced`: `rate` bytes/s in 1 KB reads;
    `bursty`: drains everything every `burst_seconds`. `rcvbuf` None: the kernel's default,
    autotuned; else a fixed SO_RCVBUF."""

    kind: ReaderKind
    read_seconds: float = 0.0
    rate: int = 0
    burst_seconds: float = 1.0
    rcvbuf: int | None = None

    def label(self) -> str:
        buffer = "" if self.rcvbuf is None else f", SO_RCVBUF {self.rcvbuf}"
        if self.kind == "stop":
            return f"stops after {self.read_seconds:g} s{buffer}"
        if self.kind == "paced":
            return f"reads {self.rate / 1024:g} KB/s{buffer}"
        if self.kind == "bursty":
            return f"drains every {self.burst_seconds:g} s{buffer}"
        return f"reads continuously{buffer}"


@dataclass(frozen=True)
class Case:
    """`seconds`: how long the case runs at most; `until`, when given, ends it sooner (the
    tests: once what they wait for has been seen)."""

    name: str
    writer: WriterSpec
    reader: ReaderSpec
    seconds: float
    until: Callable[[Running], bool] | None = None


@dataclass
class Sample:
    """One look at both ends; times in seconds from the case's start."""

    t: float
    snd_wnd: int
    bytes_acked: int
    unacked: int
    notsent: int
    written: int
    read: int
    tokens: int
    client_unread: int
    client_rcvbuf: int
    client_rmem: int
    client_rcv_ssthresh: int
    client_rcv_wnd: int | None


@dataclass
class Counters:
    """What the writer and reader threads count; plain ints (one writer each)."""

    written: int = 0
    read: int = 0
    last_read: float = 0.0
    tokens: int = 0
    skipped_tokens: int = 0
    token_waits: list[float] = field(default_factory=list)
    write_sizes: list[int] = field(default_factory=list)
    blocked_seconds: float = 0.0


@dataclass
class Connection:
    server: socket.socket
    client: socket.socket


Connect = Callable[[int | None], Connection]


def loopback_connect(rcvbuf: int | None) -> Connection:
    """A connection over 127.0.0.1; the client's SO_RCVBUF set before connect when given."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.socket()
        if rcvbuf is not None:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        client.connect(listener.getsockname())
        server, _ = listener.accept()
    return Connection(server, client)


def event_bytes(size: int, index: int) -> bytes:
    head = f'data: {{"i":{index},"t":"'.encode()
    tail = b'"}\n\n'
    return head + b"x" * max(0, size - len(head) - len(tail)) + tail


class Writer(threading.Thread):
    def __init__(self, spec: WriterSpec, sock: socket.socket, counters: Counters) -> None:
        super().__init__(daemon=True)
        self.spec, self.sock, self.counters = spec, sock, counters
        self.stop = threading.Event()
        self.start_at = 0.0

    def run(self) -> None:
        with contextlib.suppress(OSError):
            self._stream()

    def _stream(self) -> None:
        interval = 1.0 / self.spec.tokens_per_second
        next_token = self.start_at
        pending: list[float] = []  # when each pending token was made
        chunk = bytearray()
        while not self.stop.is_set():
            due = next_token
            if pending and self.spec.coalesce_bytes is not None:
                due = min(due, pending[0] + self.spec.flush_seconds)
            delay = due - time.monotonic()
            if delay > 0 and self.stop.wait(delay):
                return
            now = time.monotonic()
            if now >= next_token:
                chunk += event_bytes(self.spec.event_bytes, self.counters.tokens)
                pending.append(next_token)
                self.counters.tokens += 1
                next_token += interval
            if self._flush_due(chunk, pending, now):
                self._write(bytes(chunk), pending)
                chunk.clear()
                pending.clear()
            next_token = self._skip_if_behind(next_token, interval)

    def _flush_due(self, chunk: bytearray, pending: list[float], now: float) -> bool:
        size = self.spec.coalesce_bytes
        if not pending:
            return False
        if size is None or self.counters.tokens == 1:
            return True
        return len(chunk) >= size or now - pending[0] >= self.spec.flush_seconds

    def _write(self, chunk: bytes, pending: list[float]) -> None:
        before = time.monotonic()
        self.sock.sendall(chunk)
        after = time.monotonic()
        if after - before > 0.01:
            self.counters.blocked_seconds += after - before
        self.counters.written += len(chunk)
        self.counters.write_sizes.append(len(chunk))
        self.counters.token_waits.extend(before - made for made in pending)

    def _skip_if_behind(self, next_token: float, interval: float) -> float:
        """A writer blocked in send() (its window shut) falls behind; like an engine waiting on
        its client it does not make up the tokens afterwards."""
        now = time.monotonic()
        if now - next_token > MAX_TOKENS_BEHIND * interval:
            skipped = int((now - next_token) / interval)
            self.counters.skipped_tokens += skipped
            return next_token + skipped * interval
        return next_token


class Reader(threading.Thread):
    def __init__(self, spec: ReaderSpec, sock: socket.socket, counters: Counters) -> None:
        super().__init__(daemon=True)
        self.spec, self.sock, self.counters = spec, sock, counters
        self.stop = threading.Event()
        self.start_at = 0.0

    def run(self) -> None:
        with contextlib.suppress(OSError):
            if self.spec.kind in ("stop", "continuous"):
                self._read_what_arrives()
            elif self.spec.kind == "paced":
                self._read_paced()
            else:
                self._read_bursts()

    def _took(self, data: bytes) -> None:
        if data:
            self.counters.read += len(data)
            self.counters.last_read = time.monotonic()

    def _read_what_arrives(self) -> None:
        self.sock.settimeout(TICK_SECONDS)
        until = self.start_at + self.spec.read_seconds
        while not self.stop.is_set():
            if self.spec.kind == "stop" and time.monotonic() >= until:
                return  # never reads again; the connection stays open
            with contextlib.suppress(TimeoutError):
                self._took(self.sock.recv(RECV_BYTES))

    def _read_paced(self) -> None:
        self.sock.settimeout(TICK_SECONDS)
        while not self.stop.is_set():
            allowed = int(self.spec.rate * (time.monotonic() - self.start_at))
            want = min(allowed - self.counters.read, READ_QUANTUM_BYTES)
            if want <= 0:
                self.stop.wait(TICK_SECONDS)
                continue
            with contextlib.suppress(TimeoutError):
                self._took(self.sock.recv(want))

    def _read_bursts(self) -> None:
        self.sock.setblocking(False)
        while not self.stop.wait(self.spec.burst_seconds):
            with contextlib.suppress(BlockingIOError):
                while data := self.sock.recv(RECV_BYTES):
                    self._took(data)


def _ioctl_int(sock: socket.socket, request: int) -> int:
    value: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0" * 4))[0]
    return value


def _u32(raw: bytes, offset: int) -> int | None:
    if len(raw) < offset + 4:
        return None
    value: int = struct.unpack_from("=I", raw, offset)[0]
    return value


class Running:
    """One case while it runs: its sockets, threads and samples."""

    def __init__(self, case: Case, connection: Connection) -> None:
        self.case, self.connection = case, connection
        self.counters = Counters()
        connection.server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.writer = Writer(case.writer, connection.server, self.counters)
        self.reader = Reader(case.reader, connection.client, self.counters)
        self.samples: list[Sample] = []
        self.started = 0.0
        raw = connection.server.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
        # The client's window scale: its window moves in steps of 1 << this many bytes.
        self.peer_wscale = parse_tcp_info(raw).peer_wscale

    def start(self) -> None:
        self.started = time.monotonic()
        self.writer.start_at = self.reader.start_at = self.started
        self.writer.start()
        self.reader.start()

    @property
    def done(self) -> bool:
        if time.monotonic() - self.started >= self.case.seconds:
            return True
        return self.case.until is not None and self.case.until(self)

    def stream_rate(self) -> float:
        """Bytes per second the engine made: tokens made over time, over the whole case, or
        up to the reader's stop when the writer was ever blocked (its window shut). Where
        the CPU cannot keep up (an emulated VM) this is below the writer's nominal rate, and
        the seconds of the stream are counted at this rate."""
        samples = self.samples
        if not samples or samples[-1].t <= 0:
            return self.case.writer.bytes_per_second
        last = samples[-1]
        if self.counters.skipped_tokens and self.counters.last_read:
            stop = self.counters.last_read - self.started
            last = next((s for s in reversed(samples) if s.t <= stop and s.t > 0), last)
        return self.case.writer.event_bytes * last.tokens / last.t

    def sample(self) -> None:
        server, client = self.connection.server, self.connection.client
        info = parse_tcp_info(server.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256))
        pending = _ioctl_int(server, SIOCOUTQ)
        notsent = _ioctl_int(server, SIOCOUTQNSD)
        raw = client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
        meminfo = struct.unpack_from("=2I", client.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 64))
        self.samples.append(
            Sample(
                t=time.monotonic() - self.started,
                snd_wnd=info.snd_wnd or 0,
                bytes_acked=info.bytes_acked,
                unacked=pending - notsent,
                notsent=notsent,
                written=self.counters.written,
                read=self.counters.read,
                tokens=self.counters.tokens,
                client_unread=_ioctl_int(client, termios.FIONREAD),
                client_rcvbuf=meminfo[1],
                client_rmem=meminfo[0],
                client_rcv_ssthresh=_u32(raw, TCPI_RCV_SSTHRESH) or 0,
                client_rcv_wnd=_u32(raw, TCPI_RCV_WND),
            )
        )

    def finish(self) -> None:
        self.writer.stop.set()
        self.reader.stop.set()
        for sock in (self.connection.client, self.connection.server):
            # RST at once: no FIN handshake waits behind a shut window.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        self.writer.join(timeout=2)
        self.reader.join(timeout=2)


def run_cases(
    cases: Sequence[Case], connect: Connect, parallel: int = 12
) -> list[tuple[Case, Running]]:
    """Runs `cases`, at most `parallel` at a time, sampling each every 50 ms."""
    queue = list(cases)
    live: list[Running] = []
    finished: list[tuple[Case, Running]] = []
    next_sample = time.monotonic()
    while queue or live:
        while queue and len(live) < parallel:
            running = Running(queue[0], connect(queue[0].reader.rcvbuf))
            queue.pop(0)
            running.start()
            live.append(running)
        for running in list(live):
            running.sample()
            if running.done:
                running.finish()
                live.remove(running)
                finished.append((running.case, running))
        next_sample += SAMPLE_SECONDS
        time.sleep(max(0.0, next_sample - time.monotonic()))
    return finished


# --- What the samples say -----------------------------------------------------------------


def estimates(samples: Sequence[Sample]) -> list[int]:
    """The agent's backlog estimate at each sample, from the server's view alone."""
    largest, out = 0, []
    for s in samples:
        largest = max(largest, s.snd_wnd)
        out.append(largest - s.snd_wnd + s.unacked + s.notsent)
    return out


def estimate_reached(stream_seconds: float) -> Callable[[Running], bool]:
    """For `Case.until`: the reader has stopped and the estimate has reached that many seconds
    of the stream."""

    def reached(running: Running) -> bool:
        stopped = running.case.reader.kind == "stop" and not running.reader.is_alive()
        if not stopped or not running.samples:
            return False
        bound = stream_seconds * running.case.writer.bytes_per_second  # nominal: while running
        return estimates(running.samples)[-1] >= bound

    return reached


def right_edge_ages(samples: Sequence[Sample]) -> list[float]:
    """At each sample, seconds since the right edge (acked + window) last moved on."""
    edge, moved, ages = -1, 0.0, []
    for s in samples:
        if s.bytes_acked + s.snd_wnd > edge:
            edge, moved = s.bytes_acked + s.snd_wnd, s.t
        ages.append(s.t - moved)
    return ages


def _first(
    samples: Sequence[Sample], values: Sequence[float], bound: float, since: float
) -> int | None:
    for index, (s, value) in enumerate(zip(samples, values, strict=True)):
        if s.t >= since and value >= bound:
            return index
    return None


def _episodes(values: Sequence[float], bound: float) -> int:
    count, above = 0, False
    for value in values:
        if value >= bound and not above:
            count += 1
        above = value >= bound
    return count


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _crossing(running: Running, values: Sequence[int], bound: float, stop: float) -> dict[str, Any]:
    """When `values` first reach `bound` after the stop, and what was really unread then."""
    samples, rate = running.samples, running.stream_rate()
    index = _first(samples, values, bound, stop)
    if index is None:
        return {"after_stop_s": None}
    s = samples[index]
    truth = s.written - s.read
    found: dict[str, Any] = {
        "after_stop_s": _round(s.t - stop),
        "true_backlog_bytes": truth,
        "true_backlog_s": _round(truth / rate),
    }
    found["estimate_bytes"] = int(values[index])
    found["missed_bytes"] = truth - int(values[index])
    return found


def _estimate_at(
    running: Running, values: Sequence[int], stop: float, after: float
) -> float | None:
    rate = running.stream_rate()
    for s, value in zip(running.samples, values, strict=True):
        if s.t >= stop + after:
            return _round(value / rate)
    return None


def describe_stop(running: Running) -> dict[str, Any]:
    """A reader that stopped: when the server's view shows it, and what the reader held."""
    samples, rate = running.samples, running.stream_rate()
    stop = running.counters.last_read - running.started
    values = estimates(samples)
    ages = right_edge_ages(samples)
    before = [s for s in samples if s.t <= stop] or samples[:1]
    after = [s for s in samples if s.t >= stop] or samples[-1:]
    last = samples[-1]
    zero = next((s.t - stop for s in after if s.snd_wnd == 0), None)
    return {
        "stopped_at_s": _round(stop),
        "watched_after_stop_s": _round(last.t - stop),
        "estimate_1s": _crossing(running, values, rate, stop),
        "estimate_2s": _crossing(running, values, 2 * rate, stop),
        "estimate_s_at": {f"+{a}s": _estimate_at(running, values, stop, a) for a in (2, 5, 10, 20)},
        "edge_still_1s_after_stop_s": _edge_still(samples, ages, 1.0, stop),
        "edge_still_2s_after_stop_s": _edge_still(samples, ages, 2.0, stop),
        "zero_window_after_stop_s": _round(zero),
        "window_at_stop": before[-1].snd_wnd,
        "max_window": max(s.snd_wnd for s in samples),
        "window_at_end": last.snd_wnd,
        "right_edge_bytes_per_s_after_stop": _edge_rate(after),
        "true_backlog_at_end_s": _round((last.written - last.read) / rate),
        "estimate_at_end_s": _round(values[-1] / rate),
        "client_rcvbuf": {
            "start": samples[0].client_rcvbuf,
            "stop": before[-1].client_rcvbuf,
            "end": last.client_rcvbuf,
        },
        "client_rcv_ssthresh_end": last.client_rcv_ssthresh,
        "client_truesize_per_byte_end": _round(last.client_rmem / max(1, last.client_unread)),
    }


def _edge_still(
    samples: Sequence[Sample], ages: Sequence[float], bound: float, stop: float
) -> float | None:
    index = _first(samples, ages, bound, stop)
    return None if index is None else _round(samples[index].t - stop)


def _edge_rate(after: Sequence[Sample]) -> float | None:
    """How fast the right edge moved on after the stop, bytes/s (skipping the first second)."""
    later = [s for s in after if s.t >= after[0].t + 1.0]
    if len(later) < 2 or later[-1].t <= later[0].t:
        return None
    edge = [s.bytes_acked + s.snd_wnd for s in (later[0], later[-1])]
    return _round((edge[1] - edge[0]) / (later[-1].t - later[0].t), 0)


def describe_healthy(running: Running) -> dict[str, Any]:
    """A reader that keeps reading: how high the estimate went, and the pauses it would cause."""
    samples, rate = running.samples, running.stream_rate()
    settled = [i for i, s in enumerate(samples) if s.t >= 1.0]  # after the first second
    values = [estimates(samples)[i] / rate for i in settled]
    truths = [(samples[i].written - samples[i].read) / rate for i in settled]
    false = {
        f"{bound}s": _episodes(
            [v if t < bound else 0.0 for v, t in zip(values, truths, strict=True)], bound
        )
        for bound in (1, 2)
    }
    ages = right_edge_ages(samples)
    return {
        "estimate_max_s": _round(max(values, default=0.0)),
        "estimate_max_bytes": max((estimates(samples)[i] for i in settled), default=0),
        "true_backlog_max_s": _round(max(truths, default=0.0)),
        "pauses": {f"{b}s": _episodes(values, b) for b in (1, 2)},
        "false_pauses": false,
        "right_edge_still_max_s": _round(max((ages[i] for i in settled), default=0.0)),
        "client_rcvbuf_end": samples[-1].client_rcvbuf,
        "max_window": max(s.snd_wnd for s in samples),
    }


def describe_writer(running: Running) -> dict[str, Any]:
    counters = running.counters
    waits = sorted(counters.token_waits)
    sizes = counters.write_sizes

    def quantile(q: float) -> float:
        return round(1000 * waits[min(len(waits) - 1, int(q * len(waits)))], 1) if waits else 0.0

    elapsed = running.samples[-1].t if running.samples else 0.0
    return {
        "tokens": counters.tokens,
        # Below the spec's rate where the writer fell behind (an emulated CPU) or was blocked.
        "tokens_per_second": round(counters.tokens / elapsed, 1) if elapsed else 0.0,
        "writes": len(sizes),
        "mean_write_bytes": round(sum(sizes) / len(sizes)) if sizes else 0,
        "token_wait_ms": {"p50": quantile(0.5), "p99": quantile(0.99), "max": quantile(1.0)},
        "blocked_s": round(counters.blocked_seconds, 2),
        "skipped_tokens": counters.skipped_tokens,
    }


def describe(case: Case, running: Running) -> dict[str, Any]:
    verdict = describe_stop(running) if case.reader.kind == "stop" else describe_healthy(running)
    return {
        "case": case.name,
        "writer": {**asdict(case.writer), "label": case.writer.label()},
        "reader": {**asdict(case.reader), "label": case.reader.label()},
        "stream_bytes_per_s": round(running.stream_rate()),
        "nominal_bytes_per_s": case.writer.bytes_per_second,
        "peer_wscale": running.peer_wscale,
        "result": verdict,
        "writes": describe_writer(running),
    }


def series(running: Running, every: int = 4) -> dict[str, list[float]]:
    """A thinned time series of one case, for plots: estimate and truth in seconds of stream."""
    rate = running.stream_rate()
    values = estimates(running.samples)
    picked = list(range(0, len(running.samples), every))
    samples = running.samples
    return {
        "t": [round(samples[i].t, 2) for i in picked],
        "estimate_s": [round(values[i] / rate, 3) for i in picked],
        "truth_s": [round((samples[i].written - samples[i].read) / rate, 3) for i in picked],
        "window": [samples[i].snd_wnd for i in picked],
        "client_rcvbuf": [samples[i].client_rcvbuf for i in picked],
    }


def kernel_settings() -> dict[str, str]:
    """The receive-side sysctls that decide what a stopped reader's window does."""
    names = ("tcp_rmem", "tcp_wmem", "tcp_adv_win_scale", "tcp_moderate_rcvbuf")
    found: dict[str, str] = {"release": platform.release()}
    for name in names:
        path = Path("/proc/sys/net/ipv4", name)
        with contextlib.suppress(OSError):
            found[name] = " ".join(path.read_text().split())
    return found


# --- The VM grid (the kernel matrix runs this inside each guest) ---------------------------


def stop_case(
    writer: WriterSpec,
    read_seconds: float,
    watch_seconds: float,
    rcvbuf: int | None = None,
    until: Callable[[Running], bool] | None = None,
) -> Case:
    reader = ReaderSpec("stop", read_seconds=read_seconds, rcvbuf=rcvbuf)
    name = f"{writer.label()} @ {writer.tokens_per_second:g} tok/s, {reader.label()}"
    return Case(name, writer, reader, read_seconds + watch_seconds, until)


def healthy_case(writer: WriterSpec, reader: ReaderSpec, seconds: float) -> Case:
    name = f"{writer.label()} @ {writer.tokens_per_second:g} tok/s, {reader.label()}"
    return Case(name, writer, reader, seconds)


def vm_grid(watch_seconds: float = 20.0) -> list[Case]:
    """Per-token against 512 B and 1 KB coalesced, 35 tokens/s, reader stops after 1 s and
    10 s; and a continuous reader of per-token and 1 KB writes."""
    writers = (
        WriterSpec(35),
        WriterSpec(35, coalesce_bytes=512),
        WriterSpec(35, coalesce_bytes=1024),
    )
    stops = [stop_case(w, r, watch_seconds) for w in writers for r in (1.0, 10.0)]
    healthy = [healthy_case(w, ReaderSpec("continuous"), 20.0) for w in writers[::2]]
    return stops + healthy


def run_and_describe(
    cases: Sequence[Case], connect: Connect, parallel: int = 12, keep_series: bool = True
) -> list[dict[str, Any]]:
    results = []
    for case, running in run_cases(cases, connect, parallel):
        row = describe(case, running)
        if keep_series:
            row["series"] = series(running)
        results.append(row)
    return results


def set_tcp_rmem_max(largest: int | None) -> str:
    """Sets tcp_rmem's largest buffer (which decides the window scale a receiver offers); None
    leaves the kernel's own. Only for a kernel of the lab's own (a VM): it is global."""
    path = Path("/proc/sys/net/ipv4/tcp_rmem")
    if largest is not None:
        low, default, _ = path.read_text().split()
        path.write_text(f"{low} {default} {largest}\n")
    return " ".join(path.read_text().split())


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", choices=["vm"], default="vm")
    parser.add_argument("--watch", type=float, default=20.0, help="seconds watched after a stop")
    parser.add_argument(
        "--rmem-max", type=int, action="append", default=[],
        help="also run the grid with tcp_rmem's largest buffer set to this (inside a VM only)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(list(argv) if argv is not None else None)
    runs = []
    for largest in [None, *args.rmem_max]:
        started = time.monotonic()
        tcp_rmem = set_tcp_rmem_max(largest)
        rows = run_and_describe(vm_grid(args.watch), loopback_connect)
        settings = {**kernel_settings(), "tcp_rmem": tcp_rmem}
        runs.append(
            {
                "kernel": settings,
                "client_tcp_rmem": tcp_rmem,
                "topology": "loopback",
                "seconds": round(time.monotonic() - started, 1),
                "cases": rows,
            }
        )
    args.out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()

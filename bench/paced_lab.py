"""The workload of bench/bench_paced.py (which drives it and sums it up): the reference engine
as `kvwatch engine` starts it, directly or behind a real nginx or haproxy, the agent in one of
four configurations, healthy background streams for a busy engine, clients that stop reading
and live clients, and what each measures, from its own clock, the engine's account of the
request (GET /v1/requests/{id}) and the agent's audit log (all CLOCK_MONOTONIC)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from kvwatch.lab.harness.stack import Service, Stack
from kvwatch.lab.labs import PROMPT, Stream, parse_stream
from kvwatch.lab.loadgen import LoadPlan, run_load
from kvwatch.lab.loadgen.http import Target, build_request, completion_body
from kvwatch.lab.proxies import Proxy, start_proxy
from kvwatch.lab.readers import Buffer, Reader

# The agent's configurations: its defaults (`kvwatch run` with only its ports, hook socket
# and audit log) but for these switches.
AGENTS: dict[str, tuple[str, ...]] = {
    "off": ("--mode", "observe"),
    "cut": ("--mode", "enforce", "--pause", "off", "--park", "off"),
    "park": ("--mode", "enforce", "--pause", "off"),
    "paced": ("--mode", "enforce"),
    # The closest thing to the 3 s bound for a reader that stops after reading a while: the
    # backlog estimate reads about half of what is unread (docs/collector.md), so a pause
    # bound of 1.5 s of estimate is ~3 s of truth.
    "paced_1.5s": ("--mode", "enforce", "--pause-seconds", "1.5"),
}
AgentName = Literal["off", "cut", "park", "paced", "paced_1.5s"]
PARKING: tuple[AgentName, ...] = ("park", "paced", "paced_1.5s")
# direct: the client at the engine; nginx: nginx as it comes (proxy_buffering on, its
# default); nginx-sse: nginx as the SSE guides set it (proxy_buffering off, the lab's
# config); haproxy: as it comes. All on loopback, the proxy's and the engine's port watched.
Topology = Literal["direct", "nginx", "nginx-sse", "haproxy"]
Load = Literal["idle", "busy"]
PARK_SECONDS = 2.0  # the agent's default park_seconds
# A long answer (a reasoning model's), within the default model's 4096-token context.
LONG_TOKENS = 3000
# The live readers' answer: ~110 KB, ~27 s for a 4 KB/s reader; an idle engine makes it in
# ~6 s, so a 4 or 8 KB/s reader falls seconds behind.
LIVE_TOKENS = 600
HEALTHY_TOKENS = 256
BUSY_STREAMS = 8
FAST = 1 << 24  # bytes per second: a reader that reads what arrives
STOP_AFTER_TOKENS = 50
STOP_AFTER_SECONDS = 10.0
# A stopped reader's stream pace: over its last seconds of reading (the pace falls as the
# context grows).
RATE_SECONDS = 3.0
# After a reader stopped: its request's event (held, parked, ended, or its count still for
# STEADY_SECONDS where the configuration never parks), or this bound.
EVENT_BOUND_SECONDS = 30.0
STEADY_SECONDS = 3.0
LIVE_BOUND_SECONDS = 120.0
QUIET_BOUND_SECONDS = 40.0
POLL_SECONDS = 0.2
STOP_KINDS = ("after_50_tokens", "after_10_s")
LIVE_READERS = ("4KBps", "8KBps", "away_10s", "bursty")
ENDED = ("finished", "cancelled")
HOLDS = ("pause", "park", "detach")
CUTS = ("cancel", "reset")


@dataclass(frozen=True)
class Setup:
    """One engine (and proxy) and its load: `coalesce` off is the per-token-writes variant,
    `small_buffers` the 8 KiB engine send buffer with 4 KB clients."""

    topology: Topology
    load: Load
    coalesce: bool = True
    small_buffers: bool = False

    @property
    def engine_args(self) -> tuple[str, ...]:
        coalesce = () if self.coalesce else ("--coalesce-bytes", "0")
        sndbuf = ("--sndbuf-bytes", "8192") if self.small_buffers else ()
        return (*coalesce, *sndbuf)

    @property
    def buffer(self) -> Buffer:
        return "4k" if self.small_buffers else "default"

    @property
    def label(self) -> str:
        variant = ("" if self.coalesce else ", per-token writes") + (
            ", 8 KiB engine / 4 KB clients" if self.small_buffers else ""
        )
        return f"{self.topology}, {self.load}{variant}"


class WatchedSocket(socket.socket):
    """A client's socket that notes each wait for bytes: from a read that found nothing
    within the reader's tick (its timeout ran out) to the next read that found some."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[tuple[int, int]] = []
        self.waiting_since = 0

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        asked = time.monotonic_ns()
        try:
            data = super().recv(bufsize, flags)
        except TimeoutError:
            self.waiting_since = self.waiting_since or asked
            raise
        if self.waiting_since:
            self.waits.append((self.waiting_since, time.monotonic_ns()))
            self.waiting_since = 0
        return data


@dataclass
class Client(Reader):
    """A lab reader (kvwatch.lab.readers) that also notes when it connected and got its first
    bytes, stops for good after `stop_after_tokens` tokens, or reads everything that arrived
    once every `burst_seconds`."""

    stop_after_tokens: int | None = None
    burst_seconds: float | None = None
    started_ns: int = 0
    marks: list[tuple[int, int]] = field(default_factory=list)  # (when, bytes read by then)

    def connect(
        self, sock: socket.socket, host: str, port: int, request: bytes = b"stream\n"
    ) -> None:
        self.started_ns = time.monotonic_ns()
        super().connect(sock, host, port, request)

    def _took(self, data: bytes) -> None:
        super()._took(data)
        self.marks.append((time.monotonic_ns(), len(self.received)))
        counting = self.stop_after_tokens and self.read_seconds is None
        if counting and self.tokens_read >= (self.stop_after_tokens or 0):
            self.read_seconds = 0.0  # the read loop ends at its next turn

    def _read(self) -> None:
        if self.burst_seconds is None:
            super()._read()
            return
        last_ns = time.monotonic_ns()
        while not self.stop.wait(self.burst_seconds) and not self._drain(last_ns):
            last_ns = time.monotonic_ns()

    def _drain(self, last_ns: int) -> bool:
        """Reads everything that arrived; True at the end of the response. Its own second
        between two reads is no wait; a read of nothing since `last_ns` is."""
        assert isinstance(self.sock, WatchedSocket)
        got = False
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                self.sock.waiting_since = 0
                if not got:
                    self.sock.waits.append((last_ns, time.monotonic_ns()))
                return False
            if not data:
                self.ended_ns = time.monotonic_ns()
                return True
            got = True
            self._took(data)

    @property
    def waits(self) -> list[tuple[int, int]]:
        """Its waits for bytes (WatchedSocket), less its own time away (`pause_after`)."""
        waits = self.sock.waits if isinstance(self.sock, WatchedSocket) else []
        if not self.paused_ns:
            return waits
        away = (self.paused_ns, self.paused_ns + int(self.pause_seconds * 1e9))
        return [w for span in waits for w in _outside(span, away)]

    @property
    def tokens_read(self) -> int:
        return parse_stream(self.received).tokens

    @property
    def stream_rate(self) -> float:
        """Its stream's pace when it stopped, tokens per second: over its last
        RATE_SECONDS of reading (all of it when it read less), first to last read."""
        if len(self.marks) < 2:
            return 0.0
        end_ns, _ = self.marks[-1]
        start_ns, start_bytes = next(
            m for m in self.marks if m[0] >= end_ns - RATE_SECONDS * 1e9 or m is self.marks[-2]
        )
        earlier = parse_stream(self.received[:start_bytes]).tokens
        return (self.tokens_read - earlier) / ((end_ns - start_ns) / 1e9)

    @property
    def done_seconds(self) -> float | None:
        """From its request to the end of its stream ([DONE], then the server's close)."""
        return (self.ended_ns - self.started_ns) / 1e9 if self.ended_ns else None


def _outside(span: tuple[int, int], cut: tuple[int, int]) -> list[tuple[int, int]]:
    """The parts of `span` outside `cut`."""
    parts = [(span[0], min(span[1], cut[0])), (max(span[0], cut[1]), span[1])]
    return [(start, end) for start, end in parts if end > start]


class Background:
    """BUSY_STREAMS healthy clients (each sends its next request when one ends) on a thread,
    from `with` to its end; `busy` False runs none."""

    def __init__(self, url: str, busy: bool) -> None:
        self.url, self.busy = url, busy
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="healthy", daemon=True)

    def _run(self) -> None:
        plan = LoadPlan(
            url=self.url,
            healthy=BUSY_STREAMS,
            duration_seconds=3600,
            prompt=PROMPT,
            max_tokens=HEALTHY_TOKENS,
        )
        asyncio.run(
            run_load(plan, on_stats=lambda _: self.stop.is_set(), progress_interval_seconds=0.2)
        )

    def __enter__(self) -> Background:
        if self.busy:
            self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        if self.busy:
            self.thread.join(timeout=30)


class Bed:
    """The engine (its defaults, plus the setup's variant) on loopback and, for a proxied
    topology, the proxy in front of it; one agent at a time."""

    def __init__(self, setup: Setup, workdir: Path) -> None:
        self.setup = setup
        self.stack = Stack(workdir)
        self.proxy: Proxy | None = None
        self.agent: Service | None = None
        try:
            self.stack.start_engine(*setup.engine_args)
            if setup.topology != "direct":
                name = "haproxy" if setup.topology == "haproxy" else "nginx"
                buffering = setup.topology == "nginx"
                self.proxy = start_proxy(
                    name, workdir, self.stack.engine_port, False, buffering=buffering
                )
            models = httpx.get(f"{self.stack.engine_url}/v1/models", timeout=5).json()
        except BaseException:
            self.close()
            raise
        self.model: str = models["data"][0]["id"]

    @property
    def port(self) -> int:
        """Where clients connect: the proxy's port, else the engine's."""
        return self.proxy.port if self.proxy is not None else self.stack.engine_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_agent(self, name: AgentName) -> None:
        """The agent in configuration `name`, watching the client-facing port (and the
        engine's behind a proxy), with its own audit log."""
        if self.agent is not None:
            self.stack.stop(self.agent)
        ports = ("--port", str(self.stack.engine_port)) if self.proxy is not None else ()
        self.agent = self.stack.start_agent(
            *AGENTS[name], *ports, port=self.port, audit=f"audit-{name}.jsonl"
        )
        self.stack.wait_engine_connected()

    def open(self, client: Client, max_tokens: int) -> Client:
        """`client` streams a completion of `max_tokens` as request `client.name`."""
        body = completion_body("completions", self.model, PROMPT, max_tokens)
        request = build_request(
            Target.parse(self.url), "POST", "/v1/completions", body, client.name
        )
        client.eof_ends = True
        client.connect(WatchedSocket(), "127.0.0.1", self.port, request)
        return client

    def request(self, name: str) -> dict[str, Any]:
        """The engine's account of request `name` (its state, tokens generated, KV blocks)."""
        report: dict[str, Any] = httpx.get(
            f"{self.stack.engine_url}/v1/requests/cmpl-{name}", timeout=5
        ).json()
        return report

    def wait_quiet(self, names: list[str]) -> None:
        """Until the requests `names` ended and, on an idle engine, no other runs: the next
        measure starts on the engine as its setup says (bounded: a request that lingers is
        the engine's, and shows in the next measure's numbers)."""
        deadline = time.monotonic() + QUIET_BOUND_SECONDS
        while time.monotonic() < deadline:
            live = httpx.get(f"{self.stack.engine_url}/v1/requests", timeout=5).json()["data"]
            states = {r["request_id"]: r["state"] for r in live}
            mine = [states.get(f"cmpl-{n}", "finished") for n in names]
            others = [s for i, s in states.items() if s not in ENDED and i[5:] not in names]
            if all(s in ENDED for s in mine) and (self.setup.load == "busy" or not others):
                return
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.stack.close()


@contextlib.contextmanager
def bed(setup: Setup) -> Iterator[Bed]:
    with tempfile.TemporaryDirectory(prefix="kvwatch-bench-paced-") as tmp:
        running = Bed(setup, Path(tmp))
        try:
            yield running
        finally:
            running.close()


# -- what the audit log says about one request ----------------------------------------------


class Told:
    """The agent's audit lines about one request (its decisions to act, or that it would,
    and the engine's answers), in the order written."""

    def __init__(self, bed: Bed, name: str) -> None:
        request_id = f"cmpl-{name}"
        self.lines = [e for e in bed.stack.audit_entries() if e.get("request_id") == request_id]

    def decisions(self, actions: tuple[str, ...], since_ns: int = 0) -> list[dict[str, Any]]:
        """Its decisions to act (or, observing, that would) with one of `actions`."""
        return [
            e
            for e in self.lines
            if e["kind"] == "decision"
            and e["verdict"] in ("act", "would_act")
            and set(e["actions"]) & set(actions)
            and e["monotonic_ns"] >= since_ns
        ]

    def decided_ns(self, action: str) -> int | None:
        found = self.decisions((action,))
        return found[0]["monotonic_ns"] if found else None

    def answered_ns(self, status: str) -> int | None:
        """When the engine's first answer with `status` was written (parked: its KV freed)."""
        found = [
            e for e in self.lines if e["kind"] == "outcome" and e["result"]["status"] == status
        ]
        return found[0]["monotonic_ns"] if found else None

    def held(self) -> list[tuple[int, int]]:
        """The spans the engine held the request (from its paused or parked answer to its
        released one; an open one ends now)."""
        spans, since = [], 0
        for line in self.lines:
            status = line["result"]["status"] if line["kind"] == "outcome" else ""
            if status in ("paused", "parked") and not since:
                since = line["monotonic_ns"]
            elif status == "released" and since:
                spans.append((since, line["monotonic_ns"]))
                since = 0
        return spans + ([(since, time.monotonic_ns())] if since else [])


def seconds_between(start_ns: int | None, end_ns: int | None) -> float | None:
    return None if start_ns is None or end_ns is None else round((end_ns - start_ns) / 1e9, 3)


# -- a reader that stops --------------------------------------------------------------------


@dataclass
class Stop:
    """One reader that stopped, and what came of its request (see `measure_stop`); the hold's
    steps from the audit log: the pause's round trip (decision to the engine's answer), the
    park's decision after the pause took effect, the park's round trip (to the KV freed)."""

    reader: str
    tokens_read: int
    rate_tokens_per_second: float
    tokens_generated: int
    state: str
    censored: bool
    stop_to_evidence_seconds: float | None
    evidence: str | None
    backlog_estimate_seconds: float | None
    pause_to_kv_freed_seconds: float | None
    stop_to_kv_freed_seconds: float | None
    pause_round_trip_seconds: float | None
    park_decided_after_paused_seconds: float | None
    park_round_trip_seconds: float | None
    decoded_after_stop_seconds: float = field(init=False)

    def __post_init__(self) -> None:
        decoded = self.tokens_generated - self.tokens_read
        rate = self.rate_tokens_per_second
        self.decoded_after_stop_seconds = round(decoded / rate, 2) if rate else float("nan")


def stopping_client(name: str, kind: str, buffer: Buffer) -> Client:
    if kind == "after_50_tokens":
        return Client(name, buffer, FAST, stop_after_tokens=STOP_AFTER_TOKENS)
    return Client(name, buffer, FAST, read_seconds=STOP_AFTER_SECONDS)


def wait_event(bed: Bed, client: Client, parks: bool) -> tuple[dict[str, Any], bool]:
    """Until the request's event after its reader stopped: parked or ended, or, where the
    configuration does not park (`parks` False), its count still for STEADY_SECONDS; or
    EVENT_BOUND_SECONDS after the stop (then censored: True). Returns the engine's account."""
    steady_since, count = time.monotonic(), -1
    while True:
        report = bed.request(client.name)
        now = time.monotonic()
        if report["tokens_generated"] != count:
            steady_since, count = now, report["tokens_generated"]
        if report["state"] in (*ENDED, "parked"):
            return report, False
        if not parks and now - steady_since >= STEADY_SECONDS:
            return report, False
        if client.stopped_ns and now - client.stopped_ns / 1e9 > EVENT_BOUND_SECONDS:
            return report, True
        time.sleep(POLL_SECONDS)


def measure_stop(bed: Bed, agent: AgentName, kind: str) -> Stop:
    """A reader that reads what arrives of a long answer, then stops for good (`kind`:
    after_50_tokens, after_10_s); measured at its request's event (wait_event): the tokens
    the engine decoded after the stop, in seconds of the stream's own pace before it; the
    agent's first decision about it after the stop; from the pause to the KV freed."""
    name = f"{agent}-{kind}"
    client = bed.open(stopping_client(name, kind, bed.setup.buffer), LONG_TOKENS)
    try:
        deadline = time.monotonic() + STOP_AFTER_SECONDS + EVENT_BOUND_SECONDS
        while not client.stopped_ns and not client.ended_ns and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        report, censored = wait_event(bed, client, agent in PARKING)
        told = Told(bed, name)
        acted = told.decisions((*HOLDS, *CUTS), since_ns=client.stopped_ns)
        backlog = acted[0]["evidence"].get("backlog") if acted else None
        pause, paused = told.decided_ns("pause"), told.answered_ns("paused")
        park, parked = told.decided_ns("park"), told.answered_ns("parked")
        return Stop(
            reader=kind,
            tokens_read=client.tokens_read,
            rate_tokens_per_second=round(client.stream_rate, 1),
            tokens_generated=report["tokens_generated"],
            state=report["state"],
            censored=censored,
            stop_to_evidence_seconds=seconds_between(
                client.stopped_ns, acted[0]["monotonic_ns"] if acted else None
            ),
            evidence=acted[0]["actions"][0] if acted else None,
            backlog_estimate_seconds=backlog["seconds"] if backlog else None,
            pause_to_kv_freed_seconds=seconds_between(pause, parked),
            stop_to_kv_freed_seconds=seconds_between(client.stopped_ns, parked),
            pause_round_trip_seconds=seconds_between(pause, paused),
            park_decided_after_paused_seconds=seconds_between(paused, park),
            park_round_trip_seconds=seconds_between(park, parked),
        )
    finally:
        client.close()
        bed.wait_quiet([name])


# -- live readers ---------------------------------------------------------------------------


def live_clients(agent: AgentName, buffer: Buffer) -> list[Client]:
    """4 and 8 KB/s; one that reads for 1 s, is away 10 s, then reads as fast as it can; one
    that reads everything that arrived once a second."""
    four, eight, away, bursty = (f"{agent}-{reader}" for reader in LIVE_READERS)
    return [
        Client(four, buffer, 4096),
        Client(eight, buffer, 8192),
        Client(away, buffer, FAST, pause_after=1.0, pause_seconds=10.0),
        Client(bursty, buffer, FAST, burst_seconds=1.0),
    ]


def reference(bed: Bed, buffer: Buffer) -> Stream:
    """The stream as a reader that keeps up gets it, unpaced: what every live reader must get."""
    client = bed.open(Client("reference", buffer, FAST), LIVE_TOKENS)
    try:
        deadline = time.monotonic() + LIVE_BOUND_SECONDS
        while not client.ended_ns and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        stream = parse_stream(client.received)
    finally:
        client.close()
    if not (stream.done and stream.tokens == LIVE_TOKENS):
        raise AssertionError(f"the reference stream did not come whole: {stream.tokens} tokens")
    return stream


def live_row(bed: Bed, client: Client, expected: Stream) -> dict[str, Any]:
    told = Told(bed, client.name)
    held = told.held()
    waits = client.waits
    return {
        "reader": client.name.split("-", 1)[1],
        "identical": parse_stream(client.received) == expected,
        "reset": bool(client.reset_ns),
        "cut_decisions": len(told.decisions(CUTS)),
        "pauses": len(told.decisions(("pause",))),
        "parks": len(told.decisions(("park",))),
        "held_seconds": round(sum(end - start for start, end in held) / 1e9, 2),
        "waited_seconds": round(sum(end - start for start, end in waits) / 1e9, 2),
        "waited_while_held_seconds": round(
            sum(end - start for start, end in waits if any(a <= start < b for a, b in held)) / 1e9,
            2,
        ),
        "done_seconds": None if client.done_seconds is None else round(client.done_seconds, 2),
    }


def measure_live(bed: Bed, agent: AgentName, expected: Stream) -> list[dict[str, Any]]:
    """The live readers together: whether each got the unpaced stream byte for byte (its
    text, token for token, and its end), whether it was cut, its holds, how long it waited
    for bytes (and how much of that began while its request was held), and its [DONE]."""
    clients = [bed.open(c, LIVE_TOKENS) for c in live_clients(agent, bed.setup.buffer)]
    try:
        deadline = time.monotonic() + LIVE_BOUND_SECONDS
        while time.monotonic() < deadline and not all(c.ended_ns or c.reset_ns for c in clients):
            time.sleep(POLL_SECONDS)
        return [live_row(bed, client, expected) for client in clients]
    finally:
        for client in clients:
            client.close()
        bed.wait_quiet([c.name for c in clients])


def healthy_holds(bed: Bed) -> int:
    """Holds (pause, park) decided, or that would be, for readers that keep up: the busy
    engine's healthy clients and the reference reader."""
    return sum(
        1
        for e in bed.stack.audit_entries("decision")
        if str(e.get("request_id", "")).startswith(("cmpl-healthy-", "cmpl-reference"))
        and e["verdict"] in ("act", "would_act")
        and set(e["actions"]) & set(HOLDS)
    )

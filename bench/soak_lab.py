"""The soak's workload (bench/bench_soak.py drives it and sums it up): the lab of a server and
a client network namespace with the token server, connection churn from a child process,
live slow readers, a trickle of stalled clients, an engine hook that keeps streams announced
and replaced, the agent's audit log followed as it grows, and the agent's process measured."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import time
import types
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import httpx

from kvwatch.collect.netns import network_namespace
from kvwatch.config.schema import DEFAULT_MIN_READER_BYTES_PER_SECOND
from kvwatch.hook import CommandOutcome, EngineHook
from kvwatch.lab.harness.demo import scrape
from kvwatch.lab.harness.stack import Stack
from kvwatch.lab.labs import SERVER_BYTES_PER_SECOND, Lab
from kvwatch.lab.netlab import Link, NetLab
from kvwatch.lab.readers import Buffer, Reader

DEFAULT_MINUTES = 10.0
SHORT_MINUTES = 1.0
SAMPLE_SECONDS = 5.0
TICK_SECONDS = 0.25
CHURN_PER_SECOND = 200
CHURN_TIMEOUT_SECONDS = 2.0
GUARANTEE = DEFAULT_MIN_READER_BYTES_PER_SECOND
LIVE_RATES = (GUARANTEE, 5 * 1024, 6 * 1024, 7 * 1024, 2 * GUARANTEE)
LIVE_BUFFERS: tuple[Buffer, ...] = ("64k", "default")
LIVE_PER_SHAPE = 2
LIVE_READERS = len(LIVE_RATES) * len(LIVE_BUFFERS) * LIVE_PER_SHAPE
# (buffer, seconds of reading before it stops), taken in turn.
STALLED_SHAPES: tuple[tuple[Buffer, float], ...] = (
    ("4k", 0.0),
    ("64k", 0.0),
    ("4k", 3.0),
    ("64k", 3.0),
)
STALLED_RATE = 4 * GUARANTEE
STALL_EVERY_SECONDS = 5.0
STALL_WAIT_SECONDS = 90.0
MAX_STALLED_OPEN = 16
ANNOUNCED_STREAMS = 50
REPLACED_PER_SECOND = ANNOUNCED_STREAMS // 10
# Slope and the second-half figures leave out the first part of the run (imports, BPF load,
# first allocations): WARMUP_SECONDS or a fifth of the run, whichever is shorter.
WARMUP_SECONDS = 60.0
SERVER_START_SECONDS = 10.0
MB = 1_000_000
# Not tests/verdicts' 18080: every agent on the machine watches its port in every namespace,
# and verdict tests run beside the soak would act on its stalls and it on theirs.
SOAK_PORT = 18097
AGENT_ARGS = (
    "--mode", "enforce", "--action", "reset", "--grace-seconds", "0",
    "--max-cancels-per-minute", "1000",
)  # fmt: skip
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class TerminatedError(Exception):
    """SIGTERM, turned into an exception so that every `finally` runs."""


def on_sigterm(_signum: int, _frame: types.FrameType | None) -> None:
    raise TerminatedError


# ----------------------------------------------------------------------------- the load


def churn(
    namespace: str,
    host: str,
    seconds: float,
    made: Synchronized[int],
    failed: Synchronized[int],
) -> None:
    """Child process: CHURN_PER_SECOND short connections a second from `namespace` for
    `seconds`, one at a time. Falling more than a second behind drops the backlog rather
    than bursting: the rate achieved is what `made` says."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    linger = struct.pack("ii", 1, 0)
    with network_namespace(Path("/run/netns", namespace)):
        start = time.monotonic()
        count = 0
        while (now := time.monotonic()) - start < seconds:
            due = start + count / CHURN_PER_SECOND
            if due > now:
                time.sleep(due - now)
            elif now - due > 1.0:
                count = int((now - start) * CHURN_PER_SECOND)
            count += 1
            try:
                with socket.socket() as sock:
                    sock.settimeout(CHURN_TIMEOUT_SECONDS)
                    sock.connect((host, SOAK_PORT))
                    if count % 2:
                        sock.sendall(b"stream\n")
                        sock.recv(256)
                    if count % 4 < 2:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            except OSError:
                with failed.get_lock():
                    failed.value += 1
                continue
            with made.get_lock():
                made.value += 1


def start_lab(workdir: Path) -> Lab:
    """A lab with the token server listening, as tests/verdicts' `labs` fixture makes it."""
    net = NetLab(Link())
    try:
        log = workdir / "token-server.log"
        server = net.spawn_server(
            "kvwatch.lab.token_server",
            net.server_ip,
            str(SOAK_PORT),
            str(SERVER_BYTES_PER_SECOND),
            log=log,
        )
        deadline = time.monotonic() + SERVER_START_SECONDS
        while "listening" not in log.read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"the token server did not start: {log.read_text()}")
            time.sleep(0.05)
    except BaseException:
        net.close()
        raise
    return Lab(net, server)


@dataclass
class Stalled:
    """One stalled client: the reader and what became of it."""

    reader: Reader
    started: float
    outcome: str = ""  # "reset", "missed" or "" (still open)


@dataclass
class Trickle:
    """Starts a stalled client every STALL_EVERY_SECONDS and closes each once it is reset
    (or given up on)."""

    lab: Lab
    started: int = 0
    open: list[Stalled] = field(default_factory=list)
    done: list[Stalled] = field(default_factory=list)

    def start_one(self, now: float) -> None:
        if len(self.open) >= MAX_STALLED_OPEN:
            return
        buffer, read_seconds = STALLED_SHAPES[self.started % len(STALLED_SHAPES)]
        name = f"stalled-{self.started}-{buffer}-{read_seconds:g}s"
        reader = Reader(name, buffer, STALLED_RATE, read_seconds=read_seconds)
        self.started += 1
        try:
            reader.connect(self.lab.net.client_socket(), self.lab.net.server_ip, SOAK_PORT)
        except OSError:
            reader.close()
            return
        self.open.append(Stalled(reader, now))

    def check(self, now: float) -> None:
        for stalled in list(self.open):
            if stalled.reader.reset_ns:
                stalled.outcome = "reset"
            elif now - stalled.started > STALL_WAIT_SECONDS:
                stalled.outcome = "missed"
            else:
                continue
            stalled.reader.close()
            self.open.remove(stalled)
            self.done.append(stalled)

    def close(self) -> None:
        for stalled in self.open:
            stalled.reader.close()

    def all(self) -> list[Stalled]:
        return [*self.done, *self.open]


def no_request(request_id: str, reason: str) -> CommandOutcome:
    return CommandOutcome(request_id, "unknown_request", 0, 0, detail=reason)


class Announced:
    """ANNOUNCED_STREAMS requests announced over the engine hook on the watched port, from
    client addresses no socket has; a tenth replaced every second."""

    def __init__(self, hook: EngineHook, server_ip: str) -> None:
        self.hook = hook
        self.server_ip = server_ip
        self.live: list[str] = []
        self.opened = 0

    def tick(self, second: int) -> None:
        for request_id in self.live[:REPLACED_PER_SECOND]:
            self.hook.stream_closed(request_id, "finished")
        self.live = self.live[REPLACED_PER_SECOND:]
        while len(self.live) < ANNOUNCED_STREAMS:
            request_id = f"soak-{self.opened}"
            self.hook.stream_opened(
                request_id,
                (self.server_ip, SOAK_PORT),
                ("192.0.2.1", 1024 + self.opened % 60000),
                kv_blocks=4,
            )
            self.live.append(request_id)
            self.opened += 1
        for request_id in self.live:
            self.hook.stream_updated(request_id, kv_blocks=4, tokens_out=second)


# ------------------------------------------------------------------------- measurement


class AuditTail:
    """The agent's audit log read as it grows: the act decisions and reset outcomes by
    client address."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.acts: dict[str, dict[str, Any]] = {}
        self.resets: set[str] = set()
        self.outcomes: dict[str, int] = {}

    def read(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as audit:
            audit.seek(self.offset)
            chunk = audit.read()
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        for line in chunk[:end].splitlines():
            entry = json.loads(line)
            if entry["kind"] == "decision" and entry["verdict"] == "act":
                self.acts.setdefault(entry["remote"], entry)
            elif entry["kind"] == "outcome":
                status = entry["result"]["status"]
                self.outcomes[status] = self.outcomes.get(status, 0) + 1
                if status == "reset":
                    self.resets.add(entry["remote"])


def proc_status(pid: int) -> dict[str, int]:
    """RSS and its anonymous part (bytes) and threads from /proc/PID/status, descriptors
    from /proc/PID/fd, CPU ticks (user + system) from /proc/PID/stat."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    stat = Path(f"/proc/{pid}/stat").read_text()
    ticks = stat[stat.rindex(")") + 2 :].split()
    return {
        "rss_bytes": int(fields["VmRSS"].split()[0]) * 1024,
        "rss_anon_bytes": int(fields["RssAnon"].split()[0]) * 1024,
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "cpu_ticks": int(ticks[11]) + int(ticks[12]),
    }


def total(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    wanted = [f"{key}={value}" for key, value in labels.items()]
    found = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base == name and all(w in rest.rstrip("}").split(",") for w in wanted):
            found += value
    return found


@dataclass
class Run:
    """Everything running during the soak, and what was counted."""

    agent: Stack
    pid: int
    lab: Lab
    live: list[Reader]
    trickle: Trickle
    audit: AuditTail
    made: Synchronized[int]
    failed: Synchronized[int]
    start: float = 0.0
    last_ticks: int = 0
    last_time: float = 0.0
    failed_scrapes: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)

    def live_cut(self) -> list[str]:
        return [r.name for r in self.live if r.reset_ns or r.local in self.audit.acts]

    def sample(self, now: float) -> None:
        proc = proc_status(self.pid)
        cpu = 100 * (proc["cpu_ticks"] - self.last_ticks) / CLOCK_TICKS / (now - self.last_time)
        self.last_ticks, self.last_time = proc["cpu_ticks"], now
        self.audit.read()
        row: dict[str, Any] = {
            "t": round(now - self.start, 1),
            "rss_mb": round(proc["rss_bytes"] / MB, 2),
            "rss_anon_mb": round(proc["rss_anon_bytes"] / MB, 2),
            "fds": proc["fds"],
            "threads": proc["threads"],
            "cpu_percent_of_core": round(cpu, 1),
            "log_bytes": self.agent.services[-1].log.stat().st_size,
            "connections_made": self.made.value,
            "stalled_started": self.trickle.started,
            "stalled_reset": sum(s.outcome == "reset" for s in self.trickle.done),
            "acts": len(self.audit.acts),
            "live_readers_cut": len(self.live_cut()),
        }
        try:
            health = httpx.get(f"{self.agent.agent_url}/healthz", timeout=2).json()
            metrics = scrape(f"{self.agent.agent_url}/metrics")
        except httpx.HTTPError:
            self.failed_scrapes += 1
            self.samples.append(row)
            return
        table = health["socket_table"] or {}
        row |= {
            "table_tracked": table.get("tracked"),
            "table_evictions": table.get("evictions"),
            "sockets_seen": table.get("sockets_seen"),
            "streams": {
                key.partition("state=")[2].rstrip("}"): int(value)
                for key, value in metrics.items()
                if key.startswith("kvwatch_streams{state=")
            },
            "decisions_act": int(total(metrics, "kvwatch_policy_decisions_total", verdict="act")),
            "decisions": int(total(metrics, "kvwatch_policy_decisions_total")),
            "actions_reset": int(total(metrics, "kvwatch_actions_total", result="reset")),
            "actions": int(total(metrics, "kvwatch_actions_total")),
            "timelines_live": int(total(metrics, "kvwatch_agent_timelines", state="live")),
            "timelines_finished": int(total(metrics, "kvwatch_agent_timelines", state="finished")),
            "announced": int(total(metrics, "kvwatch_streams_engine_announced")),
            "bpf_events_sent": int(total(metrics, "kvwatch_bpf_events_sent_total")),
            "bpf_events_dropped": int(total(metrics, "kvwatch_bpf_events_dropped_total")),
        }
        self.samples.append(row)


def drive(run: Run, seconds: float, announced: Announced) -> int | None:
    """The load and the samples for `seconds`; the agent's exit status if it died."""
    run.start = run.last_time = time.monotonic()
    run.last_ticks = proc_status(run.pid)["cpu_ticks"]
    next_sample, next_stall, second = run.start, run.start + 2.0, 0
    popen = run.agent.services[-1].popen
    while (now := time.monotonic()) - run.start < seconds:
        if popen.poll() is not None:
            return popen.returncode
        if now >= next_stall:
            run.trickle.start_one(now)
            next_stall += STALL_EVERY_SECONDS
        run.trickle.check(now)
        if now - run.start >= second:
            announced.tick(second)
            second += 1
        if now >= next_sample:
            try:
                run.sample(now)
            except OSError:  # /proc/PID is gone: the agent died since the poll above
                return popen.wait()
            next_sample += SAMPLE_SECONDS
        time.sleep(TICK_SECONDS)
    run.trickle.check(time.monotonic())
    try:
        run.sample(time.monotonic())
    except OSError:
        return popen.wait()
    return None


# ---------------------------------------------------------------------------- summary

"""The agent's configuration schema: its sections and settings with their defaults, the
range of every numeric setting (`RANGES`) and the other checks a value must pass (`CHECKS`).
Plain data; kvwatch.config.load reads a configuration from the defaults, a file, the
environment and flags, and checks it by these rules. docs/configuration.md is the user's
reference; keep it in step with the dataclasses below.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvwatch.collect.bpf.layout import MAX_FILTER_PORTS
from kvwatch.collect.bpf.loader import SEND_MODES, CollectorSettings
from kvwatch.collect.collectors import Backend
from kvwatch.errors import quoted

Mode = Literal["observe", "enforce"]
Action = Literal["cancel", "reset"]
Switch = Literal["on", "off"]
# A reader at this rate is never called stalled unless told otherwise: half a 50-token/s
# SSE stream.
DEFAULT_MIN_READER_BYTES_PER_SECOND = 4096

# The most entries the kernel gives a BPF hash map: its bucket table (a power of two of
# 16-byte buckets) must stay under 4 GiB (kernel/bpf/hashtab.c, htab_map_alloc).
MAX_SOCKETS_LIMIT = 1 << 28
# PID_MAX_LIMIT on 64-bit kernels: no pid is larger (include/linux/threads.h).
PID_MAX_LIMIT = 1 << 22
# (uid_t)-1 means "no uid" to the kernel; every real uid is below it.
UID_MAX = (1 << 32) - 2
HOUR_SECONDS = 3600
DAY_SECONDS = 86400
# Paths (PATH_MAX, with its NUL) and glob patterns (a cgroup path) are at most this long.
MAX_PATH_CHARS = 4095
MAX_HOST_CHARS = 253  # the longest DNS name


@dataclass(frozen=True)
class PolicyConfig:
    """When a stalled stream is acted on, and how (kvwatch.policy.rules.decide reads only this).

    `pause`, `pause_seconds`, `release_seconds`, `park` and `park_seconds` (the hold,
    kvwatch.policy.hold): a stream whose reader falls `pause_seconds` of its output behind
    is paused (its engine decodes nothing more for it), released once the reader is back
    under `release_seconds`, and parked (its KV freed) once paused for `park_seconds`, with
    no proof needed (nothing is cut); a hold lasts `lease_seconds` at the engine unless the
    agent renews it. The cut (`actions`) waits for the stall's proof.
    Rules: deny lists win over allow lists; an empty allow list allows every value of its kind;
    a stream must pass every non-empty allow list. Port rules match the local port; `comms`
    are fnmatch globs on the process name; `cgroups` are fnmatch globs tried on the cgroup
    path, the container ID and the pod UID (empty ones are never matched).
    """

    mode: Mode = "observe"
    actions: tuple[Action, ...] = ("cancel",)
    stall_seconds: float = 3.0
    min_reader_bytes_per_second: int = DEFAULT_MIN_READER_BYTES_PER_SECOND
    min_kv_bytes: int = 0
    grace_seconds: float = 2.0
    pause: Switch = "on"
    pause_seconds: float = 2.0
    release_seconds: float = 1.0
    lease_seconds: float = 10.0
    park: Switch = "on"
    park_seconds: float = 2.0
    max_cancels_per_minute: int = 10
    allow_ports: tuple[int, ...] = ()
    deny_ports: tuple[int, ...] = ()
    allow_comms: tuple[str, ...] = ()
    deny_comms: tuple[str, ...] = ()
    allow_cgroups: tuple[str, ...] = ()
    deny_cgroups: tuple[str, ...] = ()

    @property
    def enforce(self) -> bool:
        return self.mode == "enforce"


@dataclass(frozen=True)
class CollectorConfig:
    """What the socket collector watches: ports and pid (empty / 0 = all), which backend."""

    ports: tuple[int, ...] = ()
    pid: int = 0
    backend: Backend = "auto"
    send_mode: str = "auto"
    max_sockets: int = 16384

    def settings(self) -> CollectorSettings:
        """What the BPF programs are loaded with (kvwatch.collect.bpf.loader)."""
        return CollectorSettings(
            ports=self.ports, pid=self.pid, max_sockets=self.max_sockets, send_mode=self.send_mode
        )


@dataclass(frozen=True)
class HookConfig:
    """The engine-hook server: its unix socket and the peer uids allowed to connect."""

    socket: str = "/run/kvwatch/engine.sock"
    allowed_uids: tuple[int, ...] = (0,)


DEFAULT_LISTEN = "127.0.0.1:9431"
# Where the commands that read a running agent look for it by default.
DEFAULT_AGENT_URL = f"http://{DEFAULT_LISTEN}"


@dataclass(frozen=True)
class HttpConfig:
    """The agent's HTTP API and /metrics."""

    listen: str = DEFAULT_LISTEN

    @property
    def host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return split_listen(self.listen)[1]


@dataclass(frozen=True)
class AuditConfig:
    """Where decisions are logged as JSON lines; "" logs to stdout only."""

    path: str = "/var/log/kvwatch/audit.jsonl"


@dataclass(frozen=True)
class PathConfig:
    """Host paths: a DaemonSet mounts the host's /proc and /sys elsewhere."""

    procfs: str = "/proc"
    sysfs: str = "/sys"


@dataclass(frozen=True)
class StreamsConfig:
    """How many finished streams the agent remembers (for `explain` and the API)."""

    history_size: int = 1000


@dataclass(frozen=True)
class AgentConfig:
    """Everything `kvwatch run` needs; built and validated by `load_config`, immutable."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    collector: CollectorConfig = field(default_factory=CollectorConfig)
    hook: HookConfig = field(default_factory=HookConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    path: PathConfig = field(default_factory=PathConfig)
    streams: StreamsConfig = field(default_factory=StreamsConfig)


@dataclass(frozen=True)
class Range:
    """The numbers a numeric setting may take (each of its items, for a list): `low`..`high`,
    both included, except `low` when `above_low`. `unit` follows a number ("seconds") or, for
    a list, names its items ("ports"); `note` says what a bound means or why it is there."""

    low: int | float
    high: int | float
    unit: str = ""
    above_low: bool = False
    note: str = ""

    def holds(self, number: float) -> bool:
        above = number > self.low if self.above_low else number >= self.low
        return above and number <= self.high

    @property
    def span(self) -> str:
        """ "1..65535", or "> 0 and <= 86400" when `low` is excluded."""
        return f"> {self.low} and <= {self.high}" if self.above_low else f"{self.low}..{self.high}"

    def allowed(self, of_list: bool) -> str:
        """What is allowed, as an error message says it."""
        text = f"a list of {self.unit} {self.span}" if of_list else f"{self.span} {self.unit}"
        return text.rstrip() + (f" ({self.note})" if self.note else "")


_PORTS = Range(1, 65535, "ports")
# The range of every numeric setting, by dotted key (docs/configuration.md: the last column
# of the table of environment variables).
RANGES: dict[str, Range] = {
    "policy.stall_seconds": Range(0, DAY_SECONDS, "seconds", above_low=True),
    "policy.min_reader_bytes_per_second": Range(1, 1 << 30, "bytes per second"),
    "policy.min_kv_bytes": Range(0, 1 << 50, "bytes"),
    "policy.grace_seconds": Range(0, DAY_SECONDS, "seconds"),
    "policy.pause_seconds": Range(0, DAY_SECONDS, "seconds", above_low=True),
    "policy.release_seconds": Range(0, HOUR_SECONDS, "seconds", note="below pause_seconds"),
    "policy.lease_seconds": Range(1, DAY_SECONDS, "seconds"),
    "policy.park_seconds": Range(0, DAY_SECONDS, "seconds", above_low=True),
    "policy.max_cancels_per_minute": Range(
        1, 1_000_000, "actions", note="use mode = observe to act never"
    ),
    "policy.allow_ports": _PORTS,
    "policy.deny_ports": _PORTS,
    "collector.ports": _PORTS,
    "collector.pid": Range(
        0, PID_MAX_LIMIT, note=f"0 = every process; {PID_MAX_LIMIT} is the kernel's pid limit"
    ),
    "collector.max_sockets": Range(
        1, MAX_SOCKETS_LIMIT, note="the kernel's limit for a BPF hash map"
    ),
    "hook.allowed_uids": Range(0, UID_MAX, "uids"),
    "streams.history_size": Range(0, 100_000, "finished streams"),
}


def split_listen(listen: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[ipv6]:port"; raises ValueError on anything else
    (a host that cannot be a name or an address: empty, too long, not printable)."""
    host, sep, port_text = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    host_ok = 0 < len(host) <= MAX_HOST_CHARS and host.isprintable()
    port_ok = 0 < len(port_text) <= 5 and port_text.isascii() and port_text.isdigit()
    if not (sep and host_ok and port_ok) or int(port_text) > 65535:
        raise ValueError(f"not a host:port address: {quoted(listen)}")
    return host, int(port_text)


def _listen_ok(listen: str) -> bool:
    try:
        split_listen(listen)
    except ValueError:
        return False
    return True


def _path_ok(path: str) -> bool:
    return len(path) <= MAX_PATH_CHARS and "\0" not in path


def _globs_ok(globs: tuple[str, ...]) -> bool:
    return all(0 < len(glob) <= MAX_PATH_CHARS for glob in globs)


GLOBS: tuple[Callable[[Any], bool], str] = (
    _globs_ok,
    f"a list of non-empty glob patterns of at most {MAX_PATH_CHARS} characters",
)
ABSOLUTE: tuple[Callable[[Any], bool], str] = (
    lambda v: os.path.isabs(v) and _path_ok(v),
    f"an absolute path of at most {MAX_PATH_CHARS} characters, without NUL",
)
# Checks beyond the type and the range (RANGES), by dotted key: (is the value fine?, what is
# allowed).
CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "policy.actions": (
        lambda v: len(v) > 0 and len(set(v)) == len(v),
        "a non-empty list of cancel and/or reset, without repeats",
    ),
    "policy.allow_comms": GLOBS,
    "policy.deny_comms": GLOBS,
    "policy.allow_cgroups": GLOBS,
    "policy.deny_cgroups": GLOBS,
    "collector.ports": (
        lambda v: len(v) <= MAX_FILTER_PORTS,
        f"a list of at most {MAX_FILTER_PORTS} ports (empty = all ports)",
    ),
    "collector.send_mode": (
        lambda v: v in ("auto", *SEND_MODES),
        "one of " + ", ".join(("auto", *SEND_MODES)),
    ),
    "hook.socket": ABSOLUTE,
    "http.listen": (_listen_ok, 'host:port with a port 0..65535 ("[::1]:9431" for IPv6)'),
    "audit.path": (
        _path_ok,
        f'a path of at most {MAX_PATH_CHARS} characters, without NUL ("" = stdout only)',
    ),
    "path.procfs": ABSOLUTE,
    "path.sysfs": ABSOLUTE,
}

"""The agent's configuration: defaults, then a TOML file, then the environment, then flags.

Every setting has one dotted key, `<section>.<key>` (e.g. `policy.stall_seconds`), which is its
place in the TOML file (`[policy]` table, `stall_seconds = 3.0`), its environment variable
(`KVWATCH_POLICY_STALL_SECONDS`, see `env_name`) and its key in the `overrides` mapping the
CLI passes for the flags the user gave. Later layers win: flags over the environment over the
file over the defaults. Unknown keys in the file are errors with a "did you mean"; so are
unknown keys of a known section in the environment (`KVWATCH_POLICY_STAL_SECONDS`), while
variables of other sections (`KVWATCH_ENGINE_SOCKET`, `KVWATCH_REQUIRE_BPF`) are not ours.
Environment values are text: lists are comma-separated ("8000,8001"; "" is the empty list).
A renamed key (`RENAMED_KEYS`) still loads under its old name, file or environment, with a
warning naming the new one.
Every numeric setting has one range (`RANGES`), checked for the file, the environment and the
flags alike: `kvwatch run`'s flags reach `load_config`, and every command's flags for a setting
(`--port`, `--max-sockets`, ...) are checked on their own by `parse_flag`. The file is read
only when it is a regular file of at most MAX_CONFIG_BYTES of UTF-8 text; error messages quote
at most a short prefix of a bad value (kvwatch.errors.quoted).
docs/configuration.md is the user's reference; keep it in step with the dataclasses below.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

from kvwatch.collect.bpf.layout import MAX_FILTER_PORTS
from kvwatch.collect.bpf.loader import SEND_MODES, CollectorSettings
from kvwatch.collect.collectors import Backend
from kvwatch.errors import ConfigError, quoted
from kvwatch.streams.states import DEFAULT_MIN_READER_BYTES_PER_SECOND, StallThresholds

Mode = Literal["observe", "enforce"]
Action = Literal["cancel", "reset"]
Switch = Literal["on", "off"]
ENV_PREFIX = "KVWATCH_"
# The most entries the kernel gives a BPF hash map: its bucket table (a power of two of
# 16-byte buckets) must stay under 4 GiB (kernel/bpf/hashtab.c, htab_map_alloc).
MAX_SOCKETS_LIMIT = 1 << 28
# PID_MAX_LIMIT on 64-bit kernels: no pid is larger (include/linux/threads.h).
PID_MAX_LIMIT = 1 << 22
# (uid_t)-1 means "no uid" to the kernel; every real uid is below it.
UID_MAX = (1 << 32) - 2
HOUR_SECONDS = 3600
DAY_SECONDS = 86400
# A config file is a few kB; past this it is the wrong file (or a device, or an attack).
MAX_CONFIG_BYTES = 1 << 20
# Paths (PATH_MAX, with its NUL) and glob patterns (a cgroup path) are at most this long.
MAX_PATH_CHARS = 4095
# An unknown name is compared with the known ones by its first characters only.
MAX_NAME_CHARS = 64
MAX_HOST_CHARS = 253  # the longest DNS name
# Old dotted key -> the key it was renamed to; the old one still loads, with a warning.
RENAMED_KEYS = {"collector.send_hook": "collector.send_mode"}

log = logging.getLogger(__name__)


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

    def stall_thresholds(self) -> StallThresholds:
        """The judge's thresholds (kvwatch.streams.states), from the same settings."""
        return StallThresholds(
            stall_seconds=self.stall_seconds,
            min_reader_bytes_per_second=self.min_reader_bytes_per_second,
        )


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


@dataclass(frozen=True)
class HttpConfig:
    """The agent's HTTP API and /metrics."""

    listen: str = "127.0.0.1:9431"

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


_SECTIONS: dict[str, type[Any]] = get_type_hints(AgentConfig)
# Dotted key -> the type hint of its field, e.g. "policy.actions" -> tuple[Action, ...].
_FIELDS: dict[str, Any] = {
    f"{section}.{name}": hint
    for section, cls in _SECTIONS.items()
    for name, hint in get_type_hints(cls).items()
}


def config_keys() -> list[str]:
    """Every dotted key, in declaration order."""
    return list(_FIELDS)


def env_name(key: str) -> str:
    """The variable of a dotted key: policy.stall_seconds -> KVWATCH_POLICY_STALL_SECONDS."""
    return ENV_PREFIX + key.replace(".", "_").upper()


@dataclass(frozen=True)
class _Origin:
    """Where a value came from, said in an error message and in its hint."""

    label: str
    fix: str


def _renamed(key: str, where: str, spell: Callable[[str], str] = str) -> str:
    """`key`, or the key it was renamed to, saying so (each written by `spell`)."""
    new = RENAMED_KEYS.get(key)
    if new is None:
        return key
    log.warning("%s is now %s (%s): rename it", spell(key), spell(new), where)
    return new


def _suggest_section(section: str) -> str:
    close = difflib.get_close_matches(section[:MAX_NAME_CHARS], list(_SECTIONS), n=1, cutoff=0.6)
    return f"did you mean [{close[0]}]?" if close else f"sections: {', '.join(_SECTIONS)}"


def _suggest_key(key: str, spell: Callable[[str], str] = str) -> str:
    """A hint for an unknown dotted `key`: the same key name in another section, or the
    closest key of its section, else the keys of its section; each written by `spell`."""
    section, _, name = key.partition(".")
    in_section = [known.partition(".")[2] for known in _FIELDS if known.startswith(section + ".")]
    close = difflib.get_close_matches(name[:MAX_NAME_CHARS], in_section, n=1, cutoff=0.6)
    elsewhere = [known for known in _FIELDS if known.partition(".")[2] == name]
    if close or elsewhere:
        return f"did you mean {spell(elsewhere[0] if elsewhere else f'{section}.{close[0]}')}?"
    if not in_section:
        return _suggest_section(section)
    return "known: " + ", ".join(spell(f"{section}.{known}") for known in in_section)


def _show(value: object) -> str:
    """A short quote of a bad value: a text in quotes, a list as TOML-ish brackets."""
    if isinstance(value, str):
        return f"'{quoted(value)}'"
    return quoted(repr(list(value)) if isinstance(value, tuple) else repr(value))


def _bad_value(key: str, value: object, allowed: str, origin: _Origin) -> ConfigError:
    return ConfigError(f"{key} must be {allowed} (got {_show(value)}, {origin.label})", origin.fix)


_KIND_NAMES = {
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}


def _describe(hint: Any, plural: bool = False) -> str:
    if get_origin(hint) is Literal:
        return ("any of " if plural else "one of ") + ", ".join(map(str, get_args(hint)))
    if get_origin(hint) is tuple:
        return "a list of " + _describe(get_args(hint)[0], plural=True)
    return _KIND_NAMES[hint][1 if plural else 0]


def _number(value: object, kind: type[int] | type[float]) -> int | float:
    """An int or float from a TOML/flag number or a text; ValueError for anything else
    (booleans, and fractions where an integer is wanted)."""
    if isinstance(value, str):
        return kind(value.strip())
    if isinstance(value, bool) or not isinstance(value, kind | int):
        raise ValueError(value)
    try:
        return kind(value)
    except OverflowError:  # an integer too large for a float
        raise ValueError(value) from None


def _coerce_scalar(value: object, hint: Any) -> object:
    """`value` as `hint` says; ValueError when it cannot be."""
    if get_origin(hint) is Literal:
        if value not in get_args(hint):
            raise ValueError(value)
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(value)
        return value
    number = _number(value, hint)
    if isinstance(number, float) and not math.isfinite(number):
        raise ValueError(value)
    return number


def _coerce(raw: object, key: str, origin: _Origin) -> object:
    """The typed value of `key` from a TOML value, a flag's value or an environment text."""
    hint = _FIELDS[key]
    try:
        if get_origin(hint) is not tuple:
            return _coerce_scalar(raw, hint)
        items = (
            [item.strip() for item in raw.split(",") if item.strip()]
            if isinstance(raw, str)
            else raw
        )
        if not isinstance(items, list | tuple):
            raise ValueError(raw)
        return tuple(_coerce_scalar(item, get_args(hint)[0]) for item in items)
    except ValueError:
        raise _bad_value(key, raw, _describe(hint), origin) from None


_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}
_CONFIG_FIX = "point --config at a TOML file"


def _not_regular(path: str, mode: int, what: str, fix: str) -> ConfigError:
    kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return ConfigError(f"{what} {quoted(path)} is {kind}, not a regular file", fix)


def _read_head(path: str, what: str, fix: str, max_bytes: int) -> bytes:
    """The first `max_bytes` + 1 bytes of the regular file at `path`. Anything else is refused
    before it is opened (a FIFO would block, a device would never end), and again once open
    (it may have been replaced in between); a read never blocks."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode, what, fix)
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with os.fdopen(descriptor, "rb") as file:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode, what, fix)
        return file.read(max_bytes + 1)


def read_small_file(path: str, what: str, fix: str, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path`, a file a user named (`what` it is, for
    messages: "config file"); ConfigError (with `fix`) for an empty path, anything but a
    regular file, a file over `max_bytes`, or one that cannot be read."""
    shown = quoted(path)
    if not path:
        raise ConfigError(f"the {what} path is empty", fix)
    try:
        data = _read_head(path, what, fix, max_bytes)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {shown}: {exc.strerror}", fix) from exc
    except ValueError as exc:  # a NUL in the path
        raise ConfigError(f"cannot read {what} {shown}: {exc}", fix) from exc
    if len(data) > max_bytes:
        raise ConfigError(
            f"{what} {shown} is larger than {max_bytes} bytes ({max_bytes >> 20} MiB), the most "
            "kvwatch reads",
            fix,
        )
    return data


def _parse_toml(data: bytes, path: str) -> dict[str, Any]:
    """The TOML document in `data`; ConfigError for bytes that are not UTF-8 TOML."""
    shown = quoted(path)
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {shown} is not UTF-8 text (byte {data[exc.start]:#04x} at offset "
            f"{exc.start})",
            _CONFIG_FIX,
        ) from exc
    except ValueError as exc:  # TOMLDecodeError, or an integer of over 4300 digits
        raise ConfigError(
            f"config file {shown} is not valid TOML: {quoted(str(exc))}",
            "fix the syntax at the place shown",
        ) from exc
    except RecursionError as exc:
        raise ConfigError(
            f"config file {shown} nests arrays or tables too deeply",
            "a kvwatch config holds [section] tables of plain values and flat lists",
        ) from exc


def _read_file(path: str) -> dict[str, object]:
    """The raw values of a TOML file, by dotted key; unknown tables and keys are errors."""
    shown = quoted(path)
    values: dict[str, object] = {}
    data = read_small_file(path, "config file", _CONFIG_FIX, MAX_CONFIG_BYTES)
    for section, table in _parse_toml(data, path).items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"unknown section [{quoted(section)}] in {shown}", _suggest_section(section)
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{section} in {shown} must be a table", f"write it as [{section}]")
        for name, value in table.items():
            key = _renamed(f"{section}.{name}", f"in {shown}")
            if key not in _FIELDS:
                raise ConfigError(f"unknown key {quoted(key)} in {shown}", _suggest_key(key))
            values[key] = value
    return values


def _read_env(env: Mapping[str, str]) -> dict[str, object]:
    """The KVWATCH_<SECTION>_<KEY> variables of our sections, by dotted key."""
    values: dict[str, object] = {}
    known = {env_name(key): key for key in (*_FIELDS, *RENAMED_KEYS)}
    for name, text in env.items():
        section = name[len(ENV_PREFIX) :].split("_", 1)[0].lower()
        if not name.startswith(ENV_PREFIX) or section not in _SECTIONS:
            continue
        if name not in known:
            key = section + "." + name[len(ENV_PREFIX) + len(section) + 1 :].lower()
            hint = _suggest_key(key, env_name)
            raise ConfigError(f"unknown environment variable {quoted(name)}", hint)
        values[_renamed(known[name], "in the environment", env_name)] = text
    return values


def _layers(
    path: str | None, env: Mapping[str, str], overrides: Mapping[str, object]
) -> list[tuple[dict[str, object], Callable[[str], _Origin]]]:
    layers: list[tuple[dict[str, object], Callable[[str], _Origin]]] = []
    if path is not None:
        shown = quoted(path)
        layers.append((_read_file(path), lambda _key: _Origin(f"in {shown}", f"edit {shown}")))
    layers.append(
        (_read_env(env), lambda key: _Origin(f"from ${env_name(key)}", f"change ${env_name(key)}"))
    )
    for key in overrides:
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {quoted(key)}", _suggest_key(key))
    flags = {key: value for key, value in overrides.items() if value is not None}
    layers.append(
        (flags, lambda _key: _Origin("from the command line", "change the command-line flag"))
    )
    return layers


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


_GLOBS: tuple[Callable[[Any], bool], str] = (
    _globs_ok,
    f"a list of non-empty glob patterns of at most {MAX_PATH_CHARS} characters",
)
_ABSOLUTE: tuple[Callable[[Any], bool], str] = (
    lambda v: os.path.isabs(v) and _path_ok(v),
    f"an absolute path of at most {MAX_PATH_CHARS} characters, without NUL",
)
# Checks beyond the type and the range (RANGES), by dotted key: (is the value fine?, what is
# allowed).
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "policy.actions": (
        lambda v: len(v) > 0 and len(set(v)) == len(v),
        "a non-empty list of cancel and/or reset, without repeats",
    ),
    "policy.allow_comms": _GLOBS,
    "policy.deny_comms": _GLOBS,
    "policy.allow_cgroups": _GLOBS,
    "policy.deny_cgroups": _GLOBS,
    "collector.ports": (
        lambda v: len(v) <= MAX_FILTER_PORTS,
        f"a list of at most {MAX_FILTER_PORTS} ports (empty = all ports)",
    ),
    "collector.send_mode": (
        lambda v: v in ("auto", *SEND_MODES),
        "one of " + ", ".join(("auto", *SEND_MODES)),
    ),
    "hook.socket": _ABSOLUTE,
    "http.listen": (_listen_ok, 'host:port with a port 0..65535 ("[::1]:9431" for IPv6)'),
    "audit.path": (
        _path_ok,
        f'a path of at most {MAX_PATH_CHARS} characters, without NUL ("" = stdout only)',
    ),
    "path.procfs": _ABSOLUTE,
    "path.sysfs": _ABSOLUTE,
}


def _check(key: str, value: object, raw: object, origin: _Origin) -> None:
    """Raises ConfigError unless the typed `value` of `key` is in its range (each item, for a
    list) and passes its check."""
    bounds = RANGES.get(key)
    numbers: tuple[Any, ...] = value if isinstance(value, tuple) else (value,)
    if bounds is not None and not all(bounds.holds(number) for number in numbers):
        raise _bad_value(key, raw, bounds.allowed(isinstance(value, tuple)), origin)
    check = _CHECKS.get(key)
    if check is not None and not check[0](value):
        raise _bad_value(key, raw, check[1], origin)


def parse_flag(key: str, raw: object, flag: str) -> object:
    """The typed value of setting `key` from command-line `flag` (a repeatable flag's values
    as a tuple), checked as a value from the file or the environment is; ConfigError naming
    the flag. Every command's flags for a setting go through here, not only `kvwatch run`'s."""
    origin = _Origin(f"from {flag}", f"change {flag}")
    value = _coerce(raw, key, origin)
    _check(key, value, raw, origin)
    return value


def load_config(
    path: str | None, env: Mapping[str, str], overrides: Mapping[str, object]
) -> AgentConfig:
    """The effective configuration: defaults < file at `path` (None: no file) < `env`
    (pass os.environ) < `overrides` (dotted key -> flag value; None means "flag not given").
    Raises ConfigError naming the key, the bad value, where it came from and what is allowed."""
    values: dict[str, object] = {}
    raws: dict[str, object] = {}
    origins: dict[str, _Origin] = {}
    for layer, origin_of in _layers(path, env, overrides):
        for key, raw in layer.items():
            origins[key] = origin_of(key)
            raws[key] = raw
            values[key] = _coerce(raw, key, origins[key])
    for key in _FIELDS:
        if key in values:
            _check(key, values[key], raws[key], origins[key])
    sections: dict[str, dict[str, object]] = {section: {} for section in _SECTIONS}
    for key, value in values.items():
        section, name = key.split(".", 1)
        sections[section][name] = value
    config = AgentConfig(**{name: _SECTIONS[name](**kw) for name, kw in sections.items()})
    _check_hold_bounds(config.policy, origins)
    return config


def _check_hold_bounds(policy: PolicyConfig, origins: Mapping[str, _Origin]) -> None:
    """The release bound must lie below the pause bound, or a released stream would be
    paused again at once (and a paused one never released)."""
    if policy.release_seconds < policy.pause_seconds:
        return
    key = next(
        (k for k in ("policy.release_seconds", "policy.pause_seconds") if k in origins),
        "policy.release_seconds",
    )
    origin = origins.get(key, _Origin("by default", f"set {key}"))
    raise ConfigError(
        f"policy.release_seconds {policy.release_seconds} must be below policy.pause_seconds "
        f"{policy.pause_seconds} ({key} {origin.label})",
        f"{origin.fix}: for example release_seconds = pause_seconds / 2",
    )


def config_to_dict(config: AgentConfig) -> dict[str, dict[str, object]]:
    """The configuration as TOML-shaped plain data (lists, not tuples), for showing it."""
    return {
        section: {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in dataclasses.asdict(getattr(config, section)).items()
        }
        for section in _SECTIONS
    }

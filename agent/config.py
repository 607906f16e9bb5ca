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
docs/configuration.md is the user's reference; keep it in step with the dataclasses below.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

from kvwatch.collect.bpf.layout import MAX_FILTER_PORTS
from kvwatch.collect.bpf.loader import SEND_MODES
from kvwatch.collect.table import Backend
from kvwatch.errors import ConfigError
from kvwatch.streams.states import DEFAULT_MIN_READER_BYTES_PER_SECOND, StatePolicy

Mode = Literal["observe", "enforce"]
Action = Literal["cancel", "reset"]
ENV_PREFIX = "KVWATCH_"
# The most entries the kernel gives a BPF hash map: its bucket table (a power of two of
# 16-byte buckets) must stay under 4 GiB (kernel/bpf/hashtab.c, htab_map_alloc).
MAX_SOCKETS_LIMIT = 1 << 28
# Old dotted key -> the key it was renamed to; the old one still loads, with a warning.
RENAMED_KEYS = {"collector.send_hook": "collector.send_mode"}

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyConfig:
    """When a stalled stream is acted on, and how (kvwatch.policy.rules.decide reads only this).

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

    def state_policy(self) -> StatePolicy:
        """The judge's thresholds (kvwatch.streams.states), from the same settings."""
        return StatePolicy(
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


def split_listen(listen: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[ipv6]:port"; raises ValueError on anything else."""
    host, sep, port_text = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"not a host:port address: {listen!r}")
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
    close = difflib.get_close_matches(section, list(_SECTIONS), n=1, cutoff=0.6)
    return f"did you mean [{close[0]}]?" if close else f"sections: {', '.join(_SECTIONS)}"


def _suggest_key(key: str, spell: Callable[[str], str] = str) -> str:
    """A hint for an unknown dotted `key`: the same key name in another section, or the
    closest key of its section, else the keys of its section; each written by `spell`."""
    section, _, name = key.partition(".")
    in_section = [known.partition(".")[2] for known in _FIELDS if known.startswith(section + ".")]
    close = difflib.get_close_matches(name, in_section, n=1, cutoff=0.6)
    elsewhere = [known for known in _FIELDS if known.partition(".")[2] == name]
    if close or elsewhere:
        return f"did you mean {spell(elsewhere[0] if elsewhere else f'{section}.{close[0]}')}?"
    if not in_section:
        return _suggest_section(section)
    return "known: " + ", ".join(spell(f"{section}.{known}") for known in in_section)


def _show(value: object) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


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
    return kind(value)


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
    if not math.isfinite(number):
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


def _read_file(path: str) -> dict[str, object]:
    """The raw values of a TOML file, by dotted key; unknown tables and keys are errors."""
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(
            f"cannot read config file {path}: {exc.strerror}", "check the --config path"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not valid TOML: {exc}", "fix the syntax at the place shown"
        ) from exc
    values: dict[str, object] = {}
    for section, table in document.items():
        if section not in _SECTIONS:
            raise ConfigError(f"unknown section [{section}] in {path}", _suggest_section(section))
        if not isinstance(table, dict):
            raise ConfigError(f"{section} in {path} must be a table", f"write it as [{section}]")
        for name, value in table.items():
            key = _renamed(f"{section}.{name}", f"in {path}")
            if key not in _FIELDS:
                raise ConfigError(f"unknown key {key} in {path}", _suggest_key(key))
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
            raise ConfigError(f"unknown environment variable {name}", hint)
        values[_renamed(known[name], "in the environment", env_name)] = text
    return values


def _layers(
    path: str | None, env: Mapping[str, str], overrides: Mapping[str, object]
) -> list[tuple[dict[str, object], Callable[[str], _Origin]]]:
    layers: list[tuple[dict[str, object], Callable[[str], _Origin]]] = []
    if path:
        layers.append((_read_file(path), lambda _key: _Origin(f"in {path}", f"edit {path}")))
    layers.append(
        (_read_env(env), lambda key: _Origin(f"from ${env_name(key)}", f"change ${env_name(key)}"))
    )
    for key in overrides:
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {key}", _suggest_key(key))
    flags = {key: value for key, value in overrides.items() if value is not None}
    layers.append(
        (flags, lambda _key: _Origin("from the command line", "change the command-line flag"))
    )
    return layers


def _ports_ok(ports: tuple[int, ...]) -> bool:
    return all(0 < port < 65536 for port in ports)


def _listen_ok(listen: str) -> bool:
    try:
        split_listen(listen)
    except ValueError:
        return False
    return True


_PORT_LIST = (_ports_ok, "a list of ports 1..65535")
_GLOBS: tuple[Callable[[Any], bool], str] = (all, "a list of non-empty glob patterns")
_ABSOLUTE: tuple[Callable[[Any], bool], str] = (os.path.isabs, "an absolute path")
# Checks beyond the type, by dotted key: (is the value fine?, what is allowed).
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "policy.actions": (
        lambda v: len(v) > 0 and len(set(v)) == len(v),
        "a non-empty list of cancel and/or reset, without repeats",
    ),
    "policy.stall_seconds": (lambda v: v > 0, "> 0 seconds"),
    "policy.min_reader_bytes_per_second": (lambda v: v >= 1, ">= 1 bytes per second"),
    "policy.min_kv_bytes": (lambda v: v >= 0, ">= 0 bytes"),
    "policy.grace_seconds": (lambda v: v >= 0, ">= 0 seconds"),
    "policy.max_cancels_per_minute": (lambda v: v >= 1, ">= 1 (use mode = observe to act never)"),
    "policy.allow_ports": _PORT_LIST,
    "policy.deny_ports": _PORT_LIST,
    "policy.allow_comms": _GLOBS,
    "policy.deny_comms": _GLOBS,
    "policy.allow_cgroups": _GLOBS,
    "policy.deny_cgroups": _GLOBS,
    "collector.ports": (
        lambda v: _ports_ok(v) and len(v) <= MAX_FILTER_PORTS,
        f"a list of at most {MAX_FILTER_PORTS} ports 1..65535 (empty = all ports)",
    ),
    "collector.send_mode": (
        lambda v: v in ("auto", *SEND_MODES),
        "one of " + ", ".join(("auto", *SEND_MODES)),
    ),
    "collector.pid": (lambda v: v >= 0, ">= 0 (0 = every process)"),
    "collector.max_sockets": (
        lambda v: 1 <= v <= MAX_SOCKETS_LIMIT,
        f"1..{MAX_SOCKETS_LIMIT} (the kernel's limit for a BPF hash map)",
    ),
    "hook.socket": _ABSOLUTE,
    "hook.allowed_uids": (lambda v: all(uid >= 0 for uid in v), "a list of uids >= 0"),
    "http.listen": (_listen_ok, 'host:port with a port 0..65535 ("[::1]:9431" for IPv6)'),
    "path.procfs": _ABSOLUTE,
    "path.sysfs": _ABSOLUTE,
    "streams.history_size": (lambda v: v >= 0, ">= 0"),
}


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
    for key, (is_ok, allowed) in _CHECKS.items():
        if key in values and not is_ok(values[key]):
            raise _bad_value(key, raws[key], allowed, origins[key])
    sections: dict[str, dict[str, object]] = {section: {} for section in _SECTIONS}
    for key, value in values.items():
        section, name = key.split(".", 1)
        sections[section][name] = value
    return AgentConfig(**{name: _SECTIONS[name](**kw) for name, kw in sections.items()})


def config_to_dict(config: AgentConfig) -> dict[str, dict[str, object]]:
    """The configuration as TOML-shaped plain data (lists, not tuples), for showing it."""
    return {
        section: {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in dataclasses.asdict(getattr(config, section)).items()
        }
        for section in _SECTIONS
    }

"""`kvwatch baseline diff A B`: two baseline files read back (checked field by field: a
damaged file is a usage error that says so), what changed between them, counters as rates over
the interval, and the sysctl lines that would restore A's settings. Those are printed, never
run: rolling back is the operator's decision, on the node they mean."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvwatch.errors import ConfigError, quoted_path
from kvwatch.files import read_small_file
from kvwatch.tools.baseline import FORMAT, FORMAT_VERSION, ProcessMemory, Snapshot
from kvwatch.tools.tables import human_bytes

# A baseline holds a few sysctls and counters and one line per engine process: kBs.
MAX_BASELINE_BYTES = 16 << 20
_NEW_BASELINE_HINT = (
    "take a new one with `kvwatch baseline save FILE` (this one may be truncated or edited)"
)


def _unusable(source: str, problem: str) -> ConfigError:
    return ConfigError(
        f"{quoted_path(source)} is not a usable kvwatch baseline: {problem}", _NEW_BASELINE_HINT
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(obj: dict[str, Any], key: str, source: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise _unusable(source, f"{key!r} is missing or not a string")
    return value


def _mapping(
    obj: dict[str, Any], key: str, source: str, is_value: Callable[[Any], bool]
) -> dict[str, Any]:
    value = obj.get(key)
    if not isinstance(value, dict) or not all(is_value(v) for v in value.values()):
        raise _unusable(source, f"{key!r} is missing or holds values of the wrong type")
    return value


def _process_from_json(entry: object, source: str) -> ProcessMemory:
    fields: dict[str, Callable[[object], bool]] = {
        "pid": _is_int,
        "comm": lambda v: isinstance(v, str),
        "cgroup": lambda v: isinstance(v, str),
        "cgroup_version": lambda v: v in (None, 1, 2),
        "memory_current_bytes": lambda v: v is None or _is_int(v),
        "socket_memory_bytes": lambda v: v is None or _is_int(v),
    }
    if not isinstance(entry, dict) or not all(
        key in entry and valid(entry[key]) for key, valid in fields.items()
    ):
        raise _unusable(source, f"a process entry is malformed: {str(entry)[:80]}")
    stat = _mapping(entry, "memory_stat", source, _is_int)
    return ProcessMemory(**{key: entry[key] for key in fields}, memory_stat=stat)


def snapshot_from_json(obj: object, source: str) -> Snapshot:
    """Checks a parsed baseline file field by field; ConfigError (naming `source`) otherwise."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise _unusable(source, f"no {FORMAT!r} format marker")
    if obj.get("version") != FORMAT_VERSION:
        raise ConfigError(
            f"{source} is baseline format version {obj.get('version')!r}; "
            f"this kvwatch reads version {FORMAT_VERSION}",
            "diff it with the kvwatch release that saved it, or save a new baseline",
        )
    taken = obj.get("taken_unix_seconds")
    if not isinstance(taken, int | float) or isinstance(taken, bool):
        raise _unusable(source, "'taken_unix_seconds' is missing or not a number")
    processes = obj.get("processes")
    if not isinstance(processes, list):
        raise _unusable(source, "'processes' is missing or not a list")
    return Snapshot(
        taken_at=_text(obj, "taken_at", source),
        taken_unix_seconds=float(taken),
        hostname=_text(obj, "hostname", source),
        kernel=_text(obj, "kernel", source),
        boot_id=_text(obj, "boot_id", source),
        sysctls=_mapping(obj, "sysctls", source, lambda v: v is None or isinstance(v, str)),
        counters=_mapping(obj, "counters", source, lambda v: v is None or _is_int(v)),
        sockstat=_mapping(
            obj,
            "sockstat",
            source,
            lambda v: isinstance(v, dict) and all(_is_int(n) for n in v.values()),
        ),
        processes=tuple(_process_from_json(entry, source) for entry in processes),
    )


def load_snapshot(path: str) -> Snapshot:
    """Reads and checks a baseline file; every problem is a ConfigError (exit code 2)."""
    data = read_small_file(
        path, "baseline", "pass a file written by `kvwatch baseline save`", MAX_BASELINE_BYTES
    )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _unusable(path, "it is not UTF-8 text") from exc
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _unusable(path, f"invalid JSON at line {exc.lineno}, column {exc.colno}") from exc
    except (ValueError, RecursionError) as exc:  # an integer of over 4300 digits; nesting
        raise _unusable(path, "it is not a baseline's JSON") from exc
    return snapshot_from_json(obj, path)


@dataclass(frozen=True)
class SysctlChange:
    name: str
    a: str | None
    b: str | None

    @property
    def changed(self) -> bool:
        return self.a != self.b


@dataclass(frozen=True)
class CounterChange:
    """`per_second` is None when the two values are not comparable (a missing counter,
    another boot, a counter that went backwards)."""

    name: str
    a: int | None
    b: int | None
    delta: int | None
    per_second: float | None


@dataclass(frozen=True)
class ValueChange:
    name: str
    a: int | None
    b: int | None

    @property
    def delta(self) -> int | None:
        return self.b - self.a if self.a is not None and self.b is not None else None


@dataclass(frozen=True)
class ProcessChange:
    """One process found in both snapshots (same pid and comm)."""

    pid: int
    comm: str
    cgroup: str
    memory: ValueChange
    socket_memory: ValueChange


@dataclass(frozen=True)
class BaselineDiff:
    a: Snapshot
    b: Snapshot
    interval_seconds: float
    same_boot: bool
    sysctls: tuple[SysctlChange, ...]
    counters: tuple[CounterChange, ...]
    sockstat: tuple[ValueChange, ...]
    processes: tuple[ProcessChange, ...]
    notes: tuple[str, ...]

    @property
    def rollback(self) -> list[str]:
        """sysctl lines that put A's values back (for settings both A and B have)."""
        return [
            f"sysctl -w {shlex.quote(f'{change.name}={change.a}')}"
            for change in self.sysctls
            if change.changed and change.a is not None and change.b is not None
        ]


def _counter(name: str, a: int | None, b: int | None, seconds: float | None) -> CounterChange:
    if a is None or b is None:
        return CounterChange(name, a, b, None, None)
    delta = b - a
    rate = delta / seconds if seconds and delta >= 0 else None
    return CounterChange(name, a, b, delta, rate)


def _sockstat(a: Snapshot, b: Snapshot) -> tuple[ValueChange, ...]:
    keys = dict.fromkeys(
        (protocol, field)
        for source in (a.sockstat, b.sockstat)
        for protocol, fields in source.items()
        for field in fields
    )
    return tuple(
        ValueChange(
            f"{protocol}.{field}",
            a.sockstat.get(protocol, {}).get(field),
            b.sockstat.get(protocol, {}).get(field),
        )
        for protocol, field in keys
    )


def _processes(a: Snapshot, b: Snapshot, notes: list[str]) -> tuple[ProcessChange, ...]:
    after = {(p.pid, p.comm): p for p in b.processes}
    changes: list[ProcessChange] = []
    for before in a.processes:
        now = after.pop((before.pid, before.comm), None)
        if now is None:
            notes.append(f"pid {before.pid} ({before.comm}) is only in A")
            continue
        changes.append(
            ProcessChange(
                before.pid,
                before.comm,
                now.cgroup,
                ValueChange("memory", before.memory_current_bytes, now.memory_current_bytes),
                ValueChange("sockets", before.socket_memory_bytes, now.socket_memory_bytes),
            )
        )
    notes.extend(f"pid {pid} ({comm}) is only in B" for pid, comm in after)
    return tuple(changes)


def diff_snapshots(a: Snapshot, b: Snapshot) -> BaselineDiff:
    interval = b.taken_unix_seconds - a.taken_unix_seconds
    if interval <= 0:
        raise ConfigError(
            f"B ({b.taken_at}) was not taken after A ({a.taken_at})",
            "pass the older baseline first: kvwatch baseline diff OLD NEW",
        )
    notes: list[str] = []
    same_boot = a.boot_id == b.boot_id and a.hostname == b.hostname
    if a.hostname != b.hostname:
        notes.append(f"the baselines come from different hosts ({a.hostname}, {b.hostname})")
    elif not same_boot:
        notes.append("the node rebooted between A and B: counters restarted, no rates shown")
    seconds = interval if same_boot else None
    counters = tuple(
        _counter(name, a.counters.get(name), b.counters.get(name), seconds)
        for name in dict.fromkeys([*a.counters, *b.counters])
    )
    notes.extend(
        f"{c.name} went backwards ({c.a} -> {c.b}): reset or wrapped"
        for c in counters
        if same_boot and c.delta is not None and c.delta < 0
    )
    sysctls = tuple(
        SysctlChange(name, a.sysctls.get(name), b.sysctls.get(name))
        for name in dict.fromkeys([*a.sysctls, *b.sysctls])
    )
    notes.extend(
        f"{s.name} is not in A: nothing to roll it back to" for s in sysctls if s.a is None and s.b
    )
    notes.extend(
        f"{s.name} is not in B: this kernel (or network namespace) no longer has it"
        for s in sysctls
        if s.b is None and s.a
    )
    processes = _processes(a, b, notes)
    return BaselineDiff(
        a, b, interval, same_boot, sysctls, counters, _sockstat(a, b), processes, tuple(notes)
    )


def _value_json(change: ValueChange) -> dict[str, Any]:
    return {"name": change.name, "a": change.a, "b": change.b, "delta": change.delta}


def diff_json(diff: BaselineDiff, a_path: str, b_path: str) -> dict[str, Any]:
    """The `kvwatch baseline diff --json` object."""

    def header(snapshot: Snapshot, path: str) -> dict[str, Any]:
        return {"path": path, "taken_at": snapshot.taken_at, "hostname": snapshot.hostname}

    return {
        "a": header(diff.a, a_path),
        "b": header(diff.b, b_path),
        "interval_seconds": round(diff.interval_seconds, 3),
        "same_boot": diff.same_boot,
        "sysctls": [{**asdict(s), "changed": s.changed} for s in diff.sysctls],
        "counters": [asdict(c) for c in diff.counters],
        "sockstat": [_value_json(v) for v in diff.sockstat],
        "processes": [
            {
                "pid": p.pid,
                "comm": p.comm,
                "cgroup": p.cgroup,
                "memory_bytes": _value_json(p.memory),
                "socket_memory_bytes": _value_json(p.socket_memory),
            }
            for p in diff.processes
        ],
        "rollback": diff.rollback,
        "notes": list(diff.notes),
    }


def _arrow(a: object, b: object) -> str:
    show = ["-" if v is None else str(v) for v in (a, b)]
    return show[0] if a == b else f"{show[0]} -> {show[1]}"


def _bytes_change(change: ValueChange) -> str:
    if change.a is None and change.b is None:
        return "unknown"
    show = ["-" if v is None else human_bytes(v) for v in (change.a, change.b)]
    delta = change.delta
    signed = "" if delta is None else f" ({'+' if delta >= 0 else '-'}{human_bytes(abs(delta))})"
    return f"{show[0]} -> {show[1]}{signed}"


def _rate(change: CounterChange) -> str:
    if change.delta is None:
        return "-"
    rate = "" if change.per_second is None else f"  {change.per_second:.3g}/s"
    return f"{change.delta:+d}{rate}"


def diff_lines(diff: BaselineDiff, a_path: str, b_path: str) -> list[str]:
    """The diff as a person reads it: plain text, no colour, fine to pipe."""
    lines = [
        f"A: {a_path} ({diff.a.taken_at}, {diff.a.hostname})",
        f"B: {b_path} ({diff.b.taken_at}, {diff.b.hostname}), {diff.interval_seconds:.1f} s later",
        "",
        "sysctls:",
    ]
    for s in diff.sysctls:
        mark = "changed" if s.changed else "same"
        lines.append(f"  {s.name:30} {mark:8} {_arrow(s.a, s.b)}")
    lines += ["", f"counters (change, and rate over {diff.interval_seconds:.1f} s):"]
    for c in diff.counters:
        lines.append(f"  {c.name:30} {_arrow(c.a, c.b):24} {_rate(c)}")
    lines += ["", "sockstat (TCP mem in pages):"]
    lines += [
        f"  {v.name:30} {_arrow(v.a, v.b):24} {'' if not v.delta else f'{v.delta:+d}'}"
        for v in diff.sockstat
        if v.name.split(".")[0] in ("TCP", "sockets")
    ]
    if diff.processes:
        lines += ["", "engine cgroup memory:"]
        for p in diff.processes:
            lines.append(f"  pid {p.pid} ({p.comm}) {p.cgroup}")
            lines.append(f"    memory {_bytes_change(p.memory)}")
            lines.append(f"    socket memory {_bytes_change(p.socket_memory)}")
    lines += ["", *(f"note: {note}" for note in diff.notes)] if diff.notes else []
    rollback = diff.rollback
    lines.append("")
    if rollback:
        lines.append("to put A's sysctls back (printed only; kvwatch runs none of them):")
        lines += [f"  {line}" for line in rollback]
    else:
        lines.append("no sysctl changed between A and B: nothing to roll back")
    return lines

"""What `kvwatch top` shows, apart from where it comes from and how it is drawn.

Rows are the `kvwatch streams --json` contract (dicts), whatever the source: the daemon's
/api/v1/streams, or `socket_json` rows built in-process by --standalone.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvwatch.sockets import Endpoint
from kvwatch.streams.states import StreamState

Row = dict[str, Any]
SORT_KEYS = ("stuck", "state", "kv", "fill", "age", "port", "pid")
# Worst first: the order the `state` sort uses and the `t` key cycles through.
STATE_SEVERITY = ("stalled", "zero_window", "slow", "healthy", "cancelled", "closed")
RATE_WINDOW_SECONDS = 60.0
assert set(STATE_SEVERITY) == {s.value for s in StreamState}


@dataclass(frozen=True)
class GpuMemory:
    gpu: str
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class Header:
    """The frame's summary. None means unknown, which is shown as such (never as zero):
    `gpus` None when NVML is not available, `stalled_kv_bytes` None when stalled streams have
    no engine request joined, `cancels_per_minute` None where nothing can cancel."""

    source: str
    mode: str
    attach_points: dict[str, str]
    gpus: tuple[GpuMemory, ...] | None
    stalled_kv_bytes: int | None
    cancels_per_minute: float | None
    error: str = ""


@dataclass(frozen=True)
class Frame:
    header: Header
    rows: list[Row]


def stalled_kv_bytes(rows: list[Row]) -> int | None:
    """KV held by stalled streams; None when some stalled stream's KV is unknown and none
    is known (no engine hook), 0 when nothing is stalled."""
    stalled = [row for row in rows if row.get("state") == StreamState.STALLED.value]
    known = [kv for row in stalled if isinstance(kv := row.get("kv_bytes"), int)]
    if stalled and not known:
        return None
    return sum(known)


@dataclass(frozen=True)
class MetricFacts:
    """What the header needs from /metrics. `gpus` None: NVML unavailable or not exported."""

    gpus: tuple[GpuMemory, ...] | None
    cancels_total: float


def parse_metrics(text: str) -> MetricFacts:
    used: dict[str, float] = {}
    total: dict[str, float] = {}
    nvml_available = False
    cancels = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "kvwatch_gpu_nvml_available":
                nvml_available = sample.value == 1
            elif sample.name == "kvwatch_gpu_memory_used_bytes":
                used[labels.get("gpu", "?")] = sample.value
            elif sample.name == "kvwatch_gpu_memory_total_bytes":
                total[labels.get("gpu", "?")] = sample.value
            elif sample.name == "kvwatch_actions_total" and (
                labels.get("action"),
                labels.get("result"),
            ) == ("cancel", "cancelled"):
                cancels += sample.value
    gpus = tuple(
        GpuMemory(gpu, int(used.get(gpu, 0)), int(total[gpu])) for gpu in sorted(total, key=_num)
    )
    return MetricFacts(gpus if nvml_available else None, cancels)


def _num(text: str) -> tuple[int, str]:
    return (int(text), "") if text.isdigit() else (1 << 30, text)


@dataclass
class CancelRate:
    """Cancels per minute from a cumulative counter: over the last minute of observations,
    or (with only one so far) the average since the daemon started."""

    observed: deque[tuple[float, float]] = field(default_factory=deque)

    def update(self, total: float, uptime_seconds: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self.observed.append((now, total))
        while len(self.observed) > 2 and now - self.observed[1][0] >= RATE_WINDOW_SECONDS:
            self.observed.popleft()
        first_time, first_total = self.observed[0]
        if now - first_time > 0:
            return max(0.0, total - first_total) * 60.0 / (now - first_time)
        return total * 60.0 / uptime_seconds if uptime_seconds > 0 else 0.0


def _port(text: object) -> int | None:
    try:
        return Endpoint.parse(str(text)).port
    except ValueError:
        return None


def _number(row: Row, key: str) -> float:
    value = row.get(key)
    return float(value) if isinstance(value, int | float) else -1.0


def fill_fraction(row: Row) -> float:
    sndbuf = _number(row, "sndbuf")
    return _number(row, "wmem_queued") / sndbuf if sndbuf > 0 else 0.0


def _severity(row: Row) -> int:
    state = row.get("state")
    return STATE_SEVERITY.index(state) if state in STATE_SEVERITY else len(STATE_SEVERITY)


# Each sort key puts what matters most in an incident first (before `reverse`).
SORTERS = {
    "stuck": lambda r: (-_number(r, "no_progress_seconds"), -_number(r, "zero_window_seconds")),
    "state": lambda r: (_severity(r), -_number(r, "no_progress_seconds")),
    "kv": lambda r: (-_number(r, "kv_bytes"), _severity(r)),
    "fill": lambda r: (-fill_fraction(r), _severity(r)),
    "age": lambda r: (-_number(r, "age_seconds"), _severity(r)),
    "port": lambda r: (_port(r.get("local")) or 0, _port(r.get("remote")) or 0),
    "pid": lambda r: (_number(r, "pid"), _severity(r)),
}
assert tuple(SORTERS) == SORT_KEYS


@dataclass
class RowFilter:
    """Which rows show and in what order. Ports match either end of the connection; an
    empty tuple (or None) filters nothing. Owned by the display loop; keys change it."""

    ports: tuple[int, ...] = ()
    pid: int | None = None
    states: tuple[str, ...] = ()
    sort: str = "stuck"
    reverse: bool = False

    def keeps(self, row: Row) -> bool:
        if self.ports and not {_port(row.get("local")), _port(row.get("remote"))} & set(self.ports):
            return False
        if self.pid is not None and self.pid not in (row.get("pid"), row.get("engine_pid")):
            return False
        return not self.states or row.get("state") in self.states

    def apply(self, rows: list[Row]) -> list[Row]:
        kept = [row for row in rows if self.keeps(row)]
        return sorted(kept, key=SORTERS[self.sort], reverse=self.reverse)

    def describe(self) -> str:
        parts = [f"sort {self.sort}{' (reversed)' if self.reverse else ''}"]
        if self.ports:
            parts.append("port " + ",".join(map(str, self.ports)))
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        if self.states:
            parts.append("state " + ",".join(self.states))
        return " · ".join(parts)

"""Event counters both ends of the engine hook keep: the agent's hook server and the engine's
hook each count what happened on their side under a fixed set of names."""

from __future__ import annotations

import threading


class EventCounters:
    """Monotonic counts under the names given at construction; any thread may add (a lock
    keeps them exact). Counting under a name outside that set is a bug and raises."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            if name not in self._values:
                raise KeyError(f"unknown event counter {name!r}")
            self._values[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

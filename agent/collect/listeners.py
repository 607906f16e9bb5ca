"""Which TCP ports a network namespace listens on, from /proc/<pid>/net/tcp and tcp6.

An accepted socket's local port is its listener's; a socket a process opened itself
(connect) gets an ephemeral port, and the kernel never hands out a port a listener is bound
to. So a socket whose local port is not a listening port of its namespace was actively
opened: the relay join asks this of a proxy's upstream (kvwatch.streams.relay).

The kernel lists a namespace's sockets listening ones first (tcp_seq_start walks the
listening hash before the established one), so a reader stops at the first row in another
state and never reads the rest: a proxy's namespace may hold many thousands of connections.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

LISTEN_STATE = "0A"  # TCP_LISTEN, as /proc/net/tcp writes it
CACHE_SECONDS = 1.0
MAX_NAMESPACES = 4096
TABLES = ("tcp", "tcp6")


def parse_listening_ports(rows: Iterable[str]) -> set[int]:
    """The local ports of the LISTEN rows of a /proc/net/tcp(6) text, up to the first row in
    another state (the kernel writes listening sockets first). The header line is skipped."""
    ports: set[int] = set()
    for row in rows:
        fields = row.split()
        if len(fields) < 4 or fields[0] == "sl":
            continue
        if fields[3] != LISTEN_STATE:
            break
        ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


class ListeningPorts:
    """The listening ports of each network namespace, read through a process in it under
    `procfs_root` and cached for `cache_seconds`. A socket no process owns any more (pid 0:
    closed while the kernel drains it) is told through the process its namespace was last
    read through. Owned by one thread (the daemon's event loop); not thread-safe. Bounded:
    expired entries are dropped on each read, and at most MAX_NAMESPACES readers are kept."""

    def __init__(self, procfs_root: str = "/proc", cache_seconds: float = CACHE_SECONDS) -> None:
        self.procfs_root = procfs_root
        self.cache_seconds = cache_seconds
        self.reads = 0
        self._cached: dict[int, tuple[float, frozenset[int]]] = {}
        self._readers: dict[int, int] = {}  # namespace -> the pid it was last read through

    def ports(self, pid: int, netns: int) -> frozenset[int] | None:
        """The ports listened on in `netns`, read through `pid` (which lives there), or for
        pid 0 through the process the namespace was last read through; None when that cannot
        be read (no such process, or this procfs does not show it)."""
        now = time.monotonic()
        key = netns if netns else -pid  # a namespace not known: the process's own
        cached = self._cached.get(key)
        if cached is not None and now - cached[0] < self.cache_seconds:
            return cached[1]
        reader = pid if pid > 0 else self._readers.pop(key, 0)
        found = self._read(reader)
        if found is None:
            return None
        self._cached = {k: v for k, v in self._cached.items() if now - v[0] < self.cache_seconds}
        self._cached[key] = (now, found)
        self._readers.pop(key, None)
        self._readers[key] = reader
        if len(self._readers) > MAX_NAMESPACES:
            del self._readers[next(iter(self._readers))]
        return found

    def actively_opened(self, pid: int, netns: int, local_port: int) -> bool:
        """True when a socket of `pid` with this local port was opened by the process itself:
        no listener in its namespace holds the port. False when that cannot be told."""
        listening = self.ports(pid, netns)
        return listening is not None and local_port not in listening

    def _read(self, pid: int) -> frozenset[int] | None:
        if pid <= 0:
            return None
        self.reads += 1
        ports: set[int] = set()
        for table in TABLES:
            path = os.path.join(self.procfs_root, str(pid), "net", table)
            try:
                with open(path, encoding="ascii") as rows:
                    ports |= parse_listening_ports(rows)
            except FileNotFoundError:
                if table == "tcp":  # tcp6 is absent where IPv6 is disabled
                    return None
            except (ProcessLookupError, PermissionError):
                return None
        return frozenset(ports)

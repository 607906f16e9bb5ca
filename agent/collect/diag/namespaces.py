"""sock_diag in every network namespace of the node, not only the agent's own.

A netlink socket dumps the namespace it was opened in, and engines in pods live in namespaces
of their own. `NamespacedDiag` keeps one sock_diag socket per network namespace that some
process lives in (found through procfs, entered with setns on the calling thread only, then
left), and dumps each of them. Blocking; owned by one thread.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection
from pathlib import Path

from kvwatch.collect.diag.snapshot import DiagClient, DiagSnapshot
from kvwatch.collect.diag.wire import DiagEntry
from kvwatch.collect.netns import network_namespace
from kvwatch.collect.procfs import Procfs
from kvwatch.errors import KvwatchError
from kvwatch.sockets import Endpoint

RESCAN_SECONDS = 5.0


class NamespacedDiag:
    """Invariants: at most one DiagClient per namespace inode; the set of namespaces is looked
    up again at most every RESCAN_SECONDS (a procfs walk); a namespace that can no longer be
    entered or dumped is dropped, never fatal, except the agent's own."""

    def __init__(self, procfs: Procfs) -> None:
        self.procfs = procfs
        own = DiagClient()
        self.own_netns = own.netns
        self._clients: dict[int, DiagClient] = {own.netns: own}
        self._scanned_ns = 0

    def snapshots(self, local_ports: Collection[int] = ()) -> list[DiagSnapshot]:
        self._rescan()
        taken: list[DiagSnapshot] = []
        for netns, client in list(self._clients.items()):
            try:
                taken.append(client.snapshot(local_ports))
            except KvwatchError:
                if netns == self.own_netns:
                    raise
                self._drop(netns)
        return taken

    def find(self, netns: int, local: Endpoint, remote: Endpoint) -> tuple[DiagEntry | None, int]:
        """The kernel's view of one socket of namespace `netns` and when it was taken
        (CLOCK_MONOTONIC ns); KvwatchError when that namespace cannot be reached."""
        self._rescan()
        client = self._clients.get(netns)
        if client is None:
            raise KvwatchError(f"network namespace {netns} is not reachable", "nothing to read")
        observed_ns = time.monotonic_ns()
        return client.find(local, remote), observed_ns

    def _rescan(self) -> None:
        now = time.monotonic_ns()
        if self._scanned_ns and now - self._scanned_ns < RESCAN_SECONDS * 1e9:
            return
        self._scanned_ns = now
        present = self.procfs.network_namespaces()
        for netns in set(self._clients) - set(present) - {self.own_netns}:
            self._drop(netns)
        for netns, path in present.items():
            if netns not in self._clients:
                with contextlib.suppress(KvwatchError, OSError):
                    self._clients[netns] = self._open_in(Path(path))

    @staticmethod
    def _open_in(path: Path) -> DiagClient:
        with network_namespace(path):
            return DiagClient()

    def _drop(self, netns: int) -> None:
        client = self._clients.pop(netns, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

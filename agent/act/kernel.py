"""Kernel work on one socket — the kernel's view of it and its reset with SOCK_DESTROY (netlink,
in its own network namespace), and the keepalive probes that ask a held stream's reader for
its window — on the one worker thread that may switch namespaces (setns changes the calling
thread only; sock_diag calls block, so never inside the event loop)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

from kvwatch.collect.diag.destroy import DestroyResult, destroy_socket
from kvwatch.collect.diag.snapshot import DiagClient
from kvwatch.collect.diag.wire import DiagEntry
from kvwatch.collect.netns import socket_namespace
from kvwatch.collect.procfs import Procfs
from kvwatch.collect.window_probe import WindowProbes
from kvwatch.sockets import SocketSample


def _look_up(sample: SocketSample, pid: int, procfs_root: str) -> tuple[DiagEntry | None, int]:
    with socket_namespace(sample.netns, pid, procfs_root), DiagClient() as client:
        observed_ns = time.monotonic_ns()
        return client.find(sample.local, sample.remote), observed_ns


def _destroy(sample: SocketSample, pid: int, procfs_root: str) -> str:
    local, remote = sample.local, sample.remote
    with socket_namespace(sample.netns, pid, procfs_root), DiagClient() as client:
        entry = client.find(local, remote)
        if entry is None:
            return "not_found"
        result = destroy_socket(local, remote, entry.cookie)
        return "reset" if result is DestroyResult.DESTROYED else "not_found"


class SocketWorker:
    """Owns the worker thread; `pid` is the socket's owner, through whose namespace it is
    reached when the collector's namespace inode does not name one directly."""

    def __init__(self, procfs_root: str) -> None:
        self.procfs_root = procfs_root
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvwatch-reset")
        self._probes = WindowProbes(Procfs(procfs_root))

    def probing(self, key: int) -> bool:
        return key in self._probes

    async def start_probing(self, sample: SocketSample, pid: int) -> None:
        """Has the socket (owned by `pid`) probe its reader's window each second
        (kvwatch.collect.window_probe); SocketGoneError, or PrivilegeError without the
        capability."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self._probes.start, sample.key, pid, sample.inode)

    def forget_probing(self, key: int) -> None:
        """The socket closed: its probing ended with it (queued on the worker thread)."""
        self._thread.submit(self._probes.forget, key)

    async def stop_probing(self, key: int) -> None:
        """Gives the socket back its own keepalive settings (a no-op when not probing)."""
        if key in self._probes:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._probes.stop, key)

    async def look_up(self, sample: SocketSample, pid: int) -> tuple[DiagEntry | None, int]:
        """The kernel's view of the socket (None: no such socket) and when it was taken
        (CLOCK_MONOTONIC ns); KvwatchError when its namespace cannot be reached."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, _look_up, sample, pid, self.procfs_root)

    async def destroy(self, sample: SocketSample, pid: int) -> str:
        """Resets the socket: "reset", or "not_found" when no such socket exists (its
        4-tuple and cookie are matched, so a newer socket on the same 4-tuple is safe)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, _destroy, sample, pid, self.procfs_root)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

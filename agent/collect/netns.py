"""Entering another process's network namespace, for the calling thread only.

A pod's sockets live in the pod's network namespace; sock_diag only sees the namespace the
netlink socket was opened in. `setns(2)` switches the calling thread alone, so the agent
does namespace work on a dedicated worker thread and returns to its own namespace after.
Python 3.11 has no os.setns, hence the libc call.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

from kvwatch.collect.procfs import Procfs
from kvwatch.errors import KvwatchError, PrivilegeError

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        error = OSError(code, os.strerror(code))
        raise PrivilegeError(
            f"cannot enter a network namespace ({error})",
            "the agent needs CAP_SYS_ADMIN to act on sockets in pods",
        ) from error


@contextlib.contextmanager
def network_namespace_of(pid: int, procfs_root: str = "/proc") -> Iterator[None]:
    """Runs the body in `pid`'s network namespace (no switch when it is already ours)."""
    path = Path(procfs_root, str(pid), "ns", "net")
    if not path.exists():
        raise KvwatchError(f"process {pid} is gone", "nothing to act on")
    with network_namespace(path):
        yield


def _namespace_path(netns: int, pid: int, procfs_root: str) -> Path:
    """A path to enter the network namespace with inode `netns` by: `pid`'s when it lives
    there, else that of any process that does."""
    by_pid = Path(procfs_root, str(pid), "ns", "net")
    with contextlib.suppress(OSError):
        if pid > 0 and os.stat(by_pid).st_ino == netns:
            return by_pid
    found = Procfs(procfs_root).network_namespaces().get(netns)
    if found is None:
        raise KvwatchError(
            f"no process lives in network namespace {netns} any more", "nothing to act on"
        )
    return Path(found)


@contextlib.contextmanager
def socket_namespace(netns: int, pid: int, procfs_root: str = "/proc") -> Iterator[None]:
    """Runs the body in the network namespace a socket lives in: inode `netns` (the
    collector's), entered through `pid` (its owner) where it can be; `pid`'s own namespace
    when `netns` is unknown (0). No switch when it is the agent's own."""
    if not netns:
        with network_namespace_of(pid, procfs_root):
            yield
        return
    if os.stat("/proc/thread-self/ns/net").st_ino == netns:
        yield
        return
    with network_namespace(_namespace_path(netns, pid, procfs_root)):
        yield


@contextlib.contextmanager
def network_namespace(target_path: Path) -> Iterator[None]:
    """Runs the body in the network namespace of `target_path` (a /proc/PID/ns/net or a
    /run/netns/NAME file) on this thread; FileNotFoundError when there is none."""
    own_path = Path("/proc/thread-self/ns/net")
    try:
        if os.stat(target_path).st_ino == os.stat(own_path).st_ino:
            yield
            return
        target = os.open(target_path, os.O_RDONLY)
    except PermissionError as exc:
        raise PrivilegeError(
            f"cannot open {target_path} ({exc.strerror})",
            "the agent needs CAP_SYS_PTRACE to reach another process's network namespace",
        ) from exc
    own = os.open(own_path, os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)

"""Asking a held stream's reader for its window: TCP keepalive probes on the server's socket.

A reader that drains part of its backlog tells the server nothing unless it freed at least
half its window (Linux sends a window update after a read only then: tcp_cleanup_rbuf), and
a paused stream sends nothing an ACK would answer: the server's view of the reader's window
stays as it was when the stream paused. A keepalive probe (an old sequence number, no data)
makes the reader's kernel answer with its window now, whatever its application does; a live
reader always answers. So while a stream is held, its socket sends one each second: its own
kernel sends it, with the connection's real sequence numbers and options, which firewalls
and connection tracking let through.

The socket belongs to another process (the engine, or the proxy in front of it): its fd is
borrowed with pidfd_getfd(2) (Linux 5.6; the agent needs CAP_SYS_PTRACE over that process),
set, and closed at once, so the socket never outlives its owner's close. What the owner had
set is given back when the hold ends. Blocking calls: run them off the event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

from kvwatch.collect.procfs import Procfs
from kvwatch.errors import KvwatchError, PrivilegeError

SYS_PIDFD_GETFD = 438  # the same number on every architecture (include/uapi/asm-generic)
PROBE_IDLE_SECONDS = 1
PROBE_INTERVAL_SECONDS = 1
# Unanswered probes before the kernel gives the connection up: the most it allows, so that
# only a peer silent for two minutes (gone, not slow) loses its connection meanwhile.
PROBE_COUNT = 127

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class KeepaliveSettings:
    """A socket's keepalive: on or off, and its idle, interval and count."""

    enabled: bool
    idle: int
    interval: int
    count: int


PROBING = KeepaliveSettings(True, PROBE_IDLE_SECONDS, PROBE_INTERVAL_SECONDS, PROBE_COUNT)


class SocketGoneError(KvwatchError):
    """The process or its socket is gone: nothing to probe, nothing to give back."""


@contextlib.contextmanager
def borrowed_socket(pid: int, fd: int) -> Iterator[socket.socket]:
    """The socket `pid` holds as `fd`, as a socket of this process for the body's length."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError as exc:
        raise SocketGoneError(f"process {pid} is gone", "nothing to probe") from exc
    try:
        copy = _libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if copy < 0:
            code = ctypes.get_errno()
            if code in (errno.EPERM, errno.EACCES):
                raise PrivilegeError(
                    f"cannot borrow socket fd {fd} of process {pid}: {os.strerror(code)}",
                    "the agent needs CAP_SYS_PTRACE to probe held readers' windows",
                )
            raise SocketGoneError(f"fd {fd} of process {pid}: {os.strerror(code)}", "")
    finally:
        os.close(pidfd)
    sock = socket.socket(fileno=copy)
    try:
        yield sock
    finally:
        sock.close()


def read_keepalive(sock: socket.socket) -> KeepaliveSettings:
    return KeepaliveSettings(
        bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
    )


def write_keepalive(sock: socket.socket, settings: KeepaliveSettings) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, settings.idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, settings.interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, settings.count)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, int(settings.enabled))


class WindowProbes:
    """Turns probing on and off for the sockets of held streams, by socket key, and keeps
    what each had set. Used from one thread at a time (the agent's socket worker)."""

    def __init__(self, procfs: Procfs) -> None:
        self.procfs = procfs
        self._given: dict[int, tuple[int, int, KeepaliveSettings]] = {}  # key -> pid, inode, was

    def __contains__(self, key: int) -> bool:
        return key in self._given

    def start(self, key: int, pid: int, inode: int) -> None:
        """Probes the socket (`inode`, held by `pid`) each second from now on; a no-op when it
        does already. SocketGoneError, or PrivilegeError without CAP_SYS_PTRACE."""
        if key in self._given:
            return
        with borrowed_socket(pid, self._fd(pid, inode)) as sock:
            was = read_keepalive(sock)
            write_keepalive(sock, PROBING)
        self._given[key] = (pid, inode, was)

    def stop(self, key: int) -> None:
        """Gives the socket back what it had set (nothing to do when it is gone)."""
        given = self._given.pop(key, None)
        if given is None:
            return
        pid, inode, was = given
        with (
            contextlib.suppress(SocketGoneError, OSError),
            borrowed_socket(pid, self._fd(pid, inode)) as sock,
        ):
            write_keepalive(sock, was)

    def forget(self, key: int) -> None:
        """The socket is gone: nothing to give back."""
        self._given.pop(key, None)

    def _fd(self, pid: int, inode: int) -> int:
        fd = self.procfs.socket_fd(pid, inode)
        if fd is None:
            raise SocketGoneError(f"process {pid} holds no socket {inode}", "nothing to probe")
        return fd

"""Netlink sock_diag snapshots of TCP sockets (the `ss -tinm` view), over a NETLINK_SOCK_DIAG
socket of the standard library's.

A request is one struct inet_diag_req_v2 behind a netlink header; the replies (one, or a
multipart dump ended by NLMSG_DONE) are split by their headers and parsed from their raw
bytes by kvwatch.collect.diag.wire. No netlink library: pyroute2, used here before, cost the
agent ~9 MB resident (measured at start-up) for two requests and a dump. Everything here is
blocking and refuses to run inside a running event loop: async callers use a worker thread
(`await asyncio.to_thread(...)`).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import struct
import time
from collections.abc import Collection
from dataclasses import dataclass
from types import TracebackType

from kvwatch.collect.diag.wire import (
    DIAG_EXTENSIONS,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSG_HEADER_BYTES,
    SOCK_DIAG_BY_FAMILY,
    DiagEntry,
    address_words,
    cookie_halves,
    nlmsg_errno,
    nlmsg_header,
    nlmsg_sequence,
    nlmsg_type,
    parse_inet_diag_msg,
    split_messages,
)
from kvwatch.errors import KvwatchError, PrivilegeError
from kvwatch.sockets import Endpoint

FAMILIES = (socket.AF_INET, socket.AF_INET6)
# Linux TCP states (include/net/tcp_states.h) of sockets that can hold unsent or unacked data:
# ESTABLISHED, SYN_SENT, FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING. LISTEN, TIME_WAIT,
# SYN_RECV (request sockets) and CLOSE are left out: they carry no send queue and no tcp_info.
TCP_STATES_WITH_DATA = (1, 2, 3, 4, 5, 8, 9, 11)
_STATE_MASK = sum(1 << state for state in TCP_STATES_WITH_DATA)
# idiag_cookie that matches any socket (both halves ~0U): an exact lookup by 4-tuple alone.
INET_DIAG_NOCOOKIE = (1 << 64) - 1
NETLINK_SOCK_DIAG = 4
# Netlink header flags (include/uapi/linux/netlink.h).
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
# struct inet_diag_req_v2: family, protocol, extensions, pad, states, and its
# inet_diag_sockid (ports and addresses big-endian, interface, cookie as two u32).
_REQUEST_HEAD = struct.Struct("=BBBxI")
_SOCKID_ADDRESSES = struct.Struct(">HH4I4I")
_SOCKID_TAIL = struct.Struct("=III")
# One recv() takes one datagram: the kernel fills a dump's datagrams to about 32 KB.
RECEIVE_BYTES = 1 << 18
REPLY_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class DiagSnapshot:
    """Every matching TCP socket of one network namespace at `observed_ns`.

    `observed_ns` is CLOCK_MONOTONIC taken just before the first dump request; `netns` is the
    inode of the namespace the dump ran in.
    """

    observed_ns: int
    netns: int
    entries: tuple[DiagEntry, ...]


def current_netns() -> int:
    """Inode of this thread's network namespace (what a sock_diag socket opened now dumps)."""
    return os.stat("/proc/thread-self/ns/net").st_ino


def refuse_running_loop(action: str) -> None:
    """Raises on a thread that runs an asyncio loop: the calls here block until the kernel
    answers (a dump of thousands of sockets takes a while)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise KvwatchError(
        f"{action} is blocking and cannot run inside an asyncio event loop",
        hint="call it from a worker thread: await asyncio.to_thread(...)",
    )


def netlink_failure(exc: BaseException, action: str) -> KvwatchError:
    """The kvwatch error for a failed netlink call (EPERM/EACCES -> PrivilegeError)."""
    code = getattr(exc, "errno", None)
    reason = os.strerror(code) if isinstance(code, int) else str(exc)
    if code in (errno.EPERM, errno.EACCES):
        return PrivilegeError(
            f"{action}: {reason}",
            hint="run as root or give the agent CAP_NET_ADMIN (Kubernetes: "
            "securityContext.capabilities.add: [NET_ADMIN])",
        )
    if code in (errno.ENOENT, errno.EPROTONOSUPPORT, errno.EOPNOTSUPP):
        return PrivilegeError(
            f"{action}: {reason}",
            hint="the kernel lacks TCP sock_diag support: load it with `modprobe tcp_diag` "
            "(CONFIG_INET_TCP_DIAG; SOCK_DESTROY also needs CONFIG_INET_DIAG_DESTROY)",
        )
    return KvwatchError(f"{action}: {reason}", hint="check `ss -tinm` works on this host")


@dataclass(frozen=True)
class DiagRequest:
    """A struct inet_diag_req_v2 (`body`) and the netlink flags to send it with."""

    flags: int
    body: bytes


def inet_diag_request(
    family: int,
    flags: int,
    *,
    states: int = 0,
    extensions: int = 0,
    sport: int = 0,
    dport: int = 0,
    src: tuple[int, int, int, int] = (0, 0, 0, 0),
    dst: tuple[int, int, int, int] = (0, 0, 0, 0),
    cookie: int = 0,
) -> DiagRequest:
    """A struct inet_diag_req_v2 for TCP (no interface: any)."""
    body = (
        _REQUEST_HEAD.pack(family, socket.IPPROTO_TCP, extensions, states)
        + _SOCKID_ADDRESSES.pack(sport, dport, *src, *dst)
        + _SOCKID_TAIL.pack(0, *cookie_halves(cookie))
    )
    return DiagRequest(flags, body)


def exact_request(
    local: Endpoint, remote: Endpoint, flags: int, cookie: int, extensions: int = 0
) -> DiagRequest:
    """A request for the one socket with this 4-tuple and cookie (`INET_DIAG_NOCOOKIE`: any)."""
    family = socket.AF_INET6 if ":" in local.ip else socket.AF_INET
    return inet_diag_request(
        family,
        flags,
        extensions=extensions,
        sport=local.port,
        dport=remote.port,
        src=address_words(family, local.ip),
        dst=address_words(family, remote.ip),
        cookie=cookie,
    )


class DiagClient:
    """Owns one NETLINK_SOCK_DIAG socket; blocking.

    Used by one thread at a time; it is a context manager. Errors come out as kvwatch errors.
    """

    def __init__(self) -> None:
        refuse_running_loop("opening a sock_diag socket")
        self.netns = current_netns()  # a netlink socket dumps the namespace it was opened in
        self._sequence = 0
        try:
            self._netlink = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
        except OSError as exc:
            raise netlink_failure(exc, "opening a sock_diag netlink socket") from exc
        try:
            self._netlink.bind((0, 0))
            self._netlink.settimeout(REPLY_TIMEOUT_SECONDS)
        except OSError as exc:
            self._netlink.close()
            raise netlink_failure(exc, "binding a sock_diag netlink socket") from exc

    def __enter__(self) -> DiagClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._netlink.close()

    def request(self, request: DiagRequest, message_type: int, action: str) -> list[bytes]:
        """Sends one request and returns every reply to it as raw bytes (netlink header
        included), up to the one that ends it: NLMSG_DONE after a dump, NLMSG_ERROR (an
        error, or the acknowledgement NLM_F_ACK asked for) otherwise."""
        refuse_running_loop(action)
        self._sequence = sequence = (self._sequence + 1) & 0xFFFFFFFF
        length = NLMSG_HEADER_BYTES + len(request.body)
        header = nlmsg_header(length, message_type, request.flags, sequence)
        replies: list[bytes] = []
        try:
            self._netlink.send(header + request.body)
            while True:
                for message in split_messages(self._netlink.recv(RECEIVE_BYTES)):
                    if nlmsg_sequence(message) != sequence:
                        continue  # the tail of an earlier request that failed midway
                    replies.append(message)
                    if nlmsg_type(message) in (NLMSG_DONE, NLMSG_ERROR):
                        return replies
        except OSError as exc:  # socket.timeout included: the kernel did not answer
            raise netlink_failure(exc, action) from exc

    def snapshot(self, local_ports: Collection[int] = ()) -> DiagSnapshot:
        """TCP sockets of both families, only those bound to `local_ports` when given.

        The kernel filters each dump by local port (idiag_sport), so a port filter costs one
        dump per family and port and no userspace filtering.
        """
        observed_ns = time.monotonic_ns()
        entries: dict[int, DiagEntry] = {}
        for family in FAMILIES:
            for port in sorted(set(local_ports)) or [0]:
                for entry in self._dump(family, port):
                    # A dump that races with socket churn may report a socket twice.
                    entries.setdefault(entry.cookie, entry)
        return DiagSnapshot(observed_ns, self.netns, tuple(entries.values()))

    def find(self, local: Endpoint, remote: Endpoint) -> DiagEntry | None:
        """The one TCP socket with this 4-tuple, as the kernel sees it now (an exact lookup,
        not a dump: its cost does not grow with the sockets on the port); None when there is
        none. An IPv4-mapped IPv6 socket is found by its IPv4 addresses. The kernel's lookup
        falls back to the listener on the local port, which is not the socket asked for."""
        action = f"looking up the TCP socket {local} -> {remote} over sock_diag"
        request = exact_request(
            local, remote, NLM_F_REQUEST | NLM_F_ACK, INET_DIAG_NOCOOKIE, DIAG_EXTENSIONS
        )
        for message in self.request(request, SOCK_DIAG_BY_FAMILY, action):
            kind = nlmsg_type(message)
            code = nlmsg_errno(message) if kind == NLMSG_ERROR else 0
            if code == errno.ENOENT:
                return None
            if code:
                raise netlink_failure(OSError(code, os.strerror(code)), action)
            entry = parse_inet_diag_msg(message) if kind == SOCK_DIAG_BY_FAMILY else None
            if entry is not None and entry.local == local and entry.remote == remote:
                return entry
        return None

    def _dump(self, family: int, local_port: int) -> list[DiagEntry]:
        action = "dumping TCP sockets over sock_diag"
        request = inet_diag_request(
            family,
            NLM_F_REQUEST | NLM_F_DUMP,
            states=_STATE_MASK,
            extensions=DIAG_EXTENSIONS,
            sport=local_port,
        )
        entries: list[DiagEntry] = []
        for message in self.request(request, SOCK_DIAG_BY_FAMILY, action):
            kind = nlmsg_type(message)
            code = nlmsg_errno(message) if kind == NLMSG_ERROR else 0
            if code:
                raise netlink_failure(OSError(code, os.strerror(code)), action)
            entry = parse_inet_diag_msg(message) if kind == SOCK_DIAG_BY_FAMILY else None
            if entry is not None:
                entries.append(entry)
        return entries


def take_snapshot(local_ports: Collection[int] = ()) -> DiagSnapshot:
    """One snapshot through a short-lived DiagClient (see `DiagClient.snapshot`)."""
    with DiagClient() as client:
        return client.snapshot(local_ports)

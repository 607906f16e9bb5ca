"""Byte-level parsers for sock_diag replies: inet_diag_msg, its attributes, struct tcp_info.

Parsers take bytes (the netlink message as the kernel sent it), never sockets, so they are
tested on fixtures. Layouts follow the kernel's uapi headers (linux/inet_diag.h, linux/tcp.h,
linux/sock_diag.h); `struct tcp_info` is append-only, so every field past the minimum is read
only when the kernel's copy is long enough, and is None otherwise: a field the kernel did not
send is unknown, never 0.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from kvwatch.errors import KvwatchError, PrivilegeError
from kvwatch.sockets import Endpoint

NLMSG_HEADER_BYTES = 16
_NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_NLMSG_ERRNO = struct.Struct("=i")
NLMSG_ERROR = 2
NLMSG_DONE = 3
SOCK_DIAG_BY_FAMILY = 20
# struct inet_diag_msg: family, state, timer, retrans, sport, dport (big endian), src[16],
# dst[16], if, cookie[2], expires, rqueue, wqueue, uid, inode.
_INET_DIAG_MSG = struct.Struct("=BBBB2s2s16s16sIIIIIIII")
INET_DIAG_MSG_BYTES = _INET_DIAG_MSG.size
_RTATTR = struct.Struct("=HH")
_NLA_TYPE_MASK = 0x3FFF
INET_DIAG_INFO = 2
INET_DIAG_SKMEMINFO = 7
# The idiag_ext bits that ask for those two attributes (bit = attribute type - 1).
DIAG_EXTENSIONS = (1 << (INET_DIAG_INFO - 1)) | (1 << (INET_DIAG_SKMEMINFO - 1))
# idiag_timer value when the zero-window probe ("persist") timer is armed.
TIMER_PERSIST = 4
# Indexes into the u32 array of INET_DIAG_SKMEMINFO (enum sk_meminfo in linux/sock_diag.h).
_SK_MEMINFO_SNDBUF = 3
_SK_MEMINFO_WMEM_QUEUED = 5

# struct tcp_info offsets (bytes) of the fields kvwatch reads, with the Linux version adding each.
_U8, _U32, _U64 = struct.Struct("=B"), struct.Struct("=I"), struct.Struct("=Q")
_TCPI_PROBES, _TCPI_BACKOFF, _TCPI_OPTIONS, _TCPI_WSCALE = 3, 4, 5, 6
_TCPI_RTO, _TCPI_SND_MSS, _TCPI_UNACKED = 8, 16, 24
_TCPI_LAST_DATA_SENT, _TCPI_LAST_ACK_RECV = 44, 56
_TCPI_RTT, _TCPI_SND_CWND, _TCPI_TOTAL_RETRANS = 68, 80, 100
_TCPI_BYTES_ACKED = 120  # 4.1
_TCPI_NOTSENT_BYTES = 144  # 4.6
_TCPI_BYTES_SENT = 200  # 4.19
_TCPI_SND_WND = 228  # 5.4
TCP_INFO_MIN_BYTES = _TCPI_NOTSENT_BYTES + 4
_TCPI_OPT_WSCALE = 4  # tcpi_options: window scaling was negotiated


@dataclass(frozen=True)
class TcpInfo:
    """The struct tcp_info fields kvwatch reads; None marks a field this kernel does not send.

    `probes` is icsk_probes_out (unanswered probes, reset by every ACK); `backoff` is
    icsk_backoff (grows with each zero-window probe or RTO, reset when the window opens);
    `rto_us` the current retransmission timeout; `last_data_sent_ms` and `last_ack_recv_ms`
    the time since data was last sent and since the last ACK arrived; `peer_wscale` the window
    scale the peer's windows are shifted by (0 when window scaling was not negotiated).
    """

    probes: int
    backoff: int
    peer_wscale: int
    rto_us: int
    last_data_sent_ms: int
    last_ack_recv_ms: int
    snd_mss: int
    unacked_segments: int
    rtt_us: int
    snd_cwnd: int
    total_retrans: int
    bytes_acked: int
    notsent_bytes: int
    bytes_sent: int | None
    snd_wnd: int | None


@dataclass(frozen=True)
class DiagEntry:
    """One TCP socket from a sock_diag dump, as the kernel reported it.

    `timer` is idiag_timer (which timer is armed) and `timer_expires_ms` when it fires next.
    `send_queue_bytes` is idiag_wqueue, which the kernel fills with write_seq - snd_una (what
    `ss` shows as Send-Q): every byte written and not yet acknowledged.
    """

    family: int
    local: Endpoint
    remote: Endpoint
    tcp_state: int
    timer: int
    timer_expires_ms: int
    inode: int
    uid: int
    cookie: int
    send_queue_bytes: int
    wmem_queued: int
    sndbuf: int
    tcp_info: TcpInfo

    @property
    def notsent_bytes(self) -> int:
        return self.tcp_info.notsent_bytes

    @property
    def unacked_bytes(self) -> int:
        """snd_nxt - snd_una: sent and not acknowledged (Send-Q minus the not-sent part).

        Not bytes_sent - bytes_acked: bytes_sent counts retransmissions too, and an active
        opener's bytes_acked counts its SYN, so that difference drifts. The two queue values are
        read a moment apart by the kernel, hence the clamp.
        """
        return max(0, self.send_queue_bytes - self.tcp_info.notsent_bytes)


def _optional(layout: struct.Struct, raw: bytes, offset: int) -> int | None:
    if len(raw) < offset + layout.size:
        return None
    value: int = layout.unpack_from(raw, offset)[0]
    return value


def _required(layout: struct.Struct, raw: bytes, offset: int) -> int:
    value: int = layout.unpack_from(raw, offset)[0]
    return value


def _peer_wscale(raw: bytes) -> int:
    """tcpi_snd_wscale (the low nibble of its byte), 0 without window scaling."""
    if not _required(_U8, raw, _TCPI_OPTIONS) & _TCPI_OPT_WSCALE:
        return 0
    return _required(_U8, raw, _TCPI_WSCALE) & 0x0F


def parse_tcp_info(raw: bytes) -> TcpInfo:
    """Parses the payload of INET_DIAG_INFO for TCP (struct tcp_info, host byte order)."""
    if len(raw) < TCP_INFO_MIN_BYTES:
        raise PrivilegeError(
            f"the kernel's struct tcp_info is {len(raw)} bytes, kvwatch needs at least "
            f"{TCP_INFO_MIN_BYTES} (tcpi_notsent_bytes)",
            hint="run kvwatch on Linux 4.6 or newer",
        )
    return TcpInfo(
        probes=_required(_U8, raw, _TCPI_PROBES),
        backoff=_required(_U8, raw, _TCPI_BACKOFF),
        peer_wscale=_peer_wscale(raw),
        rto_us=_required(_U32, raw, _TCPI_RTO),
        last_data_sent_ms=_required(_U32, raw, _TCPI_LAST_DATA_SENT),
        last_ack_recv_ms=_required(_U32, raw, _TCPI_LAST_ACK_RECV),
        snd_mss=_required(_U32, raw, _TCPI_SND_MSS),
        unacked_segments=_required(_U32, raw, _TCPI_UNACKED),
        rtt_us=_required(_U32, raw, _TCPI_RTT),
        snd_cwnd=_required(_U32, raw, _TCPI_SND_CWND),
        total_retrans=_required(_U32, raw, _TCPI_TOTAL_RETRANS),
        bytes_acked=_required(_U64, raw, _TCPI_BYTES_ACKED),
        notsent_bytes=_required(_U32, raw, _TCPI_NOTSENT_BYTES),
        bytes_sent=_optional(_U64, raw, _TCPI_BYTES_SENT),
        snd_wnd=_optional(_U32, raw, _TCPI_SND_WND),
    )


def parse_sk_meminfo(raw: bytes) -> tuple[int, int]:
    """(wmem_queued, sndbuf) from the u32 array of INET_DIAG_SKMEMINFO."""
    count = len(raw) // 4
    if count <= _SK_MEMINFO_WMEM_QUEUED:
        raise KvwatchError(
            f"INET_DIAG_SKMEMINFO has {count} values, expected at least 6",
            hint="report this with the output of `uname -r`",
        )
    values = struct.unpack_from(f"={count}I", raw)
    return values[_SK_MEMINFO_WMEM_QUEUED], values[_SK_MEMINFO_SNDBUF]


def parse_attributes(raw: bytes) -> dict[int, bytes]:
    """Netlink attributes (struct rtattr, 4-byte aligned) as type -> payload; first one wins."""
    attributes: dict[int, bytes] = {}
    offset = 0
    while offset + _RTATTR.size <= len(raw):
        length, kind = _RTATTR.unpack_from(raw, offset)
        if length < _RTATTR.size or offset + length > len(raw):
            break
        attributes.setdefault(kind & _NLA_TYPE_MASK, raw[offset + _RTATTR.size : offset + length])
        offset += (length + 3) & ~3
    return attributes


def split_messages(datagram: bytes) -> list[bytes]:
    """The netlink messages of one datagram, each with its header, as its length says; a
    message cut short (its length past the datagram's end, or below a header) ends it."""
    messages: list[bytes] = []
    offset = 0
    while offset + NLMSG_HEADER_BYTES <= len(datagram):
        length = _NLMSG_HEADER.unpack_from(datagram, offset)[0]
        if length < NLMSG_HEADER_BYTES or offset + length > len(datagram):
            break
        messages.append(datagram[offset : offset + length])
        offset += (length + 3) & ~3
    return messages


def nlmsg_header(length: int, message_type: int, flags: int, sequence: int) -> bytes:
    """A netlink header for a message of `length` bytes (header included), to the kernel."""
    return _NLMSG_HEADER.pack(length, message_type, flags, sequence, 0)


def nlmsg_sequence(message: bytes) -> int:
    sequence: int = _NLMSG_HEADER.unpack_from(message)[3]
    return sequence


def nlmsg_type(message: bytes) -> int:
    kind: int = _NLMSG_HEADER.unpack_from(message)[1]
    return kind


def nlmsg_errno(message: bytes) -> int:
    """The positive errno carried by an NLMSG_ERROR message; 0 is a plain acknowledgement."""
    code: int = _NLMSG_ERRNO.unpack_from(message, NLMSG_HEADER_BYTES)[0]
    return -code


def cookie_from_halves(low: int, high: int) -> int:
    """The socket cookie from idiag_cookie[0] (low 32 bits) and idiag_cookie[1] (high)."""
    return low | (high << 32)


def cookie_halves(cookie: int) -> tuple[int, int]:
    """(idiag_cookie[0], idiag_cookie[1]) for a socket cookie."""
    return cookie & 0xFFFFFFFF, cookie >> 32


def parse_inet_diag_msg(message: bytes) -> DiagEntry | None:
    """Parses one SOCK_DIAG_BY_FAMILY reply (netlink header included) for a TCP socket.

    Needs the INET_DIAG_INFO and INET_DIAG_SKMEMINFO attributes (`DIAG_EXTENSIONS`). The kernel
    sends them for every full socket; a reply without them is a minisocket (an orphaned
    FIN_WAIT2 or TIME_WAIT socket, which the kernel reports by its substate), which holds no
    data to send: None.
    """
    body = message[NLMSG_HEADER_BYTES:]
    (family, state, timer, _retrans, sport, dport, src, dst, _if, cookie_low, cookie_high,
     expires, _rqueue, wqueue, uid, inode) = _INET_DIAG_MSG.unpack_from(body)  # fmt: skip
    attributes = parse_attributes(body[_INET_DIAG_MSG.size :])
    info, meminfo = attributes.get(INET_DIAG_INFO), attributes.get(INET_DIAG_SKMEMINFO)
    if info is None or meminfo is None:
        return None
    wmem_queued, sndbuf = parse_sk_meminfo(meminfo)
    return DiagEntry(
        family=family,
        local=Endpoint.from_packed(family, src, int.from_bytes(sport, "big")),
        remote=Endpoint.from_packed(family, dst, int.from_bytes(dport, "big")),
        tcp_state=state,
        timer=timer,
        timer_expires_ms=expires,
        inode=inode,
        uid=uid,
        cookie=cookie_from_halves(cookie_low, cookie_high),
        send_queue_bytes=wqueue,
        wmem_queued=wmem_queued,
        sndbuf=sndbuf,
        tcp_info=parse_tcp_info(info),
    )


def address_words(family: int, ip: str) -> tuple[int, int, int, int]:
    """idiag_src/idiag_dst as four big-endian u32 words (IPv4 in the first one)."""
    words: tuple[int, int, int, int] = struct.unpack(
        ">4I", socket.inet_pton(family, ip).ljust(16, b"\0")
    )
    return words

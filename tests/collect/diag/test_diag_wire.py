"""kvwatch.collect.diag.wire against the kernel's bytes and pyroute2's independent decoder."""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from pyroute2 import DiagSocket

from kvwatch.collect.diag.wire import (
    DIAG_EXTENSIONS,
    INET_DIAG_INFO,
    INET_DIAG_MSG_BYTES,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSG_HEADER_BYTES,
    SOCK_DIAG_BY_FAMILY,
    TCP_INFO_MIN_BYTES,
    cookie_from_halves,
    nlmsg_errno,
    nlmsg_type,
    parse_attributes,
    parse_inet_diag_msg,
    parse_sk_meminfo,
    parse_tcp_info,
    split_messages,
)
from kvwatch.errors import KvwatchError, PrivilegeError
from kvwatch.sockets import Endpoint

from .conftest import PairFactory, TcpPair


@pytest.fixture
def decoded_reply(tcp_pair: PairFactory) -> Iterator[tuple[TcpPair, Any, bytes]]:
    """The server side of a stuffed connection as pyroute2 decodes it, with its raw bytes."""
    pair = tcp_pair(client_rcvbuf=4096)
    pair.fill()
    with DiagSocket() as netlink:
        netlink.bind()
        (reply,) = netlink.get_sock_stats(
            family=socket.AF_INET, states=1 << 1, extensions=DIAG_EXTENSIONS, sport=pair.port
        )
        yield pair, reply, bytes(reply.data[reply.offset : reply.offset + reply.length])


def test_parse_matches_pyroute2_decoder(decoded_reply: tuple[TcpPair, Any, bytes]) -> None:
    pair, reply, raw = decoded_reply
    entry = parse_inet_diag_msg(raw)
    assert entry is not None
    decoded = reply.get_attr("INET_DIAG_INFO")
    assert entry.local == Endpoint("127.0.0.1", pair.port)
    assert (entry.inode, entry.uid, entry.tcp_state) == (reply["idiag_inode"], 0, 1)
    assert entry.send_queue_bytes == reply["idiag_wqueue"]
    assert entry.cookie == pair.server_cookie
    info = entry.tcp_info
    for ours, theirs in [
        (info.probes, "tcpi_probes"),
        (info.backoff, "tcpi_backoff"),
        (info.snd_mss, "tcpi_snd_mss"),
        (info.unacked_segments, "tcpi_unacked"),
        (info.rtt_us, "tcpi_rtt"),
        (info.snd_cwnd, "tcpi_snd_cwnd"),
        (info.total_retrans, "tcpi_total_retrans"),
        (info.bytes_acked, "tcpi_bytes_acked"),
        (info.notsent_bytes, "tcpi_notsent_bytes"),
        (info.bytes_sent, "tcpi_bytes_sent"),
        (info.snd_wnd, "tcpi_snd_wnd"),
    ]:
        assert ours == decoded[theirs], theirs
    assert info.notsent_bytes > 0
    assert entry.wmem_queued > 0 and entry.sndbuf > 0


def test_older_kernels_leave_late_fields_unknown(
    decoded_reply: tuple[TcpPair, Any, bytes],
) -> None:
    attributes = parse_attributes(decoded_reply[2][NLMSG_HEADER_BYTES + INET_DIAG_MSG_BYTES :])
    raw = attributes[INET_DIAG_INFO]
    assert len(raw) >= 232  # this kernel sends tcpi_snd_wnd
    full = parse_tcp_info(raw)
    assert full.snd_wnd is not None
    before_5_4 = parse_tcp_info(raw[:228])
    assert before_5_4.snd_wnd is None
    assert before_5_4.bytes_sent == full.bytes_sent
    before_4_19 = parse_tcp_info(raw[:200])
    assert before_4_19.bytes_sent is None
    assert before_4_19.notsent_bytes == full.notsent_bytes
    with pytest.raises(PrivilegeError, match=r"Linux 4\.6"):
        parse_tcp_info(raw[: TCP_INFO_MIN_BYTES - 1])


def test_a_reply_without_tcp_info_is_a_minisocket(
    decoded_reply: tuple[TcpPair, Any, bytes],
) -> None:
    raw = decoded_reply[2]
    header_and_msg = NLMSG_HEADER_BYTES + INET_DIAG_MSG_BYTES
    assert parse_inet_diag_msg(raw[:header_and_msg]) is None


def test_sk_meminfo_indexes() -> None:
    values = struct.pack("=9I", 0, 131072, 0, 4194304, 1792, 3938560, 0, 0, 0)
    assert parse_sk_meminfo(values) == (3938560, 4194304)
    with pytest.raises(KvwatchError):
        parse_sk_meminfo(values[:20])


def test_attributes_skip_padding_and_strip_flags() -> None:
    first = struct.pack("=HH", 5, 8) + b"\x01" + b"\0\0\0"  # 1-byte payload, padded to 8
    nested_flag = struct.pack("=HH", 8, 0x8000 | 7) + b"abcd"
    truncated = struct.pack("=HH", 64, 2)
    parsed = parse_attributes(first + nested_flag + truncated)
    assert parsed == {8: b"\x01", 7: b"abcd"}


def test_netlink_error_messages() -> None:
    header = struct.pack("=IHHII", 36, NLMSG_ERROR, 0, 1, 0)
    assert nlmsg_type(header + struct.pack("=i", -2)) == NLMSG_ERROR
    assert nlmsg_errno(header + struct.pack("=i", -2)) == errno.ENOENT
    assert nlmsg_errno(header + struct.pack("=i", 0)) == 0


def test_cookie_halves() -> None:
    assert cookie_from_halves(0x89ABCDEF, 0x01234567) == 0x0123456789ABCDEF


def test_a_datagram_splits_into_its_messages_and_a_cut_one_ends_it() -> None:
    """Messages back to back, each padded to 4 bytes; a header whose length runs past the
    datagram (or is shorter than a header) ends the split instead of reading beyond."""
    header = struct.Struct("=IHHII")
    first = header.pack(16 + 3, SOCK_DIAG_BY_FAMILY, 2, 7, 0) + b"abc"
    second = header.pack(16, NLMSG_DONE, 2, 7, 0)
    datagram = first + b"\0" + second
    assert split_messages(datagram) == [first, second]
    assert [nlmsg_type(m) for m in split_messages(datagram)] == [SOCK_DIAG_BY_FAMILY, NLMSG_DONE]
    assert split_messages(first + b"\0" + header.pack(64, NLMSG_DONE, 2, 7, 0)) == [first]
    assert split_messages(header.pack(8, NLMSG_DONE, 2, 7, 0)) == []

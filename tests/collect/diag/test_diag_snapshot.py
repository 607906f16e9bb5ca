"""sock_diag snapshots of real loopback connections."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time

import pytest

from kvwatch.collect.diag import DiagClient, DiagTracker, take_snapshot
from kvwatch.errors import KvwatchError
from kvwatch.sockets import Endpoint

from .conftest import SMALL_RCVBUF_BYTES, SO_COOKIE, PairFactory, find_entry, wait_for_entry

TCP_CLOSE_WAIT = 8


def _this_comm() -> str:
    with open("/proc/self/comm", encoding="utf-8") as file:
        return file.read().strip()


def test_stalled_reader_shows_zero_window(tcp_pair: PairFactory, diag_client: DiagClient) -> None:
    pair = tcp_pair(client_rcvbuf=SMALL_RCVBUF_BYTES)
    written = pair.fill()
    started = time.monotonic()
    entry = wait_for_entry(diag_client, pair, lambda e: e.tcp_info.snd_wnd == 0)
    assert time.monotonic() - started < 1.0
    assert entry.family == socket.AF_INET
    assert entry.local == pair.server_local == Endpoint("127.0.0.1", pair.port)
    assert entry.remote == pair.server_remote
    assert entry.inode == os.fstat(pair.server.fileno()).st_ino
    assert entry.uid == os.getuid()
    assert entry.cookie == pair.server_cookie

    (sample,) = DiagTracker().update(diag_client.snapshot(local_ports=[pair.port]))
    assert sample.key == pair.server_cookie and sample.source == "inet_diag"
    assert (sample.local, sample.remote) == (entry.local, entry.remote)
    assert (sample.pid, sample.comm) == (os.getpid(), _this_comm())
    assert sample.netns == os.stat("/proc/self/ns/net").st_ino
    assert sample.peer_rwnd == 0 and sample.zero_window
    assert sample.wmem_queued > 0 and sample.sndbuf > 0
    assert 0 < sample.pending_bytes <= written
    assert sample.srtt_us > 0 and sample.snd_cwnd > 0


def test_idle_connection_has_nothing_pending(
    tcp_pair: PairFactory, diag_client: DiagClient
) -> None:
    pair = tcp_pair(client_rcvbuf=SMALL_RCVBUF_BYTES)
    pair.server.sendall(b"hello")  # fits the receive buffer; acknowledged, never read
    entry = wait_for_entry(diag_client, pair, lambda e: e.tcp_info.bytes_acked >= 5)
    assert entry.notsent_bytes == entry.unacked_bytes == 0
    assert entry.tcp_info.snd_wnd is not None and entry.tcp_info.snd_wnd > 0


def test_ipv6_loopback(tcp_pair: PairFactory, diag_client: DiagClient) -> None:
    pair = tcp_pair(listen_host="::1", client_rcvbuf=SMALL_RCVBUF_BYTES)
    pair.fill()
    entry = wait_for_entry(diag_client, pair, lambda e: e.tcp_info.snd_wnd == 0)
    assert entry.family == socket.AF_INET6
    assert entry.local == Endpoint("::1", pair.port)
    assert str(entry.local) == f"[::1]:{pair.port}"


def test_ipv4_mapped_socket_shows_ipv4(tcp_pair: PairFactory, diag_client: DiagClient) -> None:
    pair = tcp_pair(listen_host="::", connect_host="127.0.0.1")
    entry = find_entry(diag_client, pair)
    assert entry is not None
    assert entry.family == socket.AF_INET6
    assert entry.local == Endpoint("127.0.0.1", pair.port)


def test_orphaned_fin_wait2_minisocket_is_skipped(
    tcp_pair: PairFactory, diag_client: DiagClient
) -> None:
    pair = tcp_pair()
    client_cookie = struct.unpack("=Q", pair.client.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8))[0]
    pair.client.close()  # orphaned; once its FIN is acked the kernel keeps a FIN_WAIT2 minisocket
    server = wait_for_entry(diag_client, pair, lambda e: e.tcp_state == TCP_CLOSE_WAIT)
    assert server.notsent_bytes == server.unacked_bytes == 0
    # The server's ACK of the FIN turns the client into a minisocket a moment after CLOSE_WAIT.
    deadline = time.monotonic() + 1.0
    while client_cookie in {e.cookie for e in diag_client.snapshot().entries}:
        assert time.monotonic() < deadline, "the orphaned client was still a full socket after 1 s"
        time.sleep(0.02)


def test_port_filter(tcp_pair: PairFactory, diag_client: DiagClient) -> None:
    first, second = tcp_pair(), tcp_pair()

    def cookies(ports: list[int]) -> set[int]:
        return {entry.cookie for entry in diag_client.snapshot(local_ports=ports).entries}

    assert cookies([first.port]) == {first.server_cookie}
    assert cookies([first.port, second.port]) == {first.server_cookie, second.server_cookie}
    assert {first.server_cookie, second.server_cookie} <= cookies([])


def test_snapshot_refuses_a_running_event_loop(tcp_pair: PairFactory) -> None:
    pair = tcp_pair()

    async def inside_loop() -> None:
        with pytest.raises(KvwatchError, match="asyncio"):
            take_snapshot([pair.port])
        snapshot = await asyncio.to_thread(take_snapshot, [pair.port])
        assert len(snapshot.entries) == 1

    asyncio.run(inside_loop())

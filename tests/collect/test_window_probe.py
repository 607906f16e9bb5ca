"""Keepalive probes ask a held stream's reader for its window (kvwatch.collect.window_probe):
a reader that drains less than half its window sends the server no window update, so the
server's view stays stale until data flows — unless the server's socket probes it. The socket
is borrowed from its owner (here a child process) with pidfd_getfd, set and given back."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvwatch.collect.diag.wire import parse_tcp_info
from kvwatch.collect.procfs import Procfs
from kvwatch.collect.window_probe import (
    PROBING,
    SocketGoneError,
    WindowProbes,
    borrowed_socket,
    read_keepalive,
)
from kvwatch.lab.waiting import wait_for

CHUNK = b"x" * 1024
TCP_INFO_BYTES = 512


@contextmanager
def held_by_child(server: socket.socket) -> Iterator[int]:
    """A child process that holds `server` (and nothing else of ours) until the block ends."""
    ready_read, ready_write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: hold the socket, then _exit
        os.close(ready_read)
        os.write(ready_write, b"1")
        time.sleep(60)
        os._exit(0)
    os.close(ready_write)
    os.read(ready_read, 1)
    os.close(ready_read)
    try:
        yield child
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


@contextmanager
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    try:
        yield server, client
    finally:
        server.close()
        client.close()


def peer_window(server: socket.socket) -> int:
    info = parse_tcp_info(server.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES))
    assert info.snd_wnd is not None, "this kernel reports no tcpi_snd_wnd"
    return info.snd_wnd


def test_probing_turns_keepalive_on_and_gives_the_owners_settings_back() -> None:
    probes = WindowProbes(Procfs())
    with connection() as (server, _), held_by_child(server) as pid:
        inode = os.fstat(server.fileno()).st_ino
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 600)  # the owner's own
        before = read_keepalive(server)
        probes.start(7, pid, inode)
        assert 7 in probes and read_keepalive(server) == PROBING
        probes.stop(7)
        assert 7 not in probes and read_keepalive(server) == before


def test_a_reader_that_drains_a_little_is_seen_only_with_probes() -> None:
    probes = WindowProbes(Procfs())
    with connection() as (server, client), held_by_child(server) as pid:
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        largest = peer_window(server)
        for _ in range(16):  # 16 KB unread: well under half the window
            server.sendall(CHUNK)
        shrunk = wait_for(
            lambda: (window := peer_window(server)) < largest and window, 5, "the window shrink"
        )
        client.setblocking(False)
        drained = 0
        while drained < 16 * len(CHUNK):
            drained += len(client.recv(1 << 20))
        time.sleep(1.5)  # deliberate: room for a window update, were one sent
        assert peer_window(server) == shrunk, "Linux sent an update after a small drain"
        probes.start(1, pid, os.fstat(server.fileno()).st_ino)
        reopened = wait_for(
            lambda: (window := peer_window(server)) > shrunk and window, 5, "a probe's answer"
        )
        assert reopened >= largest - 2 * len(CHUNK)
        probes.stop(1)


def test_a_gone_process_or_socket_is_said_so() -> None:
    probes = WindowProbes(Procfs())
    with (
        connection() as (server, _),
        held_by_child(server) as pid,
        pytest.raises(SocketGoneError),
    ):
        probes.start(1, pid, inode=1)  # no such socket in that process
    with pytest.raises(SocketGoneError), borrowed_socket(pid, 3):
        pass

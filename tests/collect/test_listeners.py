"""kvwatch.collect.listeners: the parser on kernel-shaped text, and the reader on the real
/proc with real sockets (a listener, the connection accepted from it, and the one that
connected to it)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from kvwatch.collect.listeners import ListeningPorts, parse_listening_ports

TEXT = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:07E8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 511
   1: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 512
   2: 0100007F:D7C2 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 513
   3: 0100007F:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 514
"""


def test_the_listening_rows_are_read_up_to_the_first_row_in_another_state() -> None:
    # The kernel writes listening sockets first; a LISTEN row after another is not read.
    assert parse_listening_ports(TEXT.splitlines()) == {2024, 8080}
    assert parse_listening_ports(["", "garbage"]) == set()


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket, socket.socket]]:
    """A listener on an IPv6 wildcard (it takes IPv4 too, and shows only in tcp6), the
    socket it accepted and the one that connected, all in this process."""
    listener = socket.socket(socket.AF_INET6)
    listener.bind(("::", 0))
    listener.listen()
    active = socket.create_connection(("127.0.0.1", listener.getsockname()[1]))
    accepted, _ = listener.accept()
    yield listener, accepted, active
    for sock in (active, accepted, listener):
        sock.close()


def test_an_accepted_socket_holds_a_listening_port_and_a_connecting_one_does_not(
    connection: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listener, accepted, active = connection
    ports = ListeningPorts()
    pid, netns = os.getpid(), os.stat("/proc/self/ns/net").st_ino
    assert not ports.actively_opened(pid, netns, accepted.getsockname()[1])
    assert ports.actively_opened(pid, netns, active.getsockname()[1])
    assert listener.getsockname()[1] in (ports.ports(pid, netns) or ())


def test_a_namespace_is_read_once_per_cache_period_and_an_unknown_process_is_unknown(
    connection: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    cached, fresh = ListeningPorts(cache_seconds=60), ListeningPorts(cache_seconds=0)
    netns = os.stat("/proc/self/ns/net").st_ino
    for _ in range(3):
        cached.ports(os.getpid(), netns)
        fresh.ports(os.getpid(), netns)
    assert (cached.reads, fresh.reads) == (1, 3)
    assert ListeningPorts("/nonexistent").ports(os.getpid(), netns) is None
    assert not ListeningPorts("/nonexistent").actively_opened(os.getpid(), netns, 40000)


def test_a_socket_without_an_owner_is_told_through_the_process_last_read_in_its_namespace(
    connection: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    """An orphaned socket (its process closed it while the kernel drains it: pid 0) is told
    through the process its namespace was last read through, after the cache expired too."""
    listener, _, _ = connection
    ports, netns = ListeningPorts(cache_seconds=0), os.stat("/proc/self/ns/net").st_ino
    assert ports.ports(0, netns) is None  # no process of the namespace known yet
    assert listener.getsockname()[1] in (ports.ports(os.getpid(), netns) or ())
    assert ports.ports(0, netns) == ports.ports(os.getpid(), netns)
    assert ports.reads == 3

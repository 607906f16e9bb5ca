"""kvwatch.tools.sdnotify against real datagram sockets standing in for systemd's notify socket."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwatch.tools.sdnotify import Watchdog, notify


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[tuple[socket.socket, dict[str, str]]]:
    """A bound datagram socket and the environment that points a service at it."""
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    yield sock, {"NOTIFY_SOCKET": str(path)}
    sock.close()


def test_notify_sends_the_state_to_the_socket(
    manager: tuple[socket.socket, dict[str, str]],
) -> None:
    sock, env = manager
    assert notify("READY=1\nSTATUS=watching 4 hooks", env)
    assert sock.recv(4096) == b"READY=1\nSTATUS=watching 4 hooks"


def test_a_manager_that_does_not_read_never_blocks_the_sender(
    manager: tuple[socket.socket, dict[str, str]],
) -> None:
    """The watchdog pings from the agent's event loop: a full queue at the manager drops the
    ping (False) instead of stopping the loop (the agent's /metrics once hung on it)."""
    _, env = manager
    sent = [notify("WATCHDOG=1", env) for _ in range(200)]  # the queue holds a few dozen
    assert sent[0] and not sent[-1]


def test_notify_reaches_an_abstract_socket() -> None:
    name = f"kvwatch-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        assert notify("STOPPING=1", {"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(4096) == b"STOPPING=1"


def test_notify_without_a_manager_is_a_no_op(tmp_path: Path) -> None:
    assert not notify("READY=1", {})
    assert not notify("READY=1", {"NOTIFY_SOCKET": "vsock:2:1234"})
    # The manager went away: reported as not sent, never raised.
    assert not notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "gone")})


def test_watchdog_only_when_asked_for_this_process() -> None:
    assert Watchdog.from_env({}) is None
    assert Watchdog.from_env({"WATCHDOG_USEC": "not a number"}) is None
    assert Watchdog.from_env({"WATCHDOG_USEC": "0"}) is None
    other = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Watchdog.from_env(other) is None
    ours = Watchdog.from_env({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())})
    assert ours is not None and ours.interval_seconds == 15.0


def test_watchdog_pings_at_half_the_timeout(manager: tuple[socket.socket, dict[str, str]]) -> None:
    sock, env = manager
    watchdog = Watchdog.from_env({**env, "WATCHDOG_USEC": "100000"})  # 0.1 s: ping every 0.05
    assert watchdog is not None and watchdog.interval_seconds == 0.05

    async def run_for(seconds: float) -> None:
        task = asyncio.create_task(watchdog.run())
        await asyncio.sleep(seconds)  # deliberate: the pings of this much time are counted
        task.cancel()

    asyncio.run(run_for(0.32))
    assert 3 <= watchdog.pings <= 8  # 7 on an idle machine; never faster than asked
    assert [sock.recv(64) for _ in range(watchdog.pings)] == [b"WATCHDOG=1"] * watchdog.pings

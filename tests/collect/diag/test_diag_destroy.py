"""SOCK_DESTROY on real loopback connections."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvwatch.collect.diag import DestroyResult, DiagClient, destroy_socket
from kvwatch.lab.waiting import wait_until

from .conftest import SMALL_RCVBUF_BYTES, PairFactory, TcpPair, wait_for_entry

CAP_NET_ADMIN = 12
PR_CAPBSET_DROP = 24

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="SOCK_DESTROY needs CAP_NET_ADMIN: run the tests as root"
)


def asleep_in_a_system_call(thread: threading.Thread) -> bool:
    """The thread sleeps in the kernel, not on a futex (the GIL, a lock): for the writer
    below, blocked in send()."""
    task = Path(f"/proc/self/task/{thread.native_id}")
    state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    return state == "S" and "futex" not in (task / "wchan").read_text()


def _destroy(pair: TcpPair, cookie: int | None = None) -> DestroyResult:
    return destroy_socket(
        pair.server_local, pair.server_remote, pair.server_cookie if cookie is None else cookie
    )


def test_destroy_wakes_a_blocked_writer_and_resets_the_peer(
    tcp_pair: PairFactory, diag_client: DiagClient
) -> None:
    pair = tcp_pair(client_rcvbuf=SMALL_RCVBUF_BYTES)
    errors: list[OSError] = []

    def write_forever() -> None:
        try:
            while True:
                pair.server.sendall(b"x" * 65536)
        except OSError as exc:
            errors.append(exc)

    writer = threading.Thread(target=write_forever)
    pair.threads.append(writer)
    writer.start()
    wait_for_entry(diag_client, pair, lambda e: e.tcp_info.snd_wnd == 0)
    wait_until(lambda: asleep_in_a_system_call(writer), 2, "the writer blocked in send()")
    assert writer.is_alive() and not errors

    local, remote, cookie = pair.server_local, pair.server_remote, pair.server_cookie
    assert destroy_socket(local, remote, cookie) is DestroyResult.DESTROYED
    writer.join(timeout=2)
    assert not writer.is_alive()
    assert [exc.errno for exc in errors] == [errno.ECONNABORTED]
    with pytest.raises(ConnectionResetError):
        while pair.client.recv(1 << 20):
            pass
    assert destroy_socket(local, remote, cookie) is DestroyResult.NOT_FOUND


def test_wrong_cookie_leaves_the_connection_alone(tcp_pair: PairFactory) -> None:
    pair = tcp_pair()
    assert _destroy(pair, cookie=pair.server_cookie + 1) is DestroyResult.NOT_FOUND
    pair.server.sendall(b"still here")
    assert pair.client.recv(64) == b"still here"


@pytest.mark.parametrize(
    ("listen_host", "connect_host"), [("::1", None), ("::", "127.0.0.1")], ids=["ipv6", "mapped"]
)
def test_destroy_ipv6_and_mapped(
    tcp_pair: PairFactory, listen_host: str, connect_host: str | None
) -> None:
    pair = tcp_pair(listen_host=listen_host, connect_host=connect_host)
    assert _destroy(pair) is DestroyResult.DESTROYED
    with pytest.raises(ConnectionResetError):
        pair.client.recv(64)


_UNPRIVILEGED_DESTROY = """
import sys
from kvwatch.collect.diag import destroy_socket
from kvwatch.errors import PrivilegeError
from kvwatch.sockets import Endpoint
try:
    destroy_socket(Endpoint.parse(sys.argv[1]), Endpoint.parse(sys.argv[2]), int(sys.argv[3]))
except PrivilegeError as exc:
    print(exc.exit_code, exc.hint)
"""


def _drop_cap_net_admin() -> None:
    """Runs in the child before exec: without it in the bounding set, exec drops the capability."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_NET_ADMIN, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_destroy_without_cap_net_admin_is_a_privilege_error(tcp_pair: PairFactory) -> None:
    pair = tcp_pair()
    endpoints = [str(pair.server_local), str(pair.server_remote), str(pair.server_cookie)]
    done = subprocess.run(
        [sys.executable, "-c", _UNPRIVILEGED_DESTROY, *endpoints],
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=_drop_cap_net_admin,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("3 ") and "CAP_NET_ADMIN" in done.stdout
    pair.server.sendall(b"alive")
    assert pair.client.recv(64) == b"alive"

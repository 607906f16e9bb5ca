"""Real stalled TCP connections for tests of the decide and act steps: loopback pairs in this
process whose reader never reads, so the kernel shows the writer's window shut and its send
buffer full, and the records the tests hand the agent agree with what sock_diag reports."""

from __future__ import annotations

import concurrent.futures
import socket
import time

from kvwatch.collect.diag.snapshot import DiagClient, current_netns
from kvwatch.collect.diag.wire import DiagEntry
from kvwatch.sockets import Endpoint, SocketSample

S = 1_000_000_000
READER_BUFFER_BYTES = 4096
WRITER_BUFFER_BYTES = 16384


class StalledConnections:
    """Opens stalled connections and closes them all at the end (a pytest fixture's body)."""

    def __init__(self) -> None:
        self._sockets: list[socket.socket] = []

    @property
    def reader(self) -> socket.socket:
        """The reading end of the newest connection."""
        return self._sockets[-2]

    @property
    def writer(self) -> socket.socket:
        """The writing end of the newest connection (the stalled socket)."""
        return self._sockets[-1]

    def open(self) -> tuple[Endpoint, Endpoint]:
        """A connection whose peer never reads, once the kernel shows its window shut: the
        writer's local and remote endpoints."""
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            reader = socket.socket()
            self._sockets.append(reader)
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, READER_BUFFER_BYTES)
            reader.connect(listener.getsockname())
            writer, _ = listener.accept()
        self._sockets.append(writer)
        writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, WRITER_BUFFER_BYTES)
        writer.setblocking(False)
        local, remote = Endpoint(*writer.getsockname()), Endpoint(*writer.getpeername())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                while True:
                    writer.send(b"x" * 4096)
            except BlockingIOError:
                pass
            entry = kernel_view(local, remote)
            if entry.tcp_info.snd_wnd == 0 and entry.notsent_bytes > 0:
                return local, remote
            time.sleep(0.02)
        raise AssertionError(f"{local} -> {remote}: the window never closed")

    def sample(self, key: int, pid: int, comm: str = "python3") -> SocketSample:
        """A record of a new stalled connection, as BPF would have kept it: window shut and
        no progress for a minute, the peer's newest segment a minute old (the kernel's is
        newer: the check before an action finds the answers to its probes)."""
        local, remote = self.open()
        entry = kernel_view(local, remote)
        now = time.monotonic_ns()
        since = now - 60 * S
        return SocketSample(
            key=key, source="bpf", observed_ns=now, local=local, remote=remote,
            netns=current_netns(), inode=entry.inode, pid=pid, comm=comm, tcp_state=1,
            wmem_queued=entry.wmem_queued, sndbuf=entry.sndbuf,
            notsent_bytes=entry.notsent_bytes, unacked_bytes=entry.unacked_bytes, peer_rwnd=0,
            srtt_us=100, snd_cwnd=10, retransmits=0, zero_window_probes=8,
            zero_window_episodes=1, zero_window_since_ns=since, zero_window_total_ns=0,
            last_zero_window_end_ns=0, sndbuf_full_episodes=1, sndbuf_full_since_ns=since,
            progress_ns=since, first_seen_ns=since - S, bytes_acked=entry.tcp_info.bytes_acked,
            peer_rwnd_max=READER_BUFFER_BYTES, rto_us=200_000, last_ack_ns=since,
        )  # fmt: skip

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()


def kernel_view(local: Endpoint, remote: Endpoint) -> DiagEntry:
    """sock_diag's view of the socket (on a thread of its own: tests call it from inside
    their event loops, where sock_diag calls must not block)."""
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        entry = thread.submit(_find, local, remote).result()
    assert entry is not None, f"no socket {local} -> {remote}"
    return entry


def _find(local: Endpoint, remote: Endpoint) -> DiagEntry | None:
    with DiagClient() as client:
        return client.find(local, remote)

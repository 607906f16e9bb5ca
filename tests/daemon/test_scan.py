"""What a full scan costs (issue 34): with real BPF on loopback, a healthy stream between
tokens is kept from scan to scan and not judged again, while a reader that stopped is
judged at every scan that finds its record moved."""

from __future__ import annotations

import contextlib
import fcntl
import selectors
import socket
import struct
import termios
import threading
from pathlib import Path

import pytest

from kvwatch.collect.bpf.records import SHORTFALL_BYTES
from kvwatch.config.load import load_config
from kvwatch.daemon.daemon import Daemon
from tests.hookserver.conftest import run_async, wait_until

pytestmark = pytest.mark.bpf

HEALTHY_STREAMS = 12
SCANS = 16
CHUNK = b"data: " + b"t" * 1018 + b"\n\n"  # a coalesced write (~1 KB)


def unacknowledged(sock: socket.socket) -> int:
    """Bytes the socket sent that its peer has not acknowledged yet (SIOCOUTQ)."""
    out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    return int(struct.unpack("i", out)[0])


class Readers(threading.Thread):
    """Clients that read everything that arrives, on a thread of their own: a thread that
    reads TCP and writes TCP is what the kernel side pairs as a proxy's relay."""

    def __init__(self, clients: list[socket.socket]) -> None:
        super().__init__(daemon=True)
        self.selector = selectors.DefaultSelector()
        for client in clients:
            self.selector.register(client, selectors.EVENT_READ)
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            for key, _ in self.selector.select(timeout=0.05):
                with contextlib.suppress(BlockingIOError):
                    key.fileobj.recv(65536)  # type: ignore[union-attr]

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        self.selector.close()


async def scans(tmp_path: Path) -> tuple[dict[str, int], list[tuple[bool, bool]]]:
    """SCANS scans of HEALTHY_STREAMS readers that read every chunk and one that stopped
    reading, a chunk written to each before each scan; returns what the scans judged and
    kept, and per scan whether the stopped reader's socket had a new sample and whether its
    window showed its unread bytes (SHORTFALL_BYTES below its largest)."""
    server = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = server.getsockname()[1]
    config = load_config(
        None,
        {},
        {
            "collector.ports": (port,),
            "hook.socket": str(tmp_path / "engine.sock"),
            "audit.path": "",
        },
    )
    daemon = Daemon(config)
    await daemon.start()
    pairs: list[tuple[socket.socket, socket.socket]] = []
    try:
        for _ in range(HEALTHY_STREAMS + 1):
            client = socket.create_connection(("127.0.0.1", port))
            accepted, _ = server.accept()
            client.setblocking(False)
            accepted.setblocking(False)
            pairs.append((accepted, client))
        *healthy, (_, stopped_reader) = pairs
        stopped_port = stopped_reader.getsockname()[1]
        readers = Readers([client for _, client in healthy])
        readers.start()
        before = dict(daemon.scan_samples)
        stopped: list[tuple[bool, bool]] = []
        last = None
        for _ in range(SCANS):
            for writer, _ in pairs:
                writer.send(CHUNK)
            # Every healthy chunk read and acknowledged: those streams are between tokens.
            await wait_until(lambda: all(unacknowledged(writer) == 0 for writer, _ in healthy))
            await daemon.scan()
            sample = next(s for s in daemon.samples() if s.remote.port == stopped_port)
            shows = sample.peer_rwnd + SHORTFALL_BYTES < sample.peer_rwnd_max
            stopped.append((sample is not last, shows))
            last = sample
        readers.stop()
        return {k: daemon.scan_samples[k] - before[k] for k in before}, stopped
    finally:
        for writer, client in pairs:
            writer.close()
            client.close()
        server.close()
        await daemon.close()


def test_a_healthy_stream_between_tokens_is_not_judged_again(tmp_path: Path) -> None:
    """Of the scans' samples most are kept (each healthy stream is judged again when its
    counters are refreshed, every few seconds); the reader that stopped is judged at every
    scan from the one where its window shows what it has not read."""
    found: list[tuple[dict[str, int], list[tuple[bool, bool]]]] = []

    async def scenario() -> None:
        found.append(await scans(tmp_path))

    run_async(scenario(), timeout_seconds=120)
    counts, stopped = found[0]
    assert counts["judged"] + counts["kept"] == SCANS * (HEALTHY_STREAMS + 1)
    assert counts["kept"] >= 0.7 * SCANS * HEALTHY_STREAMS, counts
    shown = [shows for _, shows in stopped]
    assert any(shown), f"the stopped reader's window never showed its backlog: {stopped}"
    assert all(judged for judged, _ in stopped[shown.index(True) :]), stopped

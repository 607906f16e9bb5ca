"""Relay pairing in the kernel: a socket a thread writes to right after reading from another
socket records that socket as its feeder, from two writes in a row on, and a stray read
between writes does not re-pair it. Reads count only once their process has written to a
tracked socket, so the first relayed chunk pairs nothing. The test thread itself is the
relay, over real loopback connections: upstream (relay → engine) and downstream (client →
relay)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from kvwatch.collect.bpf.collector import BpfCollector
from kvwatch.lab.waiting import wait_for
from kvwatch.sockets import Endpoint, SocketSample

pytestmark = pytest.mark.bpf

CHUNK = b"data: token\n\n" * 8


class Link:
    """One loopback connection: `near` is the relay's end, `far` the other side's."""

    def __init__(self, near: socket.socket, far: socket.socket) -> None:
        self.near, self.far = near, far

    def near_view(self) -> tuple[Endpoint, Endpoint]:
        local, remote = self.near.getsockname(), self.near.getpeername()
        return Endpoint(local[0], local[1]), Endpoint(remote[0], remote[1])


def _connected(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    """(the connecting end, the accepted end)"""
    connecting = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    return connecting, accepted


class RelayBench:
    """An engine listener, a proxy listener, and the links between them."""

    def __init__(self, stack: ExitStack) -> None:
        self.stack = stack
        self.engine = self._listener()
        self.proxy = self._listener()

    def _listener(self) -> socket.socket:
        listener = self.stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        return listener

    @property
    def proxy_port(self) -> int:
        return int(self.proxy.getsockname()[1])

    def upstream(self) -> Link:
        """relay (near) → engine (far)"""
        near, far = _connected(self.engine)
        return Link(self.stack.enter_context(near), self.stack.enter_context(far))

    def downstream(self) -> Link:
        """client (far) → relay (near): `near` is the client-facing socket the BPF filter keeps."""
        far, near = _connected(self.proxy)
        return Link(self.stack.enter_context(near), self.stack.enter_context(far))


def relay(upstream: Link, downstream: Link, times: int) -> None:
    """What a proxy does with a streamed response: read a chunk from upstream, write it down."""
    for _ in range(times):
        upstream.far.sendall(CHUNK)
        data = upstream.near.recv(65536)
        downstream.near.sendall(data)
        downstream.far.recv(65536)


@pytest.fixture
def bench() -> Iterator[RelayBench]:
    with ExitStack() as stack:
        yield RelayBench(stack)


def client_facing(collector: BpfCollector, downstream: Link) -> Callable[[], SocketSample | None]:
    local = Endpoint(*downstream.near.getsockname())

    def sample() -> SocketSample | None:
        return next((s for s in collector.samples() if s.local == local), None)

    return sample


def fed_by(collector: BpfCollector, downstream: Link, upstream: Link, feeds: int) -> SocketSample:
    local, remote = upstream.near_view()
    found = client_facing(collector, downstream)

    def paired() -> SocketSample | None:
        sample = found()
        if sample is None or sample.feeder is None:
            return None
        feeder = sample.feeder
        return (
            sample
            if (feeder.local, feeder.remote, feeder.feeds) == (local, remote, feeds)
            else None
        )

    try:
        return wait_for(paired, 2.0, f"the client-facing socket fed by {local} ({feeds} feeds)")
    except AssertionError as exc:
        shown = [(str(s.local), str(s.remote), s.feeder) for s in collector.samples()]
        raise AssertionError(f"{exc}; the table shows {shown}") from None


def test_a_relayed_socket_names_the_upstream_that_feeds_it(
    bench: RelayBench, open_collector: Callable[..., BpfCollector]
) -> None:
    collector = open_collector(ports=(bench.proxy_port,))
    upstream, downstream = bench.upstream(), bench.downstream()

    relay(upstream, downstream, 2)
    first = client_facing(collector, downstream)()
    assert first is not None and first.feeder is None, "a candidate is not yet a pairing"

    relay(upstream, downstream, 4)  # the 3rd write promotes the candidate: 2 feeds, then 4 more
    sample = fed_by(collector, downstream, upstream, feeds=5)
    assert sample.feeder is not None
    assert sample.feeder.remote == Endpoint("127.0.0.1", bench.engine.getsockname()[1])
    assert sample.feeder.misses == 0
    assert sample.feeder.fed_ns >= sample.first_send_ns


def test_a_stray_read_between_writes_does_not_re_pair(
    bench: RelayBench, open_collector: Callable[..., BpfCollector]
) -> None:
    collector = open_collector(ports=(bench.proxy_port,))
    upstream, downstream, other = bench.upstream(), bench.downstream(), bench.upstream()
    relay(upstream, downstream, 4)

    other.far.sendall(b"x")
    other.near.recv(16)
    downstream.near.sendall(b"heartbeat")  # written after a read from `other`
    downstream.far.recv(16)
    relay(upstream, downstream, 2)

    sample = fed_by(collector, downstream, upstream, feeds=5)
    assert sample.feeder is not None and sample.feeder.misses == 1


def test_a_new_upstream_takes_over_after_two_writes_in_a_row(
    bench: RelayBench, open_collector: Callable[..., BpfCollector]
) -> None:
    """Keep-alive on the client side: the next response on the same client connection comes
    from another upstream connection."""
    collector = open_collector(ports=(bench.proxy_port,))
    first, second, downstream = bench.upstream(), bench.upstream(), bench.downstream()
    relay(first, downstream, 4)
    fed_by(collector, downstream, first, feeds=3)

    relay(second, downstream, 3)
    fed_by(collector, downstream, second, feeds=3)

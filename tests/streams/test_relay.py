"""The relay join (kvwatch.streams.relay): a proxy's client socket inherits its upstream's
request only on clear evidence, and says why not otherwise; only a connection the proxy
opened itself feeds one; the engine's own socket behind a proxy defers to the client socket
that carries its data. Real samples and engine streams; the proxy's listening ports come from
a procfs tree (kvwatch.collect.listeners reads it as it reads /proc)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwatch.collect.listeners import ListeningPorts
from kvwatch.hookserver.registry import EngineStream
from kvwatch.sockets import Endpoint, Feeder, SocketSample
from kvwatch.streams.relay import LEDGER_POINTS, MIN_FEEDS, Cancels, FeedLedger, RelayIndex
from tests.streams.test_states import zero_window as stalled_sample

ENGINE = Endpoint("10.0.0.4", 8000)
UPSTREAM = Endpoint("10.0.0.4", 41000)  # the proxy's end of its upstream connection
CLIENT = Endpoint("10.0.7.19", 50123)
PROXY = Endpoint("10.0.0.4", 443)
PROXY_PID = 812
LISTEN_ROW = "{n:4d}: 00000000:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 0 0 {n}"
HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"


def write_net_tcp(root: Path, pid: int, listening: tuple[int, ...]) -> None:
    """/proc/<pid>/net/tcp as the kernel writes it: listening sockets first."""
    rows = [LISTEN_ROW.format(n=n, port=port) for n, port in enumerate(listening)]
    established = f"{len(rows):4d}: 0400000A:A028 0400000A:1F40 01 00000000:00000000 00:0 0 0 9"
    (root / str(pid) / "net").mkdir(parents=True, exist_ok=True)
    (root / str(pid) / "net" / "tcp").write_text("\n".join([HEADER, *rows, established]) + "\n")


@pytest.fixture
def listeners(tmp_path: Path) -> ListeningPorts:
    """The proxy listens on 443; its upstream connections are its own (ports 41000, ...)."""
    write_net_tcp(tmp_path, PROXY_PID, (PROXY.port,))
    return ListeningPorts(str(tmp_path))


class Engines:
    """One engine at ENGINE with the given live streams."""

    def __init__(self, *streams: EngineStream) -> None:
        self.streams = {(s.local, s.remote): s for s in streams}

    def find(self, local: Endpoint, remote: Endpoint) -> EngineStream | None:
        return self.streams.get((local, remote))

    def serves(self, local: Endpoint) -> bool:
        return local == ENGINE


def request(request_id: str, opened_ns: int) -> EngineStream:
    return EngineStream(
        request_id, 42, 42, "ref", "tiny", "cpu", ENGINE, UPSTREAM, 8, 16384, 100, opened_ns
    )


def proxy_socket(
    feeds: int, misses: int, fed_ns: int, client: Endpoint = CLIENT, key: int = 1
) -> SocketSample:
    feeder = Feeder(UPSTREAM, ENGINE, feeds, misses, fed_ns)
    return stalled_sample().with_changes(
        key=key, local=PROXY, remote=client, pid=PROXY_PID, comm="nginx", feeder=feeder
    )


def engine_socket() -> SocketSample:
    """The engine's own socket: the other end of the proxy's upstream connection."""
    return stalled_sample().with_changes(key=9, local=ENGINE, remote=UPSTREAM, pid=42)


def index(
    listeners: ListeningPorts, *samples: SocketSample, ledger: FeedLedger | None = None
) -> RelayIndex:
    return RelayIndex(samples, listeners=listeners, ledger=ledger or FeedLedger())


def test_clear_evidence_joins_the_request_with_its_chain(listeners: ListeningPorts) -> None:
    sample = proxy_socket(feeds=40, misses=1, fed_ns=2_000)
    engine, link = index(listeners, sample).behind(sample, Engines(request("cmpl-1", 1_000)))
    assert engine is not None and engine.request_id == "cmpl-1"
    assert link is not None and link.status == "joined", link
    assert link.chain("cmpl-1") == f"{CLIENT} ⇄ nginx[812] ⇄ engine request cmpl-1"


def test_thin_or_mixed_evidence_is_ambiguous_and_joins_nothing(
    listeners: ListeningPorts,
) -> None:
    engines = Engines(request("cmpl-1", 1_000))
    for feeds, misses in ((MIN_FEEDS - 1, 0), (20, 20)):
        sample = proxy_socket(feeds, misses, fed_ns=2_000)
        engine, link = index(listeners, sample).behind(sample, engines)
        assert engine is None and link is not None and link.status == "ambiguous", link


def test_a_feeder_the_process_accepted_is_no_relay(tmp_path: Path) -> None:
    """A plain server whose thread reads client A and writes client B: B's feeder is the
    server's socket for A, whose local port is the server's listening port."""
    server = Endpoint("10.0.0.4", 8080)
    write_net_tcp(tmp_path, PROXY_PID, (server.port,))
    feeder = Feeder(server, Endpoint("10.0.7.20", 40838), 40, 0, 2_000)
    b = stalled_sample().with_changes(local=server, pid=PROXY_PID, comm="uvicorn", feeder=feeder)
    assert index(ListeningPorts(str(tmp_path)), b).behind(b, Engines()) == (None, None)


def test_a_feeder_whose_process_cannot_be_read_is_no_relay(tmp_path: Path) -> None:
    sample = proxy_socket(feeds=40, misses=0, fed_ns=2_000)  # no /proc/812 under tmp_path
    engines = Engines(request("cmpl-1", 1_000))
    assert index(ListeningPorts(str(tmp_path)), sample).behind(sample, engines) == (None, None)


def test_a_socket_fed_before_the_upstreams_current_request_began_does_not_inherit_it(
    listeners: ListeningPorts,
) -> None:
    """Upstream keep-alive: the connection that fed this client now carries a newer request,
    and has fed the newer request's client since: the request has ended, whatever fed since."""
    first = proxy_socket(feeds=40, misses=0, fed_ns=500)
    second = proxy_socket(feeds=40, misses=0, fed_ns=3_000, client=Endpoint("10.0.7.20", 4000))
    engine, link = index(listeners, first, second).behind(first, Engines(request("cmpl-2", 1_000)))
    assert engine is None and link is not None and link.status == "request_ended", link


def test_stray_feeds_after_the_next_request_began_do_not_join_it(
    listeners: ListeningPorts,
) -> None:
    """haproxy reuses the upstream for the next client, and a thread that just read it for
    that client writes the first client's buffered bytes: one or two feeds after the new
    request began, the first client the newest fed. Its request has ended."""
    ledger = FeedLedger()
    ledger.note(proxy_socket(feeds=40, misses=0, fed_ns=500))  # seen before cmpl-2 began
    stray = proxy_socket(feeds=40 + MIN_FEEDS - 1, misses=0, fed_ns=1_500)
    engine, link = index(listeners, stray, ledger=ledger).behind(
        stray, Engines(request("cmpl-2", 1_000))
    )
    assert engine is None and link is not None and link.status == "request_ended", link
    assert f"{MIN_FEEDS - 1} writes since" in link.detail


def test_a_kept_alive_client_joins_its_next_request_once_fed_enough(
    listeners: ListeningPorts,
) -> None:
    ledger = FeedLedger()
    ledger.note(proxy_socket(feeds=40, misses=0, fed_ns=500))
    fed = proxy_socket(feeds=40 + MIN_FEEDS, misses=0, fed_ns=1_500)
    engine, link = index(listeners, fed, ledger=ledger).behind(
        fed, Engines(request("cmpl-2", 1_000))
    )
    assert engine is not None and engine.request_id == "cmpl-2", link


def test_a_socket_first_seen_after_the_request_began_counts_all_its_feeds(
    listeners: ListeningPorts,
) -> None:
    sample = proxy_socket(feeds=MIN_FEEDS, misses=0, fed_ns=1_500)
    engine, link = index(listeners, sample).behind(sample, Engines(request("cmpl-1", 1_000)))
    assert engine is not None, link


def test_the_upstream_belongs_to_the_client_it_fed_last(listeners: ListeningPorts) -> None:
    earlier = proxy_socket(feeds=40, misses=0, fed_ns=2_000)
    later = proxy_socket(feeds=40, misses=0, fed_ns=3_000, client=Endpoint("10.0.7.20", 4000))
    both, engines = index(listeners, earlier, later), Engines(request("cmpl-1", 1_000))
    assert both.behind(later, engines)[0] is not None
    engine, link = both.behind(earlier, engines)
    assert engine is None and link is not None and link.status == "ambiguous"


def test_no_live_request_is_request_ended_at_a_hooked_engine_else_no_engine(
    listeners: ListeningPorts,
) -> None:
    sample = proxy_socket(feeds=40, misses=0, fed_ns=2_000)
    _, link = index(listeners, sample).behind(sample, Engines())
    assert link is not None and link.status == "request_ended"
    elsewhere = sample.with_changes(
        feeder=Feeder(UPSTREAM, Endpoint("10.0.0.9", 8000), 40, 0, 2_000)
    )
    _, link = index(listeners, elsewhere).behind(elsewhere, Engines())
    assert link is not None and link.status == "no_engine"


def test_a_socket_the_engine_announced_with_no_relay_before_it_is_joined_directly(
    listeners: ListeningPorts,
) -> None:
    direct = request("cmpl-1", 1_000)
    engine, link = index(listeners, engine_socket()).behind(engine_socket(), Engines(direct))
    assert engine == direct and link is None


def test_an_orphaned_socket_carries_no_request_whatever_was_announced_on_it(
    listeners: ListeningPorts,
) -> None:
    """The engine closed the socket (FIN_WAIT1, no process holds it): the kernel drains
    it, and no request or KV is shown behind it, even if the engine never said `close`."""
    orphan = engine_socket().with_changes(tcp_state=4, pid=0, comm="")
    announced = Engines(request("cmpl-1", 1_000))
    assert index(listeners, orphan).behind(orphan, announced) == (None, None)


def test_the_engines_socket_defers_to_the_client_socket_that_carries_its_request(
    listeners: ListeningPorts,
) -> None:
    """Behind a buffering proxy the engine's socket is judged with the proxy's buffers: the
    client socket at the proxy decides. When that client socket is gone (or ambiguous), the
    engine's socket is judged alone again."""
    direct = request("cmpl-1", 1_000)
    client = proxy_socket(feeds=40, misses=0, fed_ns=2_000)
    engine, link = index(listeners, client, engine_socket()).behind(
        engine_socket(), Engines(direct)
    )
    assert engine == direct and link is not None and link.status == "relayed", link
    assert f"{PROXY} ⇄ {CLIENT}" in link.detail
    assert link.chain("cmpl-1") == f"{CLIENT} ⇄ nginx[812] ⇄ engine request cmpl-1"
    thin = proxy_socket(feeds=MIN_FEEDS - 1, misses=0, fed_ns=2_000)
    for others in ((), (thin,)):
        alone = index(listeners, *others, engine_socket()).behind(engine_socket(), Engines(direct))
        assert alone == (direct, None)


def test_the_engines_socket_defers_for_the_rest_of_an_ended_request_but_not_a_newer_one(
    listeners: ListeningPorts,
) -> None:
    """The request finished into the buffers: its client socket decides (and leaves it
    alone). A newer request on the same connection is not that client's."""
    client = proxy_socket(feeds=40, misses=0, fed_ns=500)
    relays = index(listeners, client, engine_socket())
    engine, link = relays.behind(engine_socket(), Engines())
    assert engine is None and link is not None and link.status == "relayed", link
    newer = request("cmpl-2", 1_000)
    assert relays.behind(engine_socket(), Engines(newer)) == (newer, None)


def test_a_request_seen_at_the_proxy_and_the_engine_counts_its_kv_once(
    listeners: ListeningPorts,
) -> None:
    from kvwatch.exporters.streams import by_request
    from kvwatch.streams.states import StallThresholds, StreamState, judge
    from kvwatch.streams.view import StreamView

    policy = StallThresholds(stall_seconds=3.0)
    stream = request("cmpl-1", 1_000)
    at_proxy = proxy_socket(feeds=40, misses=0, fed_ns=2_000)
    at_engine = engine_socket()

    def view(sample: SocketSample, state: StreamState) -> StreamView:
        judgement = judge(sample, sample.observed_ns, policy)
        return StreamView(sample, judgement, state, policy, stream, None, (), sample.observed_ns)

    views = [view(at_engine, StreamState.ZERO_WINDOW), view(at_proxy, StreamState.STALLED)]
    (counted,) = by_request(views)
    assert counted.state is StreamState.STALLED and counted.sample is at_proxy


def test_a_socket_fed_by_a_request_kvwatch_cancelled_says_so(listeners: ListeningPorts) -> None:
    cancels = Cancels()
    cancels.add(request("cmpl-1", 1_000), cancelled_ns=5_000)
    sample = proxy_socket(feeds=40, misses=0, fed_ns=2_000)
    relays = RelayIndex([sample], listeners=listeners, cancels=cancels)
    engine, link = relays.behind(sample, Engines())
    assert engine is None and link is not None and link.status == "request_cancelled"
    earlier = proxy_socket(feeds=40, misses=0, fed_ns=500)  # an earlier request's client
    _, link = RelayIndex([earlier], listeners=listeners, cancels=cancels).behind(earlier, Engines())
    assert link is not None and link.status == "request_ended"


def test_the_ledger_counts_feeds_since_a_time_from_the_counts_it_saw() -> None:
    ledger = FeedLedger()
    for feeds, fed_ns in ((10, 100), (12, 200), (20, 900), (11, 150)):  # the last one is late
        ledger.note(proxy_socket(feeds, 0, fed_ns))
    now = proxy_socket(25, 0, 1_000)
    assert ledger.feeds_since(now, 150) == 15  # 10 by 150 (seen at 100)
    assert ledger.feeds_since(now, 900) == 5
    assert ledger.feeds_since(now, 1_000) == 0
    assert ledger.feeds_since(now, 50) == 25  # nothing seen by then: all of them


def test_the_ledger_starts_over_for_a_new_feeder_or_socket_and_stays_bounded() -> None:
    ledger = FeedLedger()
    ledger.note(proxy_socket(40, 0, 100))
    elsewhere = Feeder(Endpoint("10.0.0.4", 41001), ENGINE, 5, 0, 300)
    repaired = proxy_socket(40, 0, 100).with_changes(feeder=elsewhere)
    assert ledger.feeds_since(repaired, 200) == 5  # the old feeder's counts do not count
    ledger.note(proxy_socket(2, 0, 200))  # the same feeder paired again: its count restarts
    assert ledger.feeds_since(proxy_socket(6, 0, 300), 250) == 4
    reused = proxy_socket(3, 0, 300, client=Endpoint("10.0.7.21", 5000))  # same key
    assert ledger.feeds_since(reused, 200) == 3
    for feeds in range(1, 101):
        ledger.note(proxy_socket(feeds, 0, 1_000 + feeds))
    now = proxy_socket(100, 0, 1_100)
    assert ledger.feeds_since(now, 1_095) == 5
    # Older counts were dropped: a time before the kept ones gets all the feeds, never
    # fewer than the kept counts (all after it), which is more than a join needs.
    assert ledger.feeds_since(now, 1_050) == 100 and LEDGER_POINTS > MIN_FEEDS
    ledger.note_all({2}, [proxy_socket(1, 0, 1, key=2)])
    assert len(ledger) == 1  # socket 1 is gone from the table

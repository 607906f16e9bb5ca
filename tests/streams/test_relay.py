"""The relay join (kvwatch.streams.relay): a proxy's client socket inherits its upstream's
request only on clear evidence, and says why not otherwise."""

from __future__ import annotations

from kvwatch.hookserver.registry import EngineStream
from kvwatch.sockets import Endpoint, Feeder, SocketSample
from kvwatch.streams.relay import MIN_FEEDS, RelayIndex
from tests.streams.test_states import zero_window as stalled_sample

ENGINE = Endpoint("10.0.0.4", 8000)
UPSTREAM = Endpoint("10.0.0.4", 41000)  # the proxy's end of its upstream connection
CLIENT = Endpoint("10.0.7.19", 50123)
PROXY = Endpoint("10.0.0.4", 443)


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


def proxy_socket(feeds: int, misses: int, fed_ns: int, client: Endpoint = CLIENT) -> SocketSample:
    feeder = Feeder(UPSTREAM, ENGINE, feeds, misses, fed_ns)
    return stalled_sample().with_changes(
        local=PROXY, remote=client, pid=812, comm="nginx", feeder=feeder
    )


def test_clear_evidence_joins_the_request_with_its_chain() -> None:
    sample = proxy_socket(feeds=40, misses=1, fed_ns=2_000)
    engine, link = RelayIndex([sample]).behind(sample, Engines(request("cmpl-1", 1_000)))
    assert engine is not None and engine.request_id == "cmpl-1"
    assert link is not None and link.status == "joined"
    assert link.chain(CLIENT, "cmpl-1") == f"{CLIENT} ⇄ nginx[812] ⇄ engine request cmpl-1"


def test_thin_or_mixed_evidence_is_ambiguous_and_joins_nothing() -> None:
    engines = Engines(request("cmpl-1", 1_000))
    for feeds, misses in ((MIN_FEEDS - 1, 0), (20, 20)):
        sample = proxy_socket(feeds, misses, fed_ns=2_000)
        engine, link = RelayIndex([sample]).behind(sample, engines)
        assert engine is None and link is not None and link.status == "ambiguous", link


def test_a_socket_fed_before_the_upstreams_current_request_began_does_not_inherit_it() -> None:
    """Upstream keep-alive: the connection that fed this client now carries a newer request."""
    sample = proxy_socket(feeds=40, misses=0, fed_ns=500)
    engine, link = RelayIndex([sample]).behind(sample, Engines(request("cmpl-2", 1_000)))
    assert engine is None and link is not None and link.status == "request_ended"


def test_the_upstream_belongs_to_the_client_it_fed_last() -> None:
    earlier = proxy_socket(feeds=40, misses=0, fed_ns=2_000)
    later = proxy_socket(feeds=40, misses=0, fed_ns=3_000, client=Endpoint("10.0.7.20", 4000))
    index, engines = RelayIndex([earlier, later]), Engines(request("cmpl-1", 1_000))
    assert index.behind(later, engines)[0] is not None
    engine, link = index.behind(earlier, engines)
    assert engine is None and link is not None and link.status == "ambiguous"


def test_no_live_request_is_request_ended_at_a_hooked_engine_else_no_engine() -> None:
    sample = proxy_socket(feeds=40, misses=0, fed_ns=2_000)
    _, link = RelayIndex([sample]).behind(sample, Engines())
    assert link is not None and link.status == "request_ended"
    elsewhere = sample.with_changes(
        feeder=Feeder(UPSTREAM, Endpoint("10.0.0.9", 8000), 40, 0, 2_000)
    )
    _, link = RelayIndex([elsewhere]).behind(elsewhere, Engines())
    assert link is not None and link.status == "no_engine"


def test_a_socket_the_engine_announced_is_joined_directly() -> None:
    direct = request("cmpl-1", 1_000)
    sample = stalled_sample().with_changes(local=ENGINE, remote=UPSTREAM)
    engine, link = RelayIndex([sample]).behind(sample, Engines(direct))
    assert engine == direct and link is None


def test_a_request_seen_at_the_proxy_and_the_engine_counts_its_kv_once() -> None:
    from kvwatch.exporters.streams import by_request
    from kvwatch.streams.join import StreamView
    from kvwatch.streams.states import StatePolicy, StreamState, judge

    policy = StatePolicy(stall_seconds=3.0)
    stream = request("cmpl-1", 1_000)
    at_proxy = proxy_socket(feeds=40, misses=0, fed_ns=2_000)
    at_engine = stalled_sample().with_changes(local=ENGINE, remote=UPSTREAM)

    def view(sample: SocketSample, state: StreamState) -> StreamView:
        judgement = judge(sample, sample.observed_ns, policy)
        return StreamView(sample, judgement, state, policy, stream, None, (), sample.observed_ns)

    views = [view(at_engine, StreamState.ZERO_WINDOW), view(at_proxy, StreamState.STALLED)]
    (counted,) = by_request(views)
    assert counted.state is StreamState.STALLED and counted.sample is at_proxy


def test_a_socket_fed_by_a_request_kvwatch_cancelled_says_so() -> None:
    from kvwatch.streams.relay import Cancels

    cancels = Cancels()
    cancels.add(request("cmpl-1", 1_000), cancelled_ns=5_000)
    sample = proxy_socket(feeds=40, misses=0, fed_ns=2_000)
    engine, link = RelayIndex([sample], cancels).behind(sample, Engines())
    assert engine is None and link is not None and link.status == "request_cancelled"
    earlier = proxy_socket(feeds=40, misses=0, fed_ns=500)  # an earlier request's client
    _, link = RelayIndex([earlier], cancels).behind(earlier, Engines())
    assert link is not None and link.status == "request_ended"

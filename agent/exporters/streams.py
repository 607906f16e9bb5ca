"""Streams by state, the KV cache they hold, and how long stalls and zero windows last.
No per-stream labels: cardinality stays bounded however many streams there are."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from kvwatch.api.state import AgentState
from kvwatch.exporters.durations import EpisodeDurations
from kvwatch.streams.states import StreamState
from kvwatch.streams.view import StreamView

# Which of a request's sockets names its state in the KV gauges: the one furthest gone.
SEVERITY = (
    StreamState.CLOSED,
    StreamState.CANCELLED,
    StreamState.HEALTHY,
    StreamState.SLOW,
    StreamState.ZERO_WINDOW,
    StreamState.STALLED,
)


def by_request(views: list[StreamView]) -> list[StreamView]:
    """Each engine request once, as its most severe socket shows it: a request behind a
    proxy is seen on the proxy's client socket and on the engine's own socket, and its KV
    must be counted once."""
    chosen: dict[str, StreamView] = {}
    for view in views:
        if view.engine is None:
            continue
        known = chosen.get(view.engine.request_id)
        if known is None or SEVERITY.index(view.state) > SEVERITY.index(known.state):
            chosen[view.engine.request_id] = view
    return list(chosen.values())


def stream_metrics(state: AgentState, durations: EpisodeDurations) -> Iterator[Metric]:
    views = state.stream_views()
    counts: Counter[StreamState] = Counter(view.state for view in views)
    kv_bytes: Counter[StreamState] = Counter()
    estimated: Counter[StreamState] = Counter()
    for view in by_request(views):
        assert view.engine is not None
        kv_bytes[view.state] += view.engine.kv_bytes
        if view.engine.kv_estimated:
            estimated[view.state] += view.engine.kv_bytes
    streams = GaugeMetricFamily(
        "kvwatch_streams", "Tracked TCP streams by state.", labels=["state"]
    )
    held = GaugeMetricFamily(
        "kvwatch_streams_kv_held_bytes",
        "KV cache held by the engine requests behind streams, by stream state, in bytes.",
        labels=["state"],
    )
    held_estimated = GaugeMetricFamily(
        "kvwatch_streams_kv_held_estimated_bytes",
        "The part of kvwatch_streams_kv_held_bytes that engine hooks estimated (from the "
        "model's geometry and tokens) rather than read from a block table, in bytes.",
        labels=["state"],
    )
    for stream_state in StreamState:
        label = [stream_state.value]
        streams.add_metric(label, counts[stream_state])
        held.add_metric(label, kv_bytes[stream_state])
        held_estimated.add_metric(label, estimated[stream_state])
    yield streams
    yield held
    yield held_estimated
    yield GaugeMetricFamily(
        "kvwatch_streams_action_failed",
        "Streams whose action failed on every try in their current stall episode.",
        value=sum(1 for view in views if view.action_failed),
    )
    yield GaugeMetricFamily(
        "kvwatch_streams_parked",
        "Streams whose request is parked: its KV freed, the request and connection kept "
        "until its client reads again.",
        value=sum(1 for view in views if view.engine is not None and view.engine.parked),
    )
    yield GaugeMetricFamily(
        "kvwatch_streams_paused",
        "Streams whose request is paused (not parked): no decode steps while its reader is "
        "behind, its KV kept.",
        value=sum(
            1
            for view in views
            if view.engine is not None and view.engine.paused and not view.engine.parked
        ),
    )
    yield GaugeMetricFamily(
        "kvwatch_streams_unread_bytes",
        "Bytes the readers of engine streams have not read yet (their unread backlog, as the "
        "server's kernel shows it).",
        value=sum(view.backlog.bytes for view in by_request(views) if view.backlog is not None),
    )
    yield GaugeMetricFamily(
        "kvwatch_streams_detached",
        "Streams detached from their generator: the engine's ASGI middleware buffers their "
        "output on the host so the generation can end and free its KV.",
        value=sum(1 for view in views if view.engine is not None and view.engine.detached),
    )
    yield GaugeMetricFamily(
        "kvwatch_streams_stalled_kv_held_bytes",
        "KV cache held by requests whose client stalled, in bytes.",
        value=kv_bytes[StreamState.STALLED],
    )
    yield GaugeMetricFamily(
        "kvwatch_streams_engine_announced",
        "Streams engines announced over the hook and still open.",
        value=len(state.hooks.streams()),
    )
    yield from durations.collect()

"""The hook's Prometheus families (issue #13, item 8): the event counter holds only event
counts; how many connections are open is a gauge of its own."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvwatch.api.state import AgentState
from kvwatch.exporters.agent import agent_metrics
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.hookserver.registry import COUNTER_NAMES
from kvwatch.streams.timeline import Timelines


def test_hook_events_are_a_counter_of_events_only_and_connections_a_gauge() -> None:
    state = cast(
        AgentState,
        SimpleNamespace(
            hooks=HookServer("/nonexistent/engine.sock"),
            timelines=Timelines(10),
            scan_samples={"judged": 0, "kept": 0},
        ),
    )
    families = {family.name: family for family in agent_metrics(state)}
    events = families["kvwatch_hook_events"]
    assert isinstance(events, CounterMetricFamily)
    assert sorted(
        sample.labels["event"] for sample in events.samples if sample.name.endswith("_total")
    ) == sorted(COUNTER_NAMES)
    connections = families["kvwatch_hook_connections"]
    assert isinstance(connections, GaugeMetricFamily)
    assert connections.samples[0].value == 0

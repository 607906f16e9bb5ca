"""The agent itself: its CPU time, memory, and the engines connected over the hook."""

from __future__ import annotations

from collections.abc import Iterator

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvwatch.api.state import AgentState

_process = psutil.Process()


def agent_metrics(state: AgentState) -> Iterator[Metric]:
    cpu = _process.cpu_times()
    yield CounterMetricFamily(
        "kvwatch_agent_cpu_seconds",
        "CPU time the agent used, in seconds.",
        value=cpu.user + cpu.system,
    )
    yield GaugeMetricFamily(
        "kvwatch_agent_resident_memory_bytes",
        "Resident memory of the agent, in bytes.",
        value=_process.memory_info().rss,
    )
    yield GaugeMetricFamily(
        "kvwatch_hook_engines_connected",
        "Engines connected over the hook socket.",
        value=len(state.hooks.engines()),
    )
    yield GaugeMetricFamily(
        "kvwatch_hook_connections",
        "Connections open on the hook socket, engines that said hello or not.",
        value=state.hooks.connection_count(),
    )
    scanned = CounterMetricFamily(
        "kvwatch_agent_scan_samples",
        "Socket samples the agent's full scans took, by outcome: judged (new since the scan "
        "before) or kept (unchanged in every way the judge reads, so not judged again).",
        labels=["outcome"],
    )
    for outcome, count in sorted(state.scan_samples.items()):
        scanned.add_metric([outcome], count)
    yield scanned
    timelines = GaugeMetricFamily(
        "kvwatch_agent_timelines",
        "Stream timelines the agent keeps for explain, live and finished.",
        labels=["state"],
    )
    timelines.add_metric(["live"], state.timelines.live_count())
    timelines.add_metric(["finished"], state.timelines.finished_count())
    yield timelines
    messages = CounterMetricFamily(
        "kvwatch_hook_events",
        "Engine-hook protocol events by kind (messages, drops, refusals, cancels).",
        labels=["event"],
    )
    for name, count in sorted(state.hooks.counters().items()):
        messages.add_metric([name], count)
    yield messages

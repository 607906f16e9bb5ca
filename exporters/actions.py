"""Decisions, actions by outcome, and the KV cache reclaimed by cancels."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvwatch.api.state import AgentState


def action_metrics(state: AgentState) -> Iterator[Metric]:
    decisions = CounterMetricFamily(
        "kvwatch_policy_decisions",
        "Policy decisions on stalled streams, by verdict and reason.",
        labels=["verdict", "reason"],
    )
    for (verdict, reason), count in sorted(state.decisions.items()):
        decisions.add_metric([verdict, reason], count)
    yield decisions
    actions = CounterMetricFamily(
        "kvwatch_actions",
        "Cancels and resets carried out, by reason and result.",
        labels=["action", "reason", "result"],
    )
    tally = state.tally
    for (action, reason, result), count in sorted(tally.outcomes.items()):
        actions.add_metric([action, reason, result], count)
    yield actions
    yield CounterMetricFamily(
        "kvwatch_actions_reclaimed_kv_bytes",
        "KV cache the engines freed on cancel, in bytes.",
        value=tally.reclaimed_kv_bytes,
    )
    yield GaugeMetricFamily(
        "kvwatch_policy_enforcing",
        "1 in enforce mode, 0 in observe mode (decisions only logged).",
        value=1.0 if state.mode == "enforce" else 0.0,
    )

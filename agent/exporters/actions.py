"""Decisions, actions by outcome, the KV cache reclaimed by cancels and freed by parks, the
parked requests that resumed, the holds renewed, and the tokens decoded for nobody."""

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
        "Cancels, resets, pauses, parks, detaches and releases carried out, by reason and result.",
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
    yield CounterMetricFamily(
        "kvwatch_parks_freed_kv_bytes",
        "KV cache the engines freed by parking requests (taken back when they resume), in bytes.",
        value=tally.parked_kv_bytes,
    )
    yield CounterMetricFamily(
        "kvwatch_parks_resumed",
        "Parked requests that resumed: their client read again.",
        value=tally.resumes,
    )
    yield CounterMetricFamily(
        "kvwatch_holds_renewed",
        "Leases of paused or parked requests renewed at their engine.",
        value=tally.renewals,
    )
    yield CounterMetricFamily(
        "kvwatch_hold_renewals_refused",
        "Lease renewals the engine refused: the request was gone or no longer held.",
        value=tally.renewals_failed,
    )
    yield CounterMetricFamily(
        "kvwatch_window_probes",
        "Held streams whose socket was made to probe its reader's window each second "
        "(keepalive), so a reader that drains is seen.",
        value=tally.window_probes,
    )
    yield CounterMetricFamily(
        "kvwatch_tokens_unread_at_end",
        "Tokens engines wrote that their readers had not read when their streams ended: "
        "decoded for nobody (an estimate from each stream's unread backlog).",
        value=state.unread_tokens_at_end,
    )
    yield GaugeMetricFamily(
        "kvwatch_policy_enforcing",
        "1 in enforce mode, 0 in observe mode (decisions only logged).",
        value=1.0 if state.mode == "enforce" else 0.0,
    )

"""kvwatch's Prometheus exporter: one collector per subsystem (streams, actions, bpf, gpu,
agent), each yielding fresh metric families from the agent's read-only state at every scrape."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry

from kvwatch.api.state import AgentState
from kvwatch.exporters.actions import action_metrics
from kvwatch.exporters.agent import agent_metrics
from kvwatch.exporters.bpf import bpf_metrics
from kvwatch.exporters.durations import EpisodeDurations
from kvwatch.exporters.gpu import gpu_metrics
from kvwatch.exporters.registry import build_registry
from kvwatch.exporters.streams import stream_metrics


def agent_registry(state: AgentState, durations: EpisodeDurations) -> CollectorRegistry:
    return build_registry(
        {
            "streams": partial(stream_metrics, state, durations),
            "actions": partial(action_metrics, state),
            "bpf": partial(bpf_metrics, state),
            "gpu": partial(gpu_metrics, state),
            "agent": partial(agent_metrics, state),
        }
    )

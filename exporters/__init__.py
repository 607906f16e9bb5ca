"""kvwatch's Prometheus exporter: one collector per subsystem (streams, actions, bpf, gpu,
agent), each yielding fresh metric families at every scrape."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from kvwatch.exporters.registry import build_registry

if TYPE_CHECKING:
    from kvwatch.daemon.core import Daemon


def agent_registry(daemon: Daemon) -> CollectorRegistry:
    from kvwatch.exporters.actions import action_metrics
    from kvwatch.exporters.agent import agent_metrics
    from kvwatch.exporters.bpf import bpf_metrics
    from kvwatch.exporters.gpu import gpu_metrics
    from kvwatch.exporters.streams import stream_metrics

    return build_registry(
        {
            "streams": partial(stream_metrics, daemon),
            "actions": partial(action_metrics, daemon),
            "bpf": partial(bpf_metrics, daemon),
            "gpu": partial(gpu_metrics, daemon),
            "agent": partial(agent_metrics, daemon),
        }
    )

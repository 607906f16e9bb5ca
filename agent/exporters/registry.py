"""The agent's Prometheus registry: one collector per subsystem, each timed at every scrape.

A collector yields its metric families from fresh state; `kvwatch_exporter_scrape_duration_
seconds` and `kvwatch_exporter_scrape_success` report, per collector, how the current scrape
of it went (docs/contracts.md, "Metrics": the framework exports scrape health, not each collector).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

MetricSource = Callable[[], Iterable[Metric]]


class TimedCollectors(Collector):
    """Runs each named source, keeps what it yielded, and adds the scrape health families.
    A source that raises yields nothing this scrape and reports success 0."""

    def __init__(self, sources: dict[str, MetricSource]) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        duration = GaugeMetricFamily(
            "kvwatch_exporter_scrape_duration_seconds",
            "Time one collector took in this scrape, in seconds.",
            labels=["collector"],
        )
        success = GaugeMetricFamily(
            "kvwatch_exporter_scrape_success",
            "1 if the collector succeeded in this scrape, else 0.",
            labels=["collector"],
        )
        for name, source in self.sources.items():
            start = time.perf_counter()
            try:
                families = list(source())
                ok = 1.0
            except Exception:
                log.exception("metrics collector %s failed", name)
                families, ok = [], 0.0
            duration.add_metric([name], time.perf_counter() - start)
            success.add_metric([name], ok)
            yield from families
        yield duration
        yield success


def build_registry(sources: dict[str, MetricSource]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TimedCollectors(sources))
    return registry

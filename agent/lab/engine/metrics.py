"""Prometheus metrics of the reference engine, named like vLLM's under `kvwatch_engine:`.

So one dashboard charts both: `vllm:num_requests_running` here is
`kvwatch_engine:num_requests_running`, and so on. Each engine has its own registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

PREFIX = "kvwatch_engine:"
_LATENCY_BUCKETS_SECONDS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


@dataclass(frozen=True)
class RequestSnapshot:
    """One live request as the engine thread last published it."""

    request_id: str
    # "waiting", "running", "egress_blocked" (running, its queue full), "paused", "parking"
    # (its KV on its way to host memory) or "parked"
    state: str
    kv_blocks: int
    tokens_out: int


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot, published by the engine thread after every iteration.

    `paused`: requests paused now (no steps; they keep their KV); `parked`: requests parked
    now (their KV in host memory, `parked_host_bytes` in all); `num_pauses`, `num_releases`
    (of paused and of parked requests), `num_parks` and `num_resumes` count since start."""

    running: int
    waiting: int
    egress_blocked: int
    paused: int
    num_pauses: int
    num_releases: int
    parked: int
    parked_host_bytes: int
    num_parks: int
    num_resumes: int
    kv_blocks_used: int
    kv_blocks_total: int
    bytes_per_block: int
    num_preemptions: int
    steps: int
    requests: tuple[RequestSnapshot, ...]

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


class _StatsCollector(Collector):
    """Gauges read from the latest stats snapshot at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        gauges = (
            ("num_requests_running", "Requests in the running batch.", stats.running),
            ("num_requests_waiting", "Requests waiting for admission.", stats.waiting),
            (
                "num_requests_egress_blocked",
                "Running requests not advancing because their client is not reading.",
                stats.egress_blocked,
            ),
            (
                "num_requests_paused",
                "Requests paused: no decode steps while their reader is behind; KV kept.",
                stats.paused,
            ),
            (
                "num_requests_parked",
                "Requests parked: KV freed while their client does not read.",
                stats.parked,
            ),
            (
                "kv_cache_parked_host_bytes",
                "Host-memory bytes holding the KV of parked requests.",
                stats.parked_host_bytes,
            ),
            ("kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.", stats.kv_usage),
            ("kv_cache_blocks_used", "KV-cache blocks owned by requests.", stats.kv_blocks_used),
            ("kv_cache_blocks_total", "KV-cache blocks in the pool.", stats.kv_blocks_total),
            ("kv_cache_block_size_bytes", "Bytes one KV block holds.", stats.bytes_per_block),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, documentation, value=value)
        counters = (
            (
                "num_preemptions",
                "Preemptions: requests whose blocks were freed to be recomputed later.",
                stats.num_preemptions,
            ),
            ("num_pauses", "Pauses: requests that stopped getting steps.", stats.num_pauses),
            (
                "num_releases",
                "Releases: paused or parked requests scheduled again.",
                stats.num_releases,
            ),
            ("num_parks", "Parks: requests whose KV went to host memory.", stats.num_parks),
            ("num_resumes", "Resumes: parked requests that run again.", stats.num_resumes),
        )
        for name, documentation, value in counters:
            yield CounterMetricFamily(PREFIX + name, documentation, value=value)


class EngineMetrics:
    """The engine's registry. Counters and histograms are updated by the engine thread; the
    gauges come from the stats snapshot at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats))
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens admitted.", registry=self.registry
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", registry=self.registry
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason: length, abort (cancelled or client gone), error.",
            ["finished_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Seconds from arrival to the first token."
        )
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Seconds between two tokens of one request."
        )
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds", "Seconds from arrival to finish."
        )

    def _histogram(self, name: str, documentation: str) -> Histogram:
        return Histogram(
            PREFIX + name, documentation, buckets=_LATENCY_BUCKETS_SECONDS, registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

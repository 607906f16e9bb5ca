"""Where `kvwatch top` gets its frames: the daemon's HTTP API, or (--standalone) a socket
collector loaded in this process, as the classic bcc tools do on a node without the agent."""

from __future__ import annotations

import time
from typing import Any, Protocol

from kvwatch.collect.bpf.loader import CollectorSettings
from kvwatch.collect.collectors import MergedCollector, open_collector
from kvwatch.collect.gpu import GpuInventory
from kvwatch.errors import KvwatchError
from kvwatch.streams.states import StallThresholds
from kvwatch.streams.view import socket_json
from kvwatch.tools.client import AgentUnreachableError, get_json, get_text, reading_answer
from kvwatch.top.model import (
    CancelRate,
    Frame,
    GpuMemory,
    Header,
    MetricFacts,
    Row,
    parse_metrics,
    stalled_kv_bytes,
)

REQUEST_TIMEOUT_SECONDS = 2.0


class FrameSource(Protocol):
    def frame(self) -> Frame: ...

    def close(self) -> None: ...


class DaemonSource:
    """Reads /api/v1/streams, /healthz and /metrics of a running agent (kvwatch.tools.client:
    an answer that is not a kvwatch agent's is a KvwatchError naming the URL). Owns the
    cancel-rate history (one per `kvwatch top` run)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.cancel_rate = CancelRate()

    def frame(self) -> Frame:
        try:
            rows: list[Row] = get_json(self.url, "/api/v1/streams", REQUEST_TIMEOUT_SECONDS, list)
            health: dict[str, Any] = get_json(self.url, "/healthz", REQUEST_TIMEOUT_SECONDS, dict)
            metrics_text = get_text(self.url, "/metrics", REQUEST_TIMEOUT_SECONDS)
        except AgentUnreachableError as exc:
            raise KvwatchError(
                f"the kvwatch daemon does not answer: {exc.message}",
                "start it with `kvwatch run`, pass --url, or watch without it: "
                "`kvwatch top --standalone`",
            ) from exc
        with reading_answer(self.url):
            return self._frame(rows, health, parse_metrics(metrics_text))

    def _frame(self, rows: list[Row], health: dict[str, Any], metrics: MetricFacts) -> Frame:
        uptime = float(health.get("uptime_seconds") or 0.0)
        mode = str(health.get("mode", "?"))
        header = Header(
            source=f"daemon {self.url.removeprefix('http://')}",
            mode=mode,
            attach_points=dict(health.get("attach_points") or {}),
            gpus=metrics.gpus,
            stalled_kv_bytes=stalled_kv_bytes(rows),
            cancels_per_minute=self.cancel_rate.update(metrics.cancels_total, uptime),
        )
        return Frame(header, rows)

    def close(self) -> None:
        pass


class StandaloneSource:
    """A collector (BPF, else sock_diag) and NVML in this process; owns both. Nothing is
    joined to engine requests and nothing is ever cancelled: rows have no request or KV."""

    def __init__(
        self,
        settings: CollectorSettings,
        backend: str,
        procfs_root: str,
        thresholds: StallThresholds,
    ) -> None:
        self.opened = open_collector(settings, backend, procfs_root)
        self.thresholds = thresholds
        self.gpus = GpuInventory()

    @property
    def note(self) -> str:
        return self.opened.note

    def _gpu_memory(self) -> tuple[GpuMemory, ...] | None:
        if not self.gpus.available:
            return None
        return tuple(
            GpuMemory(str(d.index), d.memory_used_bytes, d.memory_total_bytes)
            for d in self.gpus.snapshot().devices
        )

    def frame(self) -> Frame:
        samples = self.opened.collector.samples()
        now_ns = time.monotonic_ns()
        rows = []
        for sample in samples:
            row = socket_json(sample, now_ns, self.thresholds)
            row.update(
                request_id=None,
                engine_pid=None,
                kv_blocks=None,
                kv_bytes=None,
                age_seconds=round(sample.seconds_since(sample.first_seen_ns, now_ns), 1),
            )
            rows.append(row)
        collector = self.opened.collector
        points = collector.report.points if isinstance(collector, MergedCollector) else {}
        header = Header(
            source=f"standalone ({self.opened.backend})",
            mode="observe (standalone: nothing acts)",
            attach_points=points,
            gpus=self._gpu_memory(),
            stalled_kv_bytes=stalled_kv_bytes(rows),
            cancels_per_minute=None,
        )
        return Frame(header, rows)

    def close(self) -> None:
        self.opened.collector.close()
        self.gpus.close()

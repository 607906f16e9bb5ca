"""Where `kvwatch top` gets its frames: the daemon's HTTP API, or (--standalone) a socket
collector loaded in this process, as the classic bcc tools do on a node without the agent."""

from __future__ import annotations

import time
from typing import Any, Protocol

import httpx

from kvwatch.collect.bpf.loader import CollectorSettings
from kvwatch.collect.gpu import GpuInventory
from kvwatch.collect.table import MergedCollector, open_collector
from kvwatch.errors import KvwatchError
from kvwatch.streams.states import StatePolicy
from kvwatch.streams.view import socket_json
from kvwatch.top.model import (
    CancelRate,
    Frame,
    GpuMemory,
    Header,
    Row,
    parse_metrics,
    stalled_kv_bytes,
)

REQUEST_TIMEOUT_SECONDS = 2.0


class FrameSource(Protocol):
    def frame(self) -> Frame: ...

    def close(self) -> None: ...


class DaemonSource:
    """Reads /api/v1/streams, /healthz and /metrics of a running agent. Owns its HTTP client
    and the cancel-rate history (one per `kvwatch top` run)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.client = httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_SECONDS)
        self.cancel_rate = CancelRate()

    def _get(self, path: str) -> httpx.Response:
        try:
            response = self.client.get(path)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise KvwatchError(
                f"the kvwatch daemon does not answer at {self.url} ({exc})",
                "start it with `kvwatch run`, pass --url, or watch without it: "
                "`kvwatch top --standalone`",
            ) from exc
        return response

    def frame(self) -> Frame:
        rows: list[Row] = self._get("/api/v1/streams").json()
        health: dict[str, Any] = self._get("/healthz").json()
        metrics = parse_metrics(self._get("/metrics").text)
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
        self.client.close()


class StandaloneSource:
    """A collector (BPF, else sock_diag) and NVML in this process; owns both. Nothing is
    joined to engine requests and nothing is ever cancelled: rows have no request or KV."""

    def __init__(
        self, settings: CollectorSettings, backend: str, procfs_root: str, policy: StatePolicy
    ) -> None:
        self.opened = open_collector(settings, backend, procfs_root)
        self.policy = policy
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
            row = socket_json(sample, now_ns, self.policy)
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

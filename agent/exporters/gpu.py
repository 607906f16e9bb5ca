"""GPU memory per GPU through NVML, labelled like NVIDIA's DCGM exporter so one dashboard can
put kvwatch's series next to DCGM_FI_DEV_FB_USED."""

from __future__ import annotations

import socket
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from kvwatch.api.state import AgentState

DCGM_LABELS = ["gpu", "UUID", "modelName", "Hostname"]


def gpu_metrics(state: AgentState) -> Iterator[Metric]:
    gpus = state.gpus
    yield GaugeMetricFamily(
        "kvwatch_gpu_nvml_available",
        "1 when NVML answers, else 0.",
        value=1.0 if gpus.available else 0.0,
    )
    if not gpus.available:
        return
    used = GaugeMetricFamily(
        "kvwatch_gpu_memory_used_bytes", "GPU memory in use, in bytes.", labels=DCGM_LABELS
    )
    total = GaugeMetricFamily(
        "kvwatch_gpu_memory_total_bytes", "GPU memory, in bytes.", labels=DCGM_LABELS
    )
    host = socket.gethostname()
    for device in gpus.snapshot().devices:
        labels = [str(device.index), device.uuid, device.name, host]
        used.add_metric(labels, device.memory_used_bytes)
        total.add_metric(labels, device.memory_total_bytes)
    yield used
    yield total

"""GPU memory through NVML (pynvml, from the nvidia-ml-py package): per GPU its index, UUID,
name, total and used memory, and the memory each compute process uses on it.

No NVML is a normal state, not an error: the package missing, no driver or no GPU leave the
inventory `available` False with a `reason` that `kvwatch doctor` shows, and every snapshot
empty. Per-process numbers name host pids: in a container the agent needs the host's pid
namespace (hostPID) to match them with socket owners. Where NVML cannot tell a process's
memory (MIG without privileges, some vGPU and Windows drivers) `used_bytes` is None.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

# What nvmlDeviceGetComputeRunningProcesses reports for an unknown amount (older pynvml
# versions pass it through; newer ones turn it into None).
NVML_VALUE_NOT_AVAILABLE = (1 << 64) - 1


class NvmlMemory(Protocol):
    @property
    def total(self) -> int: ...

    @property
    def used(self) -> int: ...


class NvmlProcess(Protocol):
    @property
    def pid(self) -> int: ...

    @property
    def usedGpuMemory(self) -> int | None: ...  # noqa: N802 - NVML's name


class NvmlApi(Protocol):
    """The part of pynvml kvwatch uses; the pynvml module itself satisfies it. Names are
    NVML's (hence the noqa): tests pass a stand-in with the same names."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...  # noqa: N802

    def nvmlShutdown(self) -> None: ...  # noqa: N802

    def nvmlSystemGetDriverVersion(self) -> str | bytes: ...  # noqa: N802

    def nvmlDeviceGetCount(self) -> int: ...  # noqa: N802

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object: ...  # noqa: N802

    def nvmlDeviceGetUUID(self, handle: object) -> str | bytes: ...  # noqa: N802

    def nvmlDeviceGetName(self, handle: object) -> str | bytes: ...  # noqa: N802

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> NvmlMemory: ...  # noqa: N802

    def nvmlDeviceGetComputeRunningProcesses(  # noqa: N802
        self, handle: object
    ) -> Sequence[NvmlProcess]: ...


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on one GPU; `used_bytes` is None where NVML cannot tell."""

    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    processes: tuple[GpuProcess, ...]


class GpuProcessUse(NamedTuple):
    """One GPU a process uses: (gpu_index, uuid, used_bytes)."""

    gpu_index: int
    uuid: str
    used_bytes: int | None


@dataclass(frozen=True)
class GpuSnapshot:
    """The GPUs at `taken_ns` (CLOCK_MONOTONIC). `errors` name the GPUs (or parts) NVML could
    not read; the others are still listed. Empty, with the reason, when NVML is unavailable."""

    available: bool
    reason: str
    driver_version: str
    devices: tuple[GpuDevice, ...]
    errors: tuple[str, ...]
    taken_ns: int

    def process_gpu(self, pid: int) -> list[GpuProcessUse]:
        """The GPUs `pid` runs compute work on, with the memory it uses on each."""
        return [
            GpuProcessUse(device.index, device.uuid, process.used_bytes)
            for device in self.devices
            for process in device.processes
            if process.pid == pid
        ]


def _text(value: str | bytes) -> str:
    """NVML strings: older pynvml versions return bytes."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _used_bytes(process: NvmlProcess) -> int | None:
    used = process.usedGpuMemory
    return None if used is None or used >= NVML_VALUE_NOT_AVAILABLE else int(used)


def _import_pynvml() -> tuple[NvmlApi | None, str]:
    try:
        import pynvml
    except ImportError as exc:
        return None, f"pynvml is not importable ({exc}); install nvidia-ml-py"
    api: NvmlApi = pynvml
    return api, ""


class GpuInventory:
    """Reads GPU memory through NVML. Owns the NVML session: started in the constructor
    (if it can be), ended by `close`. `snapshot` may be called from any thread (NVML is
    thread-safe); the latest snapshot is kept for `process_gpu`.
    """

    def __init__(self, nvml: NvmlApi | None = None) -> None:
        self._nvml, self.reason = (nvml, "") if nvml is not None else _import_pynvml()
        self.available = False
        self.driver_version = ""
        self._latest: GpuSnapshot | None = None
        if self._nvml is not None:
            self._start(self._nvml)

    def _start(self, nvml: NvmlApi) -> None:
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self.reason = (
                f"NVML did not start ({exc}): no NVIDIA driver or GPU on this node, "
                "or libnvidia-ml.so is not visible to the agent"
            )
            return
        self.available = True
        try:
            self.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError:
            self.driver_version = "unknown"

    def snapshot(self) -> GpuSnapshot:
        """Reads every GPU now; one GPU failing leaves the others listed and an error named."""
        taken_ns = time.monotonic_ns()
        nvml = self._nvml
        if not self.available or nvml is None:
            return GpuSnapshot(False, self.reason, "", (), (), taken_ns)
        devices: list[GpuDevice] = []
        errors: list[str] = []
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            count = 0
            errors.append(f"GPU count: {exc}")
        for index in range(count):
            try:
                devices.append(self._device(nvml, index, errors))
            except nvml.NVMLError as exc:
                errors.append(f"GPU {index}: {exc}")
        snapshot = GpuSnapshot(
            True, "", self.driver_version, tuple(devices), tuple(errors), taken_ns
        )
        self._latest = snapshot
        return snapshot

    @staticmethod
    def _device(nvml: NvmlApi, index: int, errors: list[str]) -> GpuDevice:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            found = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            processes = tuple(GpuProcess(int(p.pid), _used_bytes(p)) for p in found)
        except nvml.NVMLError as exc:
            processes = ()
            errors.append(f"GPU {index} processes: {exc}")
        return GpuDevice(
            index=index,
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            name=_text(nvml.nvmlDeviceGetName(handle)),
            memory_total_bytes=int(memory.total),
            memory_used_bytes=int(memory.used),
            processes=processes,
        )

    def process_gpu(self, pid: int) -> list[GpuProcessUse]:
        """The GPUs `pid` uses, per the latest snapshot (one is taken if there is none yet).
        Callers refresh with `snapshot()` at their own pace (each scrape, each second)."""
        latest = self._latest if self._latest is not None else self.snapshot()
        return latest.process_gpu(pid)

    def close(self) -> None:
        if self.available and self._nvml is not None:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
            self.available = False
            self.reason = "closed"

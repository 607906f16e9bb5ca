"""The fake NVML: the one stand-in this project allows, because CI machines have no GPU.

`FakeNvml` answers the functions of `kvwatch.collect.gpu.NvmlApi` from a list of `FakeGpu`s. A GPU's
`failing` set names the functions that raise NVMLError for it, so tests can break one GPU and
see the others survive. On a machine with a GPU, tests/collect/test_gpu.py also reads the real one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest


class FakeNvmlError(Exception):
    """Stands for pynvml.NVMLError; the message is what str() of the real one says."""


@dataclass(frozen=True)
class FakeMemory:
    total: int
    used: int


@dataclass(frozen=True)
class FakeProcess:
    pid: int
    usedGpuMemory: int | None  # noqa: N815 - NVML's name


@dataclass
class FakeGpu:
    uuid: str
    name: str | bytes
    total_bytes: int
    used_bytes: int
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    failing: set[str] = field(default_factory=set)


class FakeNvml:
    """Answers like pynvml for `gpus`; `init_error` makes nvmlInit fail with that message."""

    NVMLError: type[Exception] = FakeNvmlError

    def __init__(self, gpus: list[FakeGpu], init_error: str = "") -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.driver_version: str | bytes = "550.54.15"
        self.failing: set[str] = set()
        self.shutdowns = 0

    def _check(self, function: str, gpu: FakeGpu | None = None) -> None:
        if function in self.failing or (gpu is not None and function in gpu.failing):
            raise FakeNvmlError("GPU is lost")

    def nvmlInit(self) -> None:  # noqa: N802
        if self.init_error:
            raise FakeNvmlError(self.init_error)

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str | bytes:  # noqa: N802
        self._check("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:  # noqa: N802
        self._check("nvmlDeviceGetHandleByIndex", self.gpus[index])
        return self.gpus[index]

    def _gpu(self, handle: object, function: str) -> FakeGpu:
        assert isinstance(handle, FakeGpu)
        self._check(function, handle)
        return handle

    def nvmlDeviceGetUUID(self, handle: object) -> str | bytes:  # noqa: N802
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: object) -> str | bytes:  # noqa: N802
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> FakeMemory:  # noqa: N802
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        return FakeMemory(gpu.total_bytes, gpu.used_bytes)

    def nvmlDeviceGetComputeRunningProcesses(  # noqa: N802
        self, handle: object
    ) -> list[FakeProcess]:
        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [FakeProcess(pid, used) for pid, used in gpu.processes]


GIB = 1 << 30


@pytest.fixture
def two_gpus() -> list[FakeGpu]:
    """An H100 running pids 100 and 200, an A100 running pid 100 with an unknown amount."""
    return [
        FakeGpu(
            uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000",
            name="NVIDIA H100 80GB HBM3",
            total_bytes=80 * GIB,
            used_bytes=30 * GIB,
            processes=[(100, 20 * GIB), (200, 9 * GIB)],
        ),
        FakeGpu(
            uuid="GPU-bbbbbbbb-0000-0000-0000-000000000000",
            name=b"NVIDIA A100-SXM4-40GB",
            total_bytes=40 * GIB,
            used_bytes=5 * GIB,
            processes=[(100, None)],
        ),
    ]


@pytest.fixture
def fake_nvml(two_gpus: list[FakeGpu]) -> Callable[..., FakeNvml]:
    """Builds a FakeNvml over `two_gpus` unless given other GPUs."""

    def build(gpus: list[FakeGpu] | None = None, init_error: str = "") -> FakeNvml:
        return FakeNvml(two_gpus if gpus is None else gpus, init_error)

    return build

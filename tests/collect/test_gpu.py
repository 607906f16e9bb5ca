"""GpuInventory over the fake NVML (tests/collect/conftest.py), and over the real one."""

from __future__ import annotations

from collections.abc import Callable

import pynvml

from kvwatch.collect.gpu import NVML_VALUE_NOT_AVAILABLE, GpuInventory, GpuProcess, NvmlApi
from tests.collect.conftest import GIB, FakeGpu, FakeNvml

FakeFactory = Callable[..., FakeNvml]


def test_snapshot_lists_every_gpu_with_memory_and_processes(fake_nvml: FakeFactory) -> None:
    inventory = GpuInventory(fake_nvml())
    assert inventory.available
    assert inventory.reason == ""
    assert inventory.driver_version == "550.54.15"
    snapshot = inventory.snapshot()
    assert snapshot.available
    assert snapshot.errors == ()
    first, second = snapshot.devices
    assert (first.index, first.uuid, first.name) == (
        0,
        "GPU-aaaaaaaa-0000-0000-0000-000000000000",
        "NVIDIA H100 80GB HBM3",
    )
    assert (first.memory_total_bytes, first.memory_used_bytes) == (80 * GIB, 30 * GIB)
    assert first.processes == (GpuProcess(100, 20 * GIB), GpuProcess(200, 9 * GIB))
    assert second.name == "NVIDIA A100-SXM4-40GB"  # bytes from older pynvml, decoded


def test_unknown_process_memory_is_none_whichever_way_nvml_says_it(
    fake_nvml: FakeFactory,
) -> None:
    gpu = FakeGpu("GPU-c", "T4", 16 * GIB, GIB, [(7, NVML_VALUE_NOT_AVAILABLE), (8, None)])
    snapshot = GpuInventory(fake_nvml([gpu])).snapshot()
    assert snapshot.devices[0].processes == (GpuProcess(7, None), GpuProcess(8, None))


def test_process_gpu_names_every_gpu_a_process_uses(fake_nvml: FakeFactory) -> None:
    inventory = GpuInventory(fake_nvml())
    uses = inventory.process_gpu(100)  # no snapshot yet: takes one
    assert [(u.gpu_index, u.uuid[:12], u.used_bytes) for u in uses] == [
        (0, "GPU-aaaaaaaa", 20 * GIB),
        (1, "GPU-bbbbbbbb", None),
    ]
    assert inventory.process_gpu(200) == [(0, "GPU-aaaaaaaa-0000-0000-0000-000000000000", 9 * GIB)]
    assert inventory.process_gpu(999) == []


def test_process_gpu_reads_the_latest_snapshot(
    fake_nvml: FakeFactory, two_gpus: list[FakeGpu]
) -> None:
    inventory = GpuInventory(fake_nvml())
    inventory.snapshot()
    two_gpus[0].processes.append((300, GIB))
    assert inventory.process_gpu(300) == []
    inventory.snapshot()
    assert [u.used_bytes for u in inventory.process_gpu(300)] == [GIB]


def test_one_failing_gpu_leaves_the_others_listed(
    fake_nvml: FakeFactory, two_gpus: list[FakeGpu]
) -> None:
    two_gpus[0].failing.add("nvmlDeviceGetMemoryInfo")
    snapshot = GpuInventory(fake_nvml()).snapshot()
    assert [device.index for device in snapshot.devices] == [1]
    assert snapshot.errors == ("GPU 0: GPU is lost",)


def test_a_gpu_without_process_accounting_is_listed_without_processes(
    fake_nvml: FakeFactory, two_gpus: list[FakeGpu]
) -> None:
    two_gpus[1].failing.add("nvmlDeviceGetComputeRunningProcesses")
    snapshot = GpuInventory(fake_nvml()).snapshot()
    assert [device.index for device in snapshot.devices] == [0, 1]
    assert snapshot.devices[1].processes == ()
    assert snapshot.devices[1].memory_total_bytes == 40 * GIB
    assert snapshot.errors == ("GPU 1 processes: GPU is lost",)


def test_a_failing_device_count_gives_an_empty_snapshot_with_the_error(
    fake_nvml: FakeFactory,
) -> None:
    nvml = fake_nvml()
    inventory = GpuInventory(nvml)
    nvml.failing.add("nvmlDeviceGetCount")
    snapshot = inventory.snapshot()
    assert snapshot.available
    assert snapshot.devices == ()
    assert snapshot.errors == ("GPU count: GPU is lost",)


def test_nvml_that_does_not_start_is_a_normal_state(fake_nvml: FakeFactory) -> None:
    inventory = GpuInventory(fake_nvml(init_error="Driver Not Loaded"))
    assert not inventory.available
    assert "Driver Not Loaded" in inventory.reason
    snapshot = inventory.snapshot()
    assert (snapshot.available, snapshot.devices, snapshot.errors) == (False, (), ())
    assert snapshot.reason == inventory.reason
    assert inventory.process_gpu(100) == []
    inventory.close()


def test_an_unreadable_driver_version_does_not_stop_the_inventory(
    fake_nvml: FakeFactory,
) -> None:
    nvml = fake_nvml()
    nvml.failing.add("nvmlSystemGetDriverVersion")
    inventory = GpuInventory(nvml)
    assert inventory.available
    assert inventory.driver_version == "unknown"


def test_close_ends_the_nvml_session_once(fake_nvml: FakeFactory) -> None:
    nvml = fake_nvml()
    inventory = GpuInventory(nvml)
    inventory.close()
    inventory.close()
    assert nvml.shutdowns == 1
    assert not inventory.snapshot().available


def test_pynvml_provides_every_function_the_boundary_names() -> None:
    members = [name for name in vars(NvmlApi) if name.startswith("nvml")] + ["NVMLError"]
    assert len(members) == 10
    assert [name for name in members if not hasattr(pynvml, name)] == []
    assert pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value == NVML_VALUE_NOT_AVAILABLE


def test_the_real_nvml_either_answers_or_says_why_not() -> None:
    """No fake: on a GPU machine this reads the real GPUs, elsewhere NVML is absent."""
    inventory = GpuInventory()
    try:
        snapshot = inventory.snapshot()
        if not inventory.available:
            assert inventory.reason
            assert snapshot.devices == ()
            return
        assert snapshot.devices, snapshot.errors
        for device in snapshot.devices:
            assert device.uuid.startswith(("GPU-", "MIG-"))
            assert 0 <= device.memory_used_bytes <= device.memory_total_bytes
            assert device.memory_total_bytes > 0
    finally:
        inventory.close()

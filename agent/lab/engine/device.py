"""Device choice, dtype choice, KV pool sizing, and the fence that marks the end of a step."""

from __future__ import annotations

import torch

from kvwatch.errors import ConfigError
from kvwatch.lab.engine.config import DEFAULT_CPU_KV_BLOCKS, EngineConfig

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(config: EngineConfig) -> torch.device:
    """ "auto" is CUDA when a GPU is visible, else CPU; "cuda" without a GPU is a ConfigError.
    On CPU, sets torch's (process-wide) thread count to `cpu_threads`."""
    choice = config.device
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(
                "--device cuda asked, but torch sees no CUDA GPU",
                "use --device cpu, or install a CUDA build of torch on a machine with a GPU",
            )
        return torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(config.cpu_threads)
    return torch.device("cpu")


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    """ "auto" is bfloat16 on CUDA and float32 on CPU."""
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[choice]


def kv_pool_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int) -> int:
    """`--kv-blocks` when given; else `kv_fraction` of free GPU memory, or the CPU default."""
    if config.kv_blocks is not None:
        return config.kv_blocks
    if device.type != "cuda":
        return DEFAULT_CPU_KV_BLOCKS
    free_bytes, _total_bytes = torch.cuda.mem_get_info(device)
    blocks = int(free_bytes * config.kv_fraction) // bytes_per_block
    if blocks < 1:
        raise ConfigError(
            f"{config.kv_fraction:.0%} of free GPU memory holds no KV block",
            "raise --kv-fraction or free GPU memory",
        )
    return blocks


class DeviceFence:
    """Marks the end of the last model step on the device.

    On CUDA it is an event recorded after each step: `wait` returns once all device work of
    that step (the KV writes and reads of every block it touched) is done. On CPU a step is
    synchronous, so the step boundary itself is the fence and `wait` returns at once.
    Ownership: the engine thread records and waits; nobody else touches it.
    """

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._event = torch.cuda.Event() if cuda else None  # type: ignore[no-untyped-call]

    def record(self) -> None:
        if self._event is not None:
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

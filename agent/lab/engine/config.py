"""Configuration of the reference engine: model presets and engine settings.

Everything here is plain data; validation happens once, in `EngineConfig.validate`, so the rest
of the engine can trust its settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.errors import ConfigError
from kvwatch.hook.asgi_coalesce import DEFAULT_COALESCE_BYTES, DEFAULT_COALESCE_MS, Coalescing

EGRESS_MODES = ("coupled", "decoupled")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
DEFAULT_CPU_KV_BLOCKS = 2048
DEFAULT_SNDBUF_BYTES = 64 * 1024


# Host memory parked KV may take, in KV pools, unless the engine is told otherwise.
PARK_HOST_POOLS = 4


@dataclass(frozen=True)
class ModelShape:
    """The shape of the decoder-only transformer. Weights are random, drawn from the seed."""

    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    max_model_len: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


MODEL_SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(n_layers=2, d_model=128, n_heads=4, d_ff=512, max_model_len=2048),
    "small": ModelShape(n_layers=4, d_model=256, n_heads=8, d_ff=1024, max_model_len=4096),
    "medium": ModelShape(n_layers=8, d_model=512, n_heads=8, d_ff=2048, max_model_len=8192),
}
DEFAULT_MODEL_SIZE = "small"


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance.

    `kv_blocks` fixes the KV pool size; when it is None the pool takes `kv_fraction` of free GPU
    memory on CUDA, or `DEFAULT_CPU_KV_BLOCKS` blocks on CPU. `cpu_threads` is torch's intra-op
    thread count on CPU (process-wide): 1 leaves a core to the HTTP server, and small
    ops run faster on one thread than split across busy cores.

    `pause` lets the kvwatch agent pause a request (no more decode steps; it keeps its KV
    and its place) and release it. `park` lets it park one: its KV goes to host memory and
    its blocks back to the pool, until the agent (or the hook, when the lease runs out)
    releases it; parking needs `pause`, whose release is a parked request's way back.
    Parked KV takes at most `park_host_kv_bytes` of host memory (None: PARK_HOST_POOLS times
    what the KV pool holds: parking exists to let a pool serve more than it holds, and host
    memory is many times a GPU's); a park beyond that is declined.

    `coalesce_bytes` and `coalesce_ms`: the SSE writer gathers a stream's tokens into writes
    of up to `coalesce_bytes`, or what came within `coalesce_ms` of the first unwritten
    token (kvwatch.hook.asgi_coalesce); 0 in either writes each batch of tokens at once.
    """

    model_size: str = DEFAULT_MODEL_SIZE
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    cpu_threads: int = 1
    block_size: int = 16
    kv_blocks: int | None = None
    kv_fraction: float = 0.3
    egress: str = "coupled"
    egress_queue_tokens: int = 4
    max_running: int = 64
    max_waiting: int = 256
    max_tokens_limit: int = 4096
    max_prefill_tokens: int = 2048
    cancel_wait_seconds: float = 10.0
    pause: bool = True
    park: bool = True
    park_host_kv_bytes: int | None = None
    coalesce_bytes: int = DEFAULT_COALESCE_BYTES
    coalesce_ms: int = DEFAULT_COALESCE_MS
    debug_checks: bool = False

    @property
    def shape(self) -> ModelShape:
        return MODEL_SHAPES[self.model_size]

    @property
    def coalescing(self) -> Coalescing:
        return Coalescing(self.coalesce_bytes, self.coalesce_ms)

    @property
    def served_model_name(self) -> str:
        return f"kvwatch-reference-{self.model_size}"

    def validate(self) -> EngineConfig:
        """Returns self, or raises ConfigError naming the bad setting and what to use instead."""
        _check_choice("model size", self.model_size, tuple(MODEL_SHAPES))
        _check_choice("device", self.device, DEVICES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("egress mode", self.egress, EGRESS_MODES)
        _check_positive("CPU threads", self.cpu_threads)
        _check_positive("block size", self.block_size)
        _check_positive("egress queue size", self.egress_queue_tokens)
        _check_positive("max running requests", self.max_running)
        _check_positive("max waiting requests", self.max_waiting)
        _check_positive("max tokens limit", self.max_tokens_limit)
        _check_positive("max prefill tokens", self.max_prefill_tokens)
        if self.kv_blocks is not None:
            _check_positive("KV blocks", self.kv_blocks)
        if self.park_host_kv_bytes is not None:
            _check_positive("host bytes for parked KV", self.park_host_kv_bytes)
        if self.park and not self.pause:
            raise ConfigError(
                "parking needs pausing: a parked request runs again when it is released",
                "add --no-park, or drop --no-pause",
            )
        Coalescing(self.coalesce_bytes, self.coalesce_ms)  # raises ConfigError out of range
        if not 0.0 < self.kv_fraction <= 0.95:
            raise ConfigError(
                f"KV fraction {self.kv_fraction} is out of range",
                "use a value in (0, 0.95], for example 0.3",
            )
        return self


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {what} {value!r}", f"use one of: {', '.join(choices)}")


def _check_positive(what: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {value}", f"give {what} a value >= 1")

"""The middleware's KV estimates: vLLM's geometry from a configuration shaped like vLLM's
(`VllmConfig` with `ModelConfig`/`CacheConfig`), the configured fallback, block rounding, and
none for a request that has produced no token."""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.applications import Starlette

from kvwatch.hook.asgi_kv import KvGeometry, detect, prompt_tokens, vllm_geometry
from kvwatch.hook.asgi_stream import estimated_blocks


@dataclass
class ModelConfig:
    """The part of vLLM's ModelConfig the estimate reads (Qwen3-8B's numbers)."""

    model: str = "Qwen/Qwen3-8B"
    served_model_name: str = "qwen3"
    dtype: str = "torch.bfloat16"

    def get_num_layers(self, parallel: object) -> int:
        return 36

    def get_num_kv_heads(self, parallel: object) -> int:
        return 8

    def get_head_size(self) -> int:
        return 128


@dataclass
class CacheConfig:
    block_size: int = 16
    cache_dtype: str = "auto"


@dataclass
class DeviceConfig:
    device_type: str = "cuda"


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: object = None
    device_config: DeviceConfig = field(default_factory=DeviceConfig)


def test_vllm_bytes_per_block_are_layers_kv_heads_head_size_dtype_and_block_size() -> None:
    geometry = vllm_geometry(VllmConfig())
    assert geometry == KvGeometry("vllm", "qwen3", "cuda", 36 * 2 * 8 * 128 * 2 * 16, 16)
    assert geometry.blocks_for(1) == 1
    assert geometry.blocks_for(33) == 3  # rounded up to whole blocks
    fp8 = vllm_geometry(VllmConfig(cache_config=CacheConfig(block_size=32, cache_dtype="fp8")))
    assert fp8 is not None and fp8.bytes_per_block == 36 * 2 * 8 * 128 * 1 * 32


def test_the_app_state_is_where_vllm_keeps_its_config() -> None:
    app = Starlette()
    app.state.vllm_config = VllmConfig()
    assert detect(app, bytes_per_token=0).engine == "vllm"
    app.state.vllm_config = object()  # not a config the estimate can read
    fallback = detect(app, bytes_per_token=1000)
    assert (fallback.engine, fallback.bytes_per_block, fallback.blocks_for(7)) == ("asgi", 1000, 7)
    assert detect(Starlette(), bytes_per_token=0).blocks_for(50) == 0  # unknown: no estimate
    assert prompt_tokens(10) == 3


def test_a_request_without_a_token_holds_no_estimated_kv() -> None:
    """A request waiting for the engine (llama-cpp-python's generation lock) has its prompt
    in its body but no KV yet: 0, even for a whole-context engine, until its first token."""
    llama = KvGeometry("llama-cpp-python", "m.gguf", "cpu", 16 << 20, 4096, whole_context=True)
    per_token = KvGeometry("asgi", "", "unknown", 1000, 1)
    for geometry in (llama, per_token):
        assert estimated_blocks(geometry, body_bytes=4000, tokens_out=0) == 0
    assert estimated_blocks(llama, body_bytes=4000, tokens_out=1) == 1
    assert estimated_blocks(per_token, body_bytes=4000, tokens_out=1) == 1001

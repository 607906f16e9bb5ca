"""KV cache estimates for engines the ASGI middleware wraps: bytes per token, block geometry.

The middleware cannot read an engine's block table, so what it reports is an estimate, and
says so (`kv_estimated`). Each engine is read duck-typed from what its own server keeps, so
nothing here imports the engine (or torch):

- vLLM: `app.state.vllm_config` (set by vLLM's `init_app_state`): layers * 2 (K and V) *
  KV heads * head size * dtype bytes per token, `cache_config.block_size` tokens per block.
- llama-cpp-python: its server's model (`llama_cpp.server.app`'s proxy): one context whose
  KV cache is `n_ctx` tokens of layers * 2 * KV heads * head size * 2 bytes (f16), allocated
  whole and held by the one request that has the generation lock — one "block".
- anything else: a configured bytes-per-token, one token per block.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {
    "auto": 2,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "float": 4,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
# A prompt's tokens, when only its request body is known: about four bytes of text a token.
BODY_BYTES_PER_TOKEN = 4
LLAMA_CPP_SERVER_MODULE = "llama_cpp.server.app"
F16_BYTES = 2


@dataclass(frozen=True)
class KvGeometry:
    """How an engine lays out KV: `tokens_per_block` tokens of `bytes_per_block` bytes, or
    one block for the whole context (`whole_context`) however many tokens a request has."""

    engine: str
    model: str
    device: str
    bytes_per_block: int
    tokens_per_block: int
    whole_context: bool = False

    def blocks_for(self, tokens: int) -> int:
        """Blocks a request of `tokens` tokens holds (0 when the geometry is unknown)."""
        if self.bytes_per_block == 0:
            return 0
        if self.whole_context:
            return 1
        return math.ceil(tokens / self.tokens_per_block)


def prompt_tokens(body_bytes: int) -> int:
    return math.ceil(body_bytes / BODY_BYTES_PER_TOKEN)


def detect(app: Any, bytes_per_token: int) -> KvGeometry:
    """The geometry of the engine behind `app` (the ASGI app in the scope), best source first."""
    state = getattr(app, "state", None)
    vllm_config = getattr(state, "vllm_config", None)
    if vllm_config is not None:
        geometry = vllm_geometry(vllm_config)
        if geometry is not None:
            return geometry
    llama_server = sys.modules.get(LLAMA_CPP_SERVER_MODULE)
    if llama_server is not None:
        geometry = llama_cpp_geometry(llama_server)
        if geometry is not None:
            return geometry
    return KvGeometry("asgi", "", "unknown", bytes_per_token, 1)


def vllm_geometry(config: Any) -> KvGeometry | None:
    """From a vLLM `VllmConfig`: per-token bytes * block size; None when it does not read."""
    try:
        model, cache, parallel = config.model_config, config.cache_config, config.parallel_config
        per_token = (
            model.get_num_layers(parallel)
            * 2
            * model.get_num_kv_heads(parallel)
            * model.get_head_size()
            * _dtype_bytes(cache.cache_dtype, model.dtype)
        )
        block_size = int(cache.block_size)
        name = str(getattr(model, "served_model_name", None) or model.model)
        device = str(getattr(getattr(config, "device_config", None), "device_type", "cuda"))
    except (AttributeError, TypeError, ValueError):
        return None
    return KvGeometry("vllm", name, device, int(per_token) * block_size, block_size)


def llama_cpp_geometry(server_module: Any) -> KvGeometry | None:
    """From llama-cpp-python's server: the loaded model's context KV size; None before load."""
    proxy = getattr(server_module, "_llama_proxy", None)
    llama = getattr(proxy, "_current_model", None)
    if llama is None:
        return None
    try:
        metadata: dict[str, str] = llama.metadata
        arch = metadata["general.architecture"]
        layers = int(metadata[f"{arch}.block_count"])
        heads = int(metadata[f"{arch}.attention.head_count"])
        kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", heads))
        width = int(metadata[f"{arch}.embedding_length"])
        head_size = int(metadata.get(f"{arch}.attention.key_length", width // heads))
        n_ctx = int(llama.n_ctx())
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    context_bytes = n_ctx * layers * 2 * kv_heads * head_size * F16_BYTES
    model = str(getattr(llama, "model_path", "") or arch).rsplit("/", 1)[-1]
    return KvGeometry("llama-cpp-python", model, "cpu", context_bytes, n_ctx, whole_context=True)


def _dtype_bytes(cache_dtype: Any, model_dtype: Any) -> int:
    name = str(cache_dtype)
    if name == "auto":
        name = str(model_dtype).removeprefix("torch.")
    return DTYPE_BYTES.get(name, 2)

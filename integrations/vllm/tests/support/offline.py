"""vLLM's real scheduler, built and stepped in the test process without a model or a device.

The configs, the KV cache config, the requests and the scheduler are vLLM's own objects; only
the model's sampled token ids come from `tokens.next_token`. `Stepper` drives the scheduler
the way vLLM's EngineCore does: `step()` for synchronous scheduling (schedule, run, update),
or with a batch queue of two for async scheduling (the next batch is scheduled before the
previous one's output is taken in, vLLM's `step_with_batch_queue`).
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvwatch_vllm.holds import RequestHolds
from kvwatch_vllm.scheduler import KvwatchAsyncScheduler, KvwatchScheduler
from tests.support.tokens import next_token

BLOCK_SIZE = 16
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 64

# A tiny Llama: enough for vLLM's ModelConfig; no weights, no tokenizer.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": NUM_KV_HEADS * HEAD_SIZE * 2,
    "intermediate_size": 512,
    "num_attention_heads": NUM_KV_HEADS * 2,
    "num_key_value_heads": NUM_KV_HEADS,
    "num_hidden_layers": NUM_LAYERS,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_model_dir(directory: Path) -> Path:
    """A model directory holding only the tiny config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return directory


@dataclass(frozen=True)
class Setup:
    """One scheduler configuration the tests run under."""

    async_scheduling: bool
    prefix_caching: bool
    num_blocks: int = 64
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 1024
    max_model_len: int = 1024
    kv_transfer_config: KVTransferConfig | None = None

    @property
    def name(self) -> str:
        path = "async" if self.async_scheduling else "sync"
        return f"{path}-prefix-{'on' if self.prefix_caching else 'off'}"


def vllm_config(model_dir: Path, setup: Setup) -> VllmConfig:
    model_config = ModelConfig(
        model=str(model_dir),
        tokenizer=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=setup.max_model_len,
        seed=0,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        async_scheduling=setup.async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=setup.prefix_caching,
    )
    cache_config.num_gpu_blocks = setup.num_blocks
    config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=setup.kv_transfer_config,
    )
    # vLLM's CPU platform turns async scheduling off; a GPU engine runs it, and the async
    # scheduler's path is what is under test.
    config.scheduler_config.async_scheduling = setup.async_scheduling
    return config


def kv_cache_config(setup: Setup) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float32,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    return KVCacheConfig(
        num_blocks=setup.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


def make_scheduler(model_dir: Path, setup: Setup) -> RequestHolds:
    """kvwatch's scheduler class for the setup's scheduling path, as vLLM's EngineCore builds
    it."""
    config = vllm_config(model_dir, setup)
    cls = KvwatchAsyncScheduler if setup.async_scheduling else KvwatchScheduler
    return cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config(setup),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )


_HASHERS: dict[str, Any] = {}


def make_request(
    scheduler: RequestHolds, request_id: str, prompt: Sequence[int], max_tokens: int, **params: Any
) -> Request:
    """A request as vLLM's EngineCore makes it (block hashes for prefix caching and
    connectors), greedy-free: the token ids come from the test's model."""
    cache_config = scheduler.cache_config
    hasher = None
    if cache_config.enable_prefix_caching or scheduler.connector is not None:
        algo = cache_config.prefix_caching_hash_algo
        if algo not in _HASHERS:
            hash_fn = get_hash_fn_by_name(algo)
            init_none_hash(hash_fn)
            _HASHERS[algo] = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        hasher = _HASHERS[algo]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=hasher,
    )


@dataclass
class Stepper:
    """Steps a scheduler like vLLM's EngineCore and collects what clients would receive."""

    scheduler: RequestHolds
    async_scheduling: bool
    tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    # Each batch's scheduled tokens by request, in order; and the connector output the next
    # batch taken in carries (a worker's report of finished transfers).
    scheduled: list[dict[str, int]] = field(default_factory=list)
    connector_output: KVConnectorOutput | None = None
    _queue: deque[tuple[SchedulerOutput, dict[str, bool]]] = field(default_factory=deque)

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def step(self) -> None:
        """One EngineCore step: `step()` or `step_with_batch_queue()` (a queue of two)."""
        self.steps += 1
        if not self.async_scheduling:
            if self.scheduler.has_requests():
                self._run(self._schedule())
            return
        if self.scheduler.has_requests():
            scheduled = self._schedule()
            self._queue.appendleft(scheduled)
            executed = scheduled[0].total_num_scheduled_tokens > 0
            if len(self._queue) < 2 and (executed or self.scheduler.has_requests()):
                return
        elif not self._queue:
            return
        self._run(self._queue.pop())

    def drain(self) -> None:
        """Takes in every batch still in flight (async scheduling)."""
        while self._queue:
            self._run(self._queue.pop())

    def run_until_done(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self._queue:
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def steps_of(self, count: int) -> None:
        for _ in range(count):
            self.step()

    def _schedule(self) -> tuple[SchedulerOutput, dict[str, bool]]:
        """Schedules a batch and notes which requests the model samples for: those whose
        scheduled tokens reach the end of their prompt (not a partial prefill chunk)."""
        output = self.scheduler.schedule()
        self.scheduled.append(dict(output.num_scheduled_tokens))
        samples = {
            request_id: not self.scheduler.requests[request_id].is_prefill_chunk
            for request_id in output.num_scheduled_tokens
        }
        return output, samples

    def _run(self, scheduled: tuple[SchedulerOutput, dict[str, bool]]) -> None:
        """The model's output for the batch, then vLLM's update_from_output."""
        output, samples = scheduled
        request_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is None or not samples[request_id]:
                sampled.append([])
            else:
                sampled.append([next_token(request.all_token_ids)])
        model_output = ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=self.connector_output,
        )
        self.connector_output = None
        engine_outputs = self.scheduler.update_from_output(output, model_output)
        for outputs in engine_outputs.values():
            for item in outputs.outputs:
                self.tokens[item.request_id].extend(item.new_token_ids)
                if item.finish_reason is not None:
                    self.finished[item.request_id] = str(item.finish_reason)

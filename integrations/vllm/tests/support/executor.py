"""A vLLM executor whose "model" is `tokens.next_token`, so the real `vllm serve` (API server,
EngineCore, scheduler, middleware) runs end to end on a CPU where the wheel has no kernels:

    vllm serve MODEL_DIR --load-format dummy \\
        --distributed-executor-backend tests.support.executor.DeterministicExecutor

It answers the EngineCore's calls as one worker would: a KV cache spec for the tiny model,
available memory for `KV_BLOCKS` blocks, and, for each scheduled batch, one sampled token for
every request whose scheduled tokens reach the end of its sequence. It keeps each request's
sequence as a model runner keeps its cached requests: the prompt when the request is new, its
own samples after that, and the scheduler's full token list when a preempted (or parked)
request is resumed or a request comes back after steps away.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

from tests.support.knobs import DEFAULT_KV_BLOCKS, KV_BLOCKS_ENV, STEP_SECONDS_ENV
from tests.support.tokens import next_token


class DeterministicWorker:
    """What one worker answers; token ids from `next_token` over each request's sequence."""

    def __init__(self, executor: Executor) -> None:
        model_config = executor.model_config
        self._block_size = executor.cache_config.block_size
        self._num_layers = model_config.get_num_layers(executor.parallel_config)
        self._spec = FullAttentionSpec(
            block_size=self._block_size,
            num_kv_heads=model_config.get_num_kv_heads(executor.parallel_config),
            head_size=model_config.get_head_size(),
            dtype=torch.float32,
        )
        self._kv_blocks = int(os.environ.get(KV_BLOCKS_ENV, DEFAULT_KV_BLOCKS))
        self._step_seconds = float(os.environ.get(STEP_SECONDS_ENV, "0"))
        self.sequences: dict[str, list[int]] = {}
        self._pending: ModelRunnerOutput | None = None

    # ---- start-up ----

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return {f"model.layers.{i}.self_attn.attn": self._spec for i in range(self._num_layers)}

    def determine_available_memory(self) -> int:
        return self._kv_blocks * self._spec.page_size_bytes * self._num_layers

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def set_kv_cache_layout(self, *args: Any) -> None:
        return None

    def initialize_from_config(self, *args: Any) -> None:
        return None

    def get_simple_cpu_offload_num_cpu_blocks(self) -> None:
        return None

    def get_kv_connector_handshake_metadata(self) -> dict[Any, Any]:
        return {}

    def check_health(self) -> None:
        return None

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def reset_mm_cache(self) -> None:
        return None  # no multimodal inputs

    def reset_encoder_cache(self) -> None:
        return None

    # ---- steps ----

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Takes the batch in; the sampled tokens are what `sample_tokens` returns next."""
        for request_id in output.finished_req_ids:
            self.sequences.pop(request_id, None)
        for new in output.scheduled_new_reqs:
            self.sequences[new.req_id] = list(new.prefill_token_ids or new.prompt_token_ids or [])
        cached = output.scheduled_cached_reqs
        for request_id, tokens in cached.all_token_ids.items():
            self.sequences[request_id] = list(tokens)
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for new in output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
        if output.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if self._step_seconds:
            time.sleep(self._step_seconds)  # the "forward pass"
        request_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for request_id in request_ids:
            sequence = self.sequences[request_id]
            end = computed[request_id] + output.num_scheduled_tokens[request_id]
            if end >= len(sequence):  # the batch reaches the sequence's end: a sample
                token = next_token(sequence)
                sequence.append(token)
                sampled.append([token])
            else:  # a prefill chunk short of the end
                sampled.append([])
        self._pending = ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
            sampled_token_ids=sampled,
        )
        return None

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        pending, self._pending = self._pending, None
        return pending if pending is not None else EMPTY_MODEL_RUNNER_OUTPUT

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return None


class DeterministicExecutor(Executor):
    """One in-process `DeterministicWorker`; every call answers at once."""

    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        self.worker = DeterministicWorker(self)

    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
    ) -> list[Any] | Future[list[Any]]:
        if isinstance(method, str):
            result = getattr(self.worker, method)(*args, **(kwargs or {}))
        else:
            result = method(self.worker, *args, **(kwargs or {}))
        return _done([result]) if non_block else [result]

    def execute_model(  # type: ignore[override]
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput | None] | None:
        output = self.worker.execute_model(scheduler_output)
        return _done(output) if non_block else output

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        output = self.worker.sample_tokens(grammar_output)
        return _done(output) if non_block else output

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return None

    def compile_or_warm_up_model(self) -> None:
        return None  # nothing to compile: no model

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future

"""What callers hand the engine (`GenerationRequest`) and get back (`RequestHandle`), and the
errors a submission can meet."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvwatch.errors import KvwatchError
from kvwatch.lab.engine.kv_cache import KVCacheManager
from kvwatch.lab.engine.output import Finish, OutputChannel
from kvwatch.lab.engine.runner import Sampling
from kvwatch.lab.engine.scheduler import Sequence

KV_REPORT_INTERVAL_SECONDS = 0.5


class RequestRejectedError(KvwatchError):
    """The request cannot be served as asked (too long, duplicate id...): a client error.

    `param` names the offending request field, `code` is a stable machine-readable reason."""

    def __init__(self, message: str, hint: str, param: str | None, code: str) -> None:
        super().__init__(message, hint)
        self.param = param
        self.code = code


class EngineOverloadedError(KvwatchError):
    """The waiting queue is full; the client should retry later."""


class EngineUnavailableError(KvwatchError):
    """The engine is stopped or has failed; nothing is admitted any more."""


@dataclass(frozen=True)
class GenerationRequest:
    """One generation to run.

    Callbacks run on the engine thread and must return at once (schedule work elsewhere):
    `on_cancelled` after `Engine.cancel` freed the request's blocks (the HTTP server resets the
    connection there); `on_kv_change(kv_blocks, tokens_out)` when the request's block count
    changed, at most every `KV_REPORT_INTERVAL_SECONDS` and always when it drops to 0 (at
    once when parked); `on_resumed(kv_blocks, recomputed_tokens)` when a parked request holds
    its KV again and runs on (`recomputed_tokens` is 0: its KV was copied back).
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    on_cancelled: Callable[[], None] | None = None
    on_kv_change: Callable[[int, int], None] | None = None
    on_resumed: Callable[[int, int], None] | None = None


@dataclass(frozen=True)
class Completion:
    """A finished request as `RequestHandle.collect` returns it."""

    token_ids: list[int]
    text: str
    finish: Finish


class RequestHandle:
    """The submitter's view of a request: its output channel and its KV blocks, as the engine
    thread last published them (written there, read by anyone)."""

    def __init__(self, request_id: str, channel: OutputChannel) -> None:
        self.request_id = request_id
        self.channel = channel
        self.kv_blocks = 0

    def collect(self, timeout_seconds: float) -> Completion:
        """Reads on this thread until the request finishes; TimeoutError after the timeout."""
        deadline = time.monotonic() + timeout_seconds
        token_ids: list[int] = []
        text: list[str] = []
        while True:
            batch = self.channel.wait_batch(max(0.0, deadline - time.monotonic()))
            if batch is None:
                raise TimeoutError(f"request {self.request_id} still running")
            token_ids.extend(batch.token_ids)
            text.extend(batch.texts)
            if batch.finish is not None:
                return Completion(token_ids, "".join(text), batch.finish)


@dataclass(eq=False)
class LiveRequest:
    """Engine-thread state of one submitted, unfinished request. Owned by the engine thread."""

    seq: Sequence
    request: GenerationRequest
    handle: RequestHandle
    sampling: Sampling
    arrival_seconds: float
    last_token_seconds: float = 0.0
    reported_blocks: int = 0
    reported_seconds: float = 0.0

    @classmethod
    def new(
        cls,
        request: GenerationRequest,
        queue_tokens: int,
        on_read: Callable[[], None],
        device: torch.device,
    ) -> LiveRequest:
        """A request as just submitted: its sequence, an output queue of `queue_tokens`
        whose reads call `on_read`, and its sampling (a generator on `device`)."""
        prompt = list(request.prompt_token_ids)
        return cls(
            seq=Sequence(request.request_id, prompt, len(prompt), request.max_tokens),
            request=request,
            handle=RequestHandle(request.request_id, OutputChannel(queue_tokens, on_read)),
            sampling=Sampling.drawn(request.temperature, request.seed, device),
            arrival_seconds=time.monotonic(),
        )


def check_fits(
    request: GenerationRequest, max_model_len: int, max_tokens_limit: int, kv: KVCacheManager
) -> None:
    """Raises RequestRejectedError unless the request fits the model's context and, alone,
    the KV pool (so preemption can always make room for it)."""
    prompt_tokens = len(request.prompt_token_ids)
    total_tokens = prompt_tokens + request.max_tokens
    if prompt_tokens == 0:
        raise RequestRejectedError("the prompt is empty", "send at least one token", "prompt", "")
    if not 1 <= request.max_tokens <= max_tokens_limit:
        raise RequestRejectedError(
            f"max_tokens must be in [1, {max_tokens_limit}]",
            "lower max_tokens",
            "max_tokens",
            "invalid_value",
        )
    if total_tokens > max_model_len:
        raise RequestRejectedError(
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{prompt_tokens} prompt tokens plus max_tokens {request.max_tokens}",
            "shorten the prompt or lower max_tokens",
            "max_tokens" if prompt_tokens < max_model_len else "prompt",
            "context_length_exceeded",
        )
    if kv.blocks_needed(total_tokens) > kv.num_blocks:
        raise RequestRejectedError(
            f"the request needs {kv.blocks_needed(total_tokens)} KV blocks; the pool "
            f"has {kv.num_blocks}",
            "shorten the prompt, lower max_tokens, or start the engine with more --kv-blocks",
            "max_tokens",
            "context_length_exceeded",
        )

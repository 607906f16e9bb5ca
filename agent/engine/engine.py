"""`Engine`: the engine loop on its own thread, and the thread-safe ways in and out of it."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from kvwatch.engine.attention import PagedKVStorage, bytes_per_block
from kvwatch.engine.config import EngineConfig
from kvwatch.engine.device import DeviceFence, kv_pool_blocks, resolve_device, resolve_dtype
from kvwatch.engine.kv_cache import KVCacheManager
from kvwatch.engine.metrics import EngineMetrics, EngineStats, RequestSnapshot
from kvwatch.engine.model import ByteTokenizer, TransformerModel
from kvwatch.engine.output import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, Finish, OutputChannel
from kvwatch.engine.requests import (
    KV_REPORT_INTERVAL_SECONDS,
    EngineOverloadedError,
    EngineUnavailableError,
    GenerationRequest,
    LiveRequest,
    RequestHandle,
    RequestRejectedError,
    check_fits,
)
from kvwatch.engine.runner import ModelRunner, Sampling
from kvwatch.engine.scheduler import Scheduler, SeqStatus, Sequence
from kvwatch.engine.stepper import StepExecutor
from kvwatch.hookwire.types import CancelOutcome

IDLE_WAIT_SECONDS = 0.1
FINISHED_IDS_REMEMBERED = 4096
STOP_JOIN_SECONDS = 10.0

_log = logging.getLogger("kvwatch.engine")


@dataclass(frozen=True)
class EngineDescription:
    """What the engine is: served model, device, KV geometry. Fixed for its lifetime."""

    model: str
    device: str
    dtype: str
    block_size: int
    kv_blocks_total: int
    bytes_per_block: int
    max_model_len: int
    egress: str

    @property
    def kv_bytes_total(self) -> int:
        return self.kv_blocks_total * self.bytes_per_block


@dataclass(eq=False)
class _Cancel:
    request_id: str
    reason: str
    outcome: Future[CancelOutcome] = field(default_factory=Future)


@dataclass(eq=False)
class _Abort:
    request_id: str


_Command = LiveRequest | _Cancel | _Abort


class Engine:
    """A small inference engine: paged KV cache, continuous batching, two egress modes.

    Threads: `submit`, `cancel`, `abort`, `stats` and `stop` are thread-safe. Everything else
    runs on the engine thread (`kvwatch-engine`), which alone owns the scheduler, the block
    tables, the KV storage and the model; other threads talk to it through the inbox, which it
    drains at each step boundary.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config.validate()
        self.tokenizer = ByteTokenizer()
        device = resolve_device(config)
        dtype = resolve_dtype(config.dtype, device)
        shape = config.shape
        model = TransformerModel(shape, self.tokenizer.vocab_size, config.seed)
        model = model.to(device=device, dtype=dtype).eval()
        block_bytes = bytes_per_block(shape, config.block_size, dtype)
        num_blocks = kv_pool_blocks(config, device, block_bytes)
        storage = PagedKVStorage(shape, num_blocks, config.block_size, dtype, device)
        self.kv = KVCacheManager(num_blocks, config.block_size)
        self.description = EngineDescription(
            model=config.served_model_name,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            block_size=config.block_size,
            kv_blocks_total=num_blocks,
            bytes_per_block=block_bytes,
            max_model_len=shape.max_model_len,
            egress=config.egress,
        )
        self._scheduler = Scheduler(
            self.kv, config.max_running, config.max_prefill_tokens, self._egress_blocked
        )
        runner = ModelRunner(model, storage, self.kv, self.tokenizer.output_token_ids(), device)
        self._device = device
        self._fence = DeviceFence(device)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[_Command] = []
        self._ids_in_use: set[str] = set()
        self._live: dict[str, LiveRequest] = {}
        self._finished_ids: OrderedDict[str, None] = OrderedDict()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._stats = self._publish(steps=0, now=0.0)
        self.metrics = EngineMetrics(self.stats)
        self._steps = StepExecutor(runner, self._fence, self.metrics, self.tokenizer)

    # ----- thread-safe API -------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvwatch-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Aborts every live request, then stops and joins the engine thread."""
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(STOP_JOIN_SECONDS)

    def stats(self) -> EngineStats:
        return self._stats

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queues a request; raises RequestRejectedError, EngineOverloadedError or
        EngineUnavailableError."""
        check_fits(request, self.description.max_model_len, self.config.max_tokens_limit, self.kv)
        capacity = self.config.egress_queue_tokens
        if self.config.egress == "decoupled":
            capacity = request.max_tokens
        handle = RequestHandle(request.request_id, OutputChannel(capacity, self._wake.set))
        live = LiveRequest(
            seq=Sequence(
                request.request_id,
                list(request.prompt_token_ids),
                len(request.prompt_token_ids),
                request.max_tokens,
            ),
            request=request,
            handle=handle,
            sampling=self._sampling(request),
            arrival_seconds=time.monotonic(),
        )
        self._enqueue(live)
        return handle

    def cancel(self, request_id: str, reason: str) -> CancelOutcome:
        """Two-phase cancel; blocks until the request's blocks are free (or a timeout).

        At the next step boundary the engine thread stops scheduling the request, waits for the
        device work of the last step (which touched its blocks), frees its blocks, then answers
        with what it freed and calls the request's `on_cancelled` (the server resets the
        connection). Never call it from the engine thread."""
        command = _Cancel(request_id, reason)
        with self._lock:
            if self._closed or self.error is not None:
                return CancelOutcome(request_id, "failed", 0, 0, "the engine is stopped")
            self._inbox.append(command)
        self._wake.set()
        try:
            return command.outcome.result(timeout=self.config.cancel_wait_seconds)
        except FutureTimeout:
            detail = f"no step boundary within {self.config.cancel_wait_seconds:g} s"
            return CancelOutcome(request_id, "failed", 0, 0, detail)

    def abort(self, request_id: str) -> None:
        """Ends a request whose client went away (finish reason "abort"); returns at once."""
        with self._lock:
            self._inbox.append(_Abort(request_id))
        self._wake.set()

    def _sampling(self, request: GenerationRequest) -> Sampling:
        if request.temperature <= 0.0:
            return Sampling()
        generator = torch.Generator(device=self._device)
        if request.seed is not None:
            generator.manual_seed(request.seed)
        else:
            generator.seed()
        return Sampling(request.temperature, generator)

    def _enqueue(self, live: LiveRequest) -> None:
        request_id = live.request.request_id
        with self._lock:
            if self._closed or self.error is not None:
                raise EngineUnavailableError("the engine is stopped", "restart `kvwatch engine`")
            if request_id in self._ids_in_use:
                raise RequestRejectedError(
                    f"request id {request_id!r} is already in use",
                    "send a unique X-Request-Id, or none",
                    None,
                    "duplicate_request_id",
                )
            pending = sum(isinstance(command, LiveRequest) for command in self._inbox)
            if self._stats.waiting + pending >= self.config.max_waiting:
                raise EngineOverloadedError(
                    f"{self.config.max_waiting} requests are already waiting",
                    "retry later, or start the engine with a larger --max-waiting",
                )
            self._ids_in_use.add(request_id)
            self._inbox.append(live)
        self._wake.set()

    # ----- the engine thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as exc:  # the thread must not die silently
            _log.exception("engine thread failed")
            with self._lock:
                self.error = exc
            # The block tables may be what broke: end every stream without touching them.
            self._end_all(FINISH_ERROR, f"engine failed: {exc}", free_blocks=False)
        else:
            self._end_all(FINISH_ABORT, "engine stopped", free_blocks=True)
            self._stats = self._publish(self._stats.steps, time.monotonic())

    def _iterate(self) -> bool:
        """One step boundary and, when there is work, one step. False when stopping."""
        self._wake.clear()
        self._fence.wait()  # nothing below frees a block still in use by the device
        with self._lock:
            commands, self._inbox = self._inbox, []
            closed = self._closed
        for command in commands:
            self._apply(command)
        if closed:
            return False
        plan = self._scheduler.schedule()
        if self.config.debug_checks:
            self.kv.check_invariants()
        for seq in plan.prefills:  # so a stream opened at its first token shows its blocks
            self._live[seq.request_id].handle.kv_blocks = self.kv.num_blocks_of(seq.request_id)
        for group in plan.decodes, plan.prefills:
            if group:
                for live in self._steps.run([self._live[seq.request_id] for seq in group]):
                    self._finish(live, FINISH_LENGTH)
        steps = self._stats.steps + (0 if plan.is_empty else 1)
        self._stats = self._publish(steps, time.monotonic())
        if plan.is_empty:
            self._wake.wait(IDLE_WAIT_SECONDS)
        return True

    def _apply(self, command: _Command) -> None:
        if isinstance(command, LiveRequest):
            self._live[command.request.request_id] = command
            self._scheduler.add(command.seq)
            self.metrics.prompt_tokens.inc(command.seq.num_prompt_tokens)
        elif isinstance(command, _Cancel):
            self._cancel_now(command)
        else:
            live = self._live.get(command.request_id)
            if live is not None:
                self._finish(live, FINISH_ABORT, detail="client disconnected")

    def _cancel_now(self, command: _Cancel) -> None:
        request_id = command.request_id
        live = self._live.get(request_id)
        if live is None:
            if request_id in self._finished_ids:
                detail = "it already finished; its blocks are free"
                outcome = CancelOutcome(request_id, "already_finished", 0, 0, detail)
            else:
                outcome = CancelOutcome(request_id, "unknown_request", 0, 0, "no such request")
            command.outcome.set_result(outcome)
            return
        _log.info("cancelling %s: %s", request_id, command.reason)
        freed = self._finish(live, FINISH_ABORT, cancelled=True, detail=command.reason)
        command.outcome.set_result(
            CancelOutcome(request_id, "cancelled", freed, freed * self.description.bytes_per_block)
        )
        _call_safely(live.request.on_cancelled)

    def _finish(
        self, live: LiveRequest, reason: str, *, cancelled: bool = False, detail: str = ""
    ) -> int:
        """Frees the request's blocks (after the fence) and delivers its finish record."""
        self._fence.wait()
        freed = self._scheduler.remove(live.seq)
        request_id = live.request.request_id
        del self._live[request_id]
        self._finished_ids[request_id] = None
        if len(self._finished_ids) > FINISHED_IDS_REMEMBERED:
            self._finished_ids.popitem(last=False)
        with self._lock:
            self._ids_in_use.discard(request_id)
        seq = live.seq
        live.handle.channel.finish(
            Finish(reason, seq.num_prompt_tokens, seq.num_generated, cancelled, detail)
        )
        self.metrics.request_success.labels(finished_reason=reason).inc()
        self.metrics.e2e_request_latency.observe(time.monotonic() - live.arrival_seconds)
        live.handle.kv_blocks = 0
        if live.request.on_kv_change is not None:
            _call_safely(live.request.on_kv_change, 0, seq.num_generated)
        return freed

    def _end_all(self, reason: str, detail: str, *, free_blocks: bool) -> None:
        """Ends every live request and fails every pending command; nothing is admitted after."""
        for live in list(self._live.values()):
            if free_blocks:
                self._finish(live, reason, detail=detail)
            else:
                seq = live.seq
                finish = Finish(reason, seq.num_prompt_tokens, seq.num_generated, detail=detail)
                live.handle.channel.finish(finish)
        with self._lock:
            commands, self._inbox = self._inbox, []
            self._closed = True
        for command in commands:
            if isinstance(command, _Cancel):
                command.outcome.set_result(
                    CancelOutcome(command.request_id, "failed", 0, 0, detail)
                )
            elif isinstance(command, LiveRequest):
                command.handle.channel.finish(Finish(reason, command.seq.num_prompt_tokens, 0))

    def _egress_blocked(self, seq: Sequence) -> bool:
        return not self._live[seq.request_id].handle.channel.has_room()

    def _publish(self, steps: int, now: float) -> EngineStats:
        """The stats snapshot; on the way, tells each request's `on_kv_change` of a changed
        block count (rate-limited per request)."""
        requests: list[RequestSnapshot] = []
        egress_blocked = 0
        for request_id, live in self._live.items():
            blocks = self.kv.num_blocks_of(request_id)
            generated = live.seq.num_generated
            live.handle.kv_blocks = blocks
            state = live.seq.status.value
            if live.seq.status is SeqStatus.RUNNING and not live.handle.channel.has_room():
                state = "egress_blocked"
                egress_blocked += 1
            requests.append(RequestSnapshot(request_id, state, blocks, generated))
            callback = live.request.on_kv_change
            if (
                callback is not None
                and blocks != live.reported_blocks
                and now - live.reported_seconds >= KV_REPORT_INTERVAL_SECONDS
            ):
                live.reported_blocks, live.reported_seconds = blocks, now
                _call_safely(callback, blocks, generated)
        return EngineStats(
            running=len(self._scheduler.running),
            waiting=len(self._scheduler.waiting),
            egress_blocked=egress_blocked,
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_total=self.kv.num_blocks,
            bytes_per_block=self.description.bytes_per_block,
            num_preemptions=self._scheduler.num_preemptions,
            steps=steps,
            requests=tuple(requests),
        )


def _call_safely(callback: Callable[..., None] | None, *args: int) -> None:
    """Runs a caller's callback on the engine thread; its failure must not stop the engine."""
    if callback is None:
        return
    try:
        callback(*args)
    except Exception:
        _log.exception("request callback failed")

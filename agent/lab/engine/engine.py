"""`Engine`: the engine loop on its own thread, and the thread-safe ways in and out of it."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from kvwatch.hookwire.types import CommandOutcome
from kvwatch.lab.engine.attention import PagedKVStorage, bytes_per_block
from kvwatch.lab.engine.config import PARK_HOST_POOLS, EngineConfig
from kvwatch.lab.engine.device import DeviceFence, kv_pool_blocks, resolve_device, resolve_dtype
from kvwatch.lab.engine.kv_cache import KVCacheManager
from kvwatch.lab.engine.metrics import EngineMetrics, EngineStats, RequestSnapshot
from kvwatch.lab.engine.model import ByteTokenizer, TransformerModel
from kvwatch.lab.engine.orders import (
    Abort,
    CancelOrder,
    Order,
    ParkOrder,
    PauseOrder,
    ReleaseOrder,
    failed,
    not_live,
)
from kvwatch.lab.engine.output import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, Finish
from kvwatch.lab.engine.parking import CopyOut, ParkingLot
from kvwatch.lab.engine.request_log import RequestLog, RequestReport
from kvwatch.lab.engine.requests import (
    KV_REPORT_INTERVAL_SECONDS,
    EngineOverloadedError,
    EngineUnavailableError,
    GenerationRequest,
    LiveRequest,
    RequestHandle,
    RequestRejectedError,
    check_fits,
)
from kvwatch.lab.engine.runner import ModelRunner
from kvwatch.lab.engine.scheduler import Scheduler, SeqStatus, Sequence
from kvwatch.lab.engine.stepper import StepExecutor

IDLE_WAIT_SECONDS = 0.1
# How often an idle engine looks whether a park's copy to host memory is done.
TRANSFER_POLL_SECONDS = 0.001
FINISHED_IDS_REMEMBERED = 4096
STOP_JOIN_SECONDS = 10.0

_log = logging.getLogger("kvwatch.lab.engine")


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


_Command = LiveRequest | Order | Abort


class Engine:
    """A small inference engine: paged KV cache, continuous batching, two egress modes.

    Threads: `submit`, `cancel`, `park`, `pause`, `release`, `abort`, `stats`,
    `request_reports` and `stop` are thread-safe. Everything else runs on the engine thread
    (`kvwatch-engine`), which alone owns the scheduler, the block tables, the KV storage, the
    parked requests' host copies and the model; other threads talk to it through the inbox,
    which it drains at each step boundary. `copy_out` replaces how a park copies KV out to
    host memory (tests inject a slow asynchronous copy).
    """

    def __init__(self, config: EngineConfig, *, copy_out: CopyOut | None = None) -> None:
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
        self._parking = ParkingLot(
            storage,
            self._scheduler,
            config.park_host_kv_bytes or PARK_HOST_POOLS * self.description.kv_bytes_total,
            copy_out,
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
        self._requests = RequestLog()
        self._num_pauses = 0
        self._num_releases = 0
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

    def request_reports(self) -> list[RequestReport]:
        """Every live request and the last finished ones (GET /v1/requests)."""
        return self._requests.reports(self._stats.requests)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queues a request; raises RequestRejectedError, EngineOverloadedError or
        EngineUnavailableError."""
        check_fits(request, self.description.max_model_len, self.config.max_tokens_limit, self.kv)
        queue_tokens = self.config.egress_queue_tokens
        if self.config.egress == "decoupled":
            queue_tokens = request.max_tokens
        live = LiveRequest.new(request, queue_tokens, self._wake.set, self._device)
        self._enqueue(live)
        return live.handle

    def cancel(self, request_id: str, reason: str) -> CommandOutcome:
        """Two-phase cancel; blocks until the request's blocks are free (or a timeout).

        At the next step boundary the engine thread stops scheduling the request, waits for the
        device work of the last step (which touched its blocks), frees its blocks, then answers
        with what it freed and calls the request's `on_cancelled` (the server resets the
        connection). Never call it from the engine thread."""
        return self._order(CancelOrder(request_id, reason))

    def park(self, request_id: str, reason: str) -> CommandOutcome:
        """Parks a request; blocks like `cancel`.

        At the next step boundary the engine thread declines a request that holds no blocks
        (or is parked already, or whose copy would pass the host-memory limit), else starts
        copying its KV to host memory and takes it out of scheduling; once the copy is done
        (at once on the CPU) it frees the blocks, answers "parked" with what it freed, and
        reports 0 blocks through `on_kv_change`. The request and its output stay; once
        released (`release`) it runs on ahead of new work (`on_resumed`). Never call it from
        the engine thread."""
        if not self.config.park:
            return failed(request_id, "parking is off (--no-park)")
        return self._order(ParkOrder(request_id, reason))

    def pause(self, request_id: str, reason: str) -> CommandOutcome:
        """Pauses a request at the next step boundary: no more decode steps, nor admission;
        it keeps its blocks and its place. Answers "paused" (also for a request paused or
        parked already). Never call it from the engine thread."""
        if not self.config.pause:
            return failed(request_id, "pausing is off (--no-pause)")
        return self._order(PauseOrder(request_id, reason))

    def release(self, request_id: str, reason: str) -> CommandOutcome:
        """Ends a pause (the request is scheduled again) or a park (the request goes to the
        head of the queue, its KV is copied back before its next step, then `on_resumed`);
        "not_held" when it is neither. Never call it from the engine thread."""
        if not self.config.pause:
            return failed(request_id, "pausing is off (--no-pause)")
        return self._order(ReleaseOrder(request_id, reason))

    def _order(self, command: Order) -> CommandOutcome:
        """Queues an order and waits up to `cancel_wait_seconds` for its outcome."""
        request_id = command.request_id
        with self._lock:
            if self._closed or self.error is not None:
                return failed(request_id, "the engine is stopped")
            self._inbox.append(command)
        self._wake.set()
        try:
            return command.outcome.result(timeout=self.config.cancel_wait_seconds)
        except FutureTimeout:
            return failed(
                request_id, f"no step boundary within {self.config.cancel_wait_seconds:g} s"
            )

    def abort(self, request_id: str) -> None:
        """Ends a request whose client went away (finish reason "abort"); returns at once."""
        with self._lock:
            self._inbox.append(Abort(request_id))
        self._wake.set()

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
            self._requests.add(request_id, live.handle.channel)
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
        self._settle_parks()
        plan = self._scheduler.schedule()
        for seq in self._parking.restore(plan.prefills):  # before their step: KV back in place
            self._resumed(self._live[seq.request_id])
        if self.config.debug_checks:
            self.kv.check_invariants()
            self._parking.check_invariants()
        for seq in plan.prefills:  # so a stream opened at its first token shows its blocks
            self._live[seq.request_id].handle.kv_blocks = self.kv.num_blocks_of(seq.request_id)
        for group in plan.decodes, plan.prefills:
            if group:
                for live in self._steps.run([self._live[seq.request_id] for seq in group]):
                    self._finish(live, FINISH_LENGTH)
        steps = self._stats.steps + (0 if plan.is_empty else 1)
        self._stats = self._publish(steps, time.monotonic())
        if plan.is_empty:
            copying = self._parking.copying
            self._wake.wait(TRANSFER_POLL_SECONDS if copying else IDLE_WAIT_SECONDS)
        return True

    def _apply(self, command: _Command) -> None:
        if isinstance(command, LiveRequest):
            self._live[command.request.request_id] = command
            self._scheduler.add(command.seq)
            self.metrics.prompt_tokens.inc(command.seq.num_prompt_tokens)
        elif isinstance(command, Order):
            live = self._live.get(command.request_id)
            request_id = command.request_id
            if live is None:
                command.outcome.set_result(not_live(request_id, request_id in self._finished_ids))
                return
            match command:
                case ParkOrder():
                    self._park_now(command, live)
                case PauseOrder():
                    self._pause_now(command, live)
                case ReleaseOrder():
                    self._release_now(command, live)
                case _:
                    self._cancel_now(command, live)
        else:
            live = self._live.get(command.request_id)
            if live is not None:
                self._finish(live, FINISH_ABORT, detail="client disconnected")

    def _cancel_now(self, command: Order, live: LiveRequest) -> None:
        _log.info("cancelling %s: %s", command.request_id, command.reason)
        freed = self._finish(live, FINISH_ABORT, cancelled=True, detail=command.reason)
        command.outcome.set_result(self._freed(command, "cancelled", freed))
        _call_safely(live.request.on_cancelled)

    def _park_now(self, command: ParkOrder, live: LiveRequest) -> None:
        refusal = self._parking.refusal(live)
        if refusal is not None:
            command.outcome.set_result(
                CommandOutcome(command.request_id, "declined", 0, 0, refusal)
            )
            return
        _log.info("parking %s: %s", command.request_id, command.reason)
        self._parking.park(live, command)
        self._settle_parks()

    def _settle_parks(self, wait_for: str | None = None) -> None:
        """Frees the blocks of the parks whose copy is done (waiting for `wait_for`'s) and
        reports them: `ParkingLot.settle` answers the parks."""
        for live in self._parking.settle(wait_for):
            self._report_kv(live, 0)

    def _pause_now(self, command: PauseOrder, live: LiveRequest) -> None:
        seq = live.seq
        if seq.status is not SeqStatus.PARKED and not seq.paused:  # else: a renewal
            _log.info("pausing %s: %s", command.request_id, command.reason)
            seq.paused = True
            self._num_pauses += 1
        command.outcome.set_result(CommandOutcome(command.request_id, "paused"))

    def _release_now(self, command: ReleaseOrder, live: LiveRequest) -> None:
        seq = live.seq
        if seq.status is SeqStatus.PARKED:
            self._settle_parks(wait_for=command.request_id)
            self._parking.release(live)
        elif seq.paused:
            seq.paused = False
        else:
            detail = "it is neither paused nor parked"
            command.outcome.set_result(
                CommandOutcome(command.request_id, "not_held", detail=detail)
            )
            return
        _log.info("releasing %s: %s", command.request_id, command.reason)
        self._num_releases += 1
        command.outcome.set_result(CommandOutcome(command.request_id, "released"))

    def _freed(self, command: Order, status: str, blocks: int) -> CommandOutcome:
        """The answer to an order that freed `blocks`."""
        bytes_freed = blocks * self.description.bytes_per_block
        return CommandOutcome(command.request_id, status, blocks, bytes_freed)

    def _resumed(self, live: LiveRequest) -> None:
        """A resumed request holds its KV again: tells its `on_resumed` (which carries the new
        block count, so no `on_kv_change` repeats it)."""
        blocks = self.kv.num_blocks_of(live.seq.request_id)
        live.reported_blocks, live.reported_seconds = blocks, time.monotonic()
        _call_safely(live.request.on_resumed, blocks, 0)

    def _report_kv(self, live: LiveRequest, blocks: int) -> None:
        """Tells the request's `on_kv_change` of its block count now."""
        live.reported_blocks, live.reported_seconds = blocks, time.monotonic()
        _call_safely(live.request.on_kv_change, blocks, live.seq.num_generated)

    def _finish(
        self, live: LiveRequest, reason: str, *, cancelled: bool = False, detail: str = ""
    ) -> int:
        """Frees the request's blocks (after the fence, and after a park's copy of them) and
        delivers its finish record."""
        self._fence.wait()
        request_id = live.request.request_id
        self._settle_parks(wait_for=request_id)
        self._parking.forget(request_id)
        freed = self._scheduler.remove(live.seq)
        del self._live[request_id]
        self._finished_ids[request_id] = None
        if len(self._finished_ids) > FINISHED_IDS_REMEMBERED:
            self._finished_ids.popitem(last=False)
        with self._lock:
            self._ids_in_use.discard(request_id)
        seq = live.seq
        finish = Finish(reason, seq.num_prompt_tokens, seq.num_generated, cancelled, detail)
        live.handle.channel.finish(finish)
        self._requests.ended(request_id, finish)
        self.metrics.request_success.labels(finished_reason=reason).inc()
        self.metrics.e2e_request_latency.observe(time.monotonic() - live.arrival_seconds)
        live.handle.kv_blocks = 0
        self._report_kv(live, 0)
        return freed

    def _end_all(self, reason: str, detail: str, *, free_blocks: bool) -> None:
        """Ends every live request and fails every pending command; nothing is admitted after."""
        if not free_blocks:
            self._parking.abandon(detail)
        for live in list(self._live.values()):
            if free_blocks:
                self._finish(live, reason, detail=detail)
            else:
                seq = live.seq
                self._parking.forget(seq.request_id)
                finish = Finish(reason, seq.num_prompt_tokens, seq.num_generated, detail=detail)
                live.handle.channel.finish(finish)
                self._requests.ended(seq.request_id, finish)
        with self._lock:
            commands, self._inbox = self._inbox, []
            self._closed = True
        for command in commands:
            if isinstance(command, Order):
                command.outcome.set_result(failed(command.request_id, detail))
            elif isinstance(command, LiveRequest):
                finish = Finish(reason, command.seq.num_prompt_tokens, 0)
                command.handle.channel.finish(finish)
                self._requests.ended(command.request.request_id, finish)

    def _egress_blocked(self, seq: Sequence) -> bool:
        return not self._live[seq.request_id].handle.channel.has_room()

    def _publish(self, steps: int, now: float) -> EngineStats:
        """The stats snapshot; on the way, tells each request's `on_kv_change` of a changed
        block count (rate-limited per request)."""
        requests: list[RequestSnapshot] = []
        for request_id, live in self._live.items():
            blocks = self.kv.num_blocks_of(request_id)
            generated = live.seq.num_generated
            live.handle.kv_blocks = blocks
            requests.append(RequestSnapshot(request_id, self._state(live), blocks, generated))
            if (
                blocks != live.reported_blocks
                and now - live.reported_seconds >= KV_REPORT_INTERVAL_SECONDS
            ):
                self._report_kv(live, blocks)
        parking = self._parking
        states = [request.state for request in requests]
        return EngineStats(
            running=len(self._scheduler.running),
            waiting=len(self._scheduler.waiting),
            egress_blocked=states.count("egress_blocked"),
            paused=states.count("paused"),
            num_pauses=self._num_pauses,
            num_releases=self._num_releases,
            parked=parking.num_parked,
            parked_host_bytes=parking.host_bytes,
            num_parks=parking.num_parks,
            num_resumes=parking.num_resumes,
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_total=self.kv.num_blocks,
            bytes_per_block=self.description.bytes_per_block,
            num_preemptions=self._scheduler.num_preemptions,
            steps=steps,
            requests=tuple(requests),
        )

    def _state(self, live: LiveRequest) -> str:
        """The request's state as snapshots and GET /v1/requests show it."""
        seq = live.seq
        if seq.status is SeqStatus.PARKED:
            return "parking" if self._parking.is_copying(seq.request_id) else "parked"
        if seq.paused:
            return "paused"
        if seq.status is SeqStatus.RUNNING and not live.handle.channel.has_room():
            return "egress_blocked"
        return str(seq.status.value)


def _call_safely(callback: Callable[..., None] | None, *args: int) -> None:
    """Runs a caller's callback on the engine thread; its failure must not stop the engine."""
    if callback is None:
        return
    try:
        callback(*args)
    except Exception:
        _log.exception("request callback failed")

"""One engine's connection to the hook server: its session, its streams, its commands (cancel,
park, detach) in flight."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvwatch.errors import ProtocolError
from kvwatch.hookserver.registry import (
    EngineStream,
    StreamRegistry,
    resolve_engine_pid,
)
from kvwatch.hookwire.counters import EventCounters
from kvwatch.hookwire.protocol import (
    FEATURE_DETACH,
    FEATURE_PARK,
    FEATURE_PAUSE,
    Answer,
    Close,
    Command,
    EngineInfo,
    ErrorMessage,
    LineFramer,
    LineTooLongError,
    Message,
    Open,
    Resumed,
    UnsupportedVersionError,
    Update,
    Welcome,
    encode,
    plural,
)
from kvwatch.hookwire.types import CommandOutcome

RECV_BYTES = 64 * 1024
MAX_PENDING_OUT_BYTES = 256 * 1024
CLOSE_FLUSH_SECONDS = 1.0
MAX_REMEMBERED_CANCELS = 1024
GONE_STATUSES = ("cancelled", "already_finished")  # the request is gone, whichever command

_log = logging.getLogger("kvwatch.hookserver")


def opened_ns(age_ms: int) -> int:
    """When a stream began on the agent's clock, from the age the engine gives it (a stream
    re-announced after the agent restarted keeps its age); never before the clock's zero."""
    now = time.monotonic_ns()
    return max(0, now - age_ms * 1_000_000)


@dataclass(frozen=True)
class PeerCredentials:
    """The connecting process as SO_PEERCRED reports it, in the agent's namespaces."""

    pid: int
    uid: int
    gid: int


@dataclass
class _PendingCommand:
    """A command sent and not yet answered; `resumed` once its request resumed meanwhile
    (a park's answer then no longer says the request is parked)."""

    command: Command
    answer: asyncio.Future[CommandOutcome]
    resumed: bool = False


class EngineConnection:
    """Serves one engine connection: reads its messages, sends commands (cancel, park,
    detach), matches the answers.

    Owned by the event loop: `HookServer` runs `serve` then `finish` (or only `refuse`) as the
    connection's task, and calls `command` and `close` from others. Invariants: stream messages
    count only after a valid hello and each hello forgets what the connection announced before;
    when `serve` returns, the registry holds none of this connection's streams and every
    pending command is resolved; the agent never waits on the engine to accept output: what it
    writes stays under MAX_PENDING_OUT_BYTES or the connection is dropped, and the last flush
    before closing is bounded by CLOSE_FLUSH_SECONDS.
    """

    def __init__(
        self,
        connection_id: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: PeerCredentials,
        registry: StreamRegistry,
        counters: EventCounters,
        agent_name: str,
    ) -> None:
        self.connection_id = connection_id
        self.peer = peer
        self.hello: EngineInfo | None = None
        self._reader = reader
        self._writer = writer
        self._registry = registry
        self._counters = counters
        self._agent_name = agent_name
        self._framer = LineFramer(sender="engine")
        self._pending: dict[str, _PendingCommand] = {}
        self._gone_by_cancel: OrderedDict[str, None] = OrderedDict()
        self._refusing = False

    async def serve(self) -> None:
        """Reads until the engine disconnects, `close` is called or the session is refused.

        Returns with the streams forgotten and the waiting cancels failed; `finish` then closes.
        """
        try:
            while True:
                try:
                    data = await self._reader.read(RECV_BYTES)
                except OSError as exc:
                    _log.debug("engine connection %d: read failed: %s", self.connection_id, exc)
                    break
                if not data or not self._receive(data):
                    break
        finally:
            self._end()

    async def refuse(self, message: str, hint: str) -> None:
        """Sends an `error` and closes, without serving the connection."""
        self._send(ErrorMessage(message=message, hint=hint))
        await self.finish()

    def close(self) -> None:
        """Ends the connection at once; `serve` then forgets its streams and returns."""
        self._writer.transport.abort()

    async def command(self, command: Command, timeout_seconds: float) -> CommandOutcome:
        """Sends one command and waits for its answer (the `OUTCOME` of the command's answer
        type); a missing answer is `failed`."""
        kind = command.TYPE
        try:
            line = encode(command)
        except ProtocolError as exc:
            self._counters.add(f"{kind}_send_failures")
            return _failed(command, f"{kind} not sent: {exc.message}")
        answer: asyncio.Future[CommandOutcome] = asyncio.get_running_loop().create_future()
        self._pending[command.correlation_id] = _PendingCommand(command, answer)
        try:
            if not self._write(line):
                self._counters.add(f"{kind}_send_failures")
                detail = f"{kind} not sent: the engine connection is closed"
                return _failed(command, detail)
            self._counters.add(f"{plural(kind)}_sent")
            return await asyncio.wait_for(answer, timeout_seconds)
        except asyncio.TimeoutError:
            self._counters.add(f"{kind}_timeouts")
            return _failed(command, f"no answer within {timeout_seconds:g} s")
        finally:
            self._pending.pop(command.correlation_id, None)

    def _receive(self, data: bytes) -> bool:
        """Handles every line `data` completes; False once the connection is refused."""
        for item in self._framer.feed(data):
            self._dispatch(item)
            if self._refusing:
                return False
        return True

    def _dispatch(self, item: Message | ProtocolError) -> None:
        """Handles one decoded line; nothing an engine sends may raise out of here."""
        try:
            if isinstance(item, ProtocolError):
                self._malformed(item)
            elif isinstance(item, EngineInfo):
                self._start_session(item)
            elif self.hello is None:
                self._counters.add("before_hello_messages")
            elif isinstance(item, Open):
                self._open(item, self.hello)
            elif isinstance(item, Update):
                self._update(item)
            elif isinstance(item, Close):
                self._close_stream(item)
            elif isinstance(item, Answer):
                self._answered(item)
            elif isinstance(item, Resumed):
                self._resumed(item)
        except Exception:
            self._counters.add("internal_errors")
            _log.exception("engine connection %d: message handling failed", self.connection_id)

    def _malformed(self, error: ProtocolError) -> None:
        self._counters.add("malformed_messages")
        if isinstance(error, LineTooLongError):
            self._counters.add("oversized_lines")
        if not isinstance(error, UnsupportedVersionError):
            _log.debug("engine connection %d: dropped: %s", self.connection_id, error)
            return
        self._counters.add("version_mismatches")
        if self.hello is None:  # before a session, the first line is the engine's hello
            _log.warning("engine (pid %d) refused: %s", self.peer.pid, error.message)
            self._send(ErrorMessage(message=error.message, hint=error.hint))
            self._refusing = True

    def _start_session(self, hello: EngineInfo) -> None:
        self._counters.add("hellos")
        if self.hello is not None:
            self._counters.add("session_resets")
            self._registry.forget_owner(self.connection_id)
        elif hello.pid != self.peer.pid:
            _log.info(
                "engine %s says it is pid %d; the kernel says pid %d (another pid namespace "
                "or a proxy); joining on the kernel's view",
                hello.engine,
                hello.pid,
                self.peer.pid,
            )
        self.hello = hello
        self._send(Welcome(agent=self._agent_name))

    def _open(self, message: Open, hello: EngineInfo) -> None:
        self._counters.add("opens")
        stream = EngineStream(
            request_id=message.request_id,
            engine_pid=resolve_engine_pid(self.peer.pid, hello.pid, message.pid),
            announced_pid=message.pid,
            engine=hello.engine,
            model=hello.model,
            device=message.device,
            local=message.local,
            remote=message.remote,
            kv_blocks=message.kv_blocks,
            bytes_per_block=message.bytes_per_block,
            tokens_out=message.tokens_out,
            opened_ns=opened_ns(message.age_ms),
            kv_estimated=message.kv_estimated,
            can_park=hello.can(FEATURE_PARK),
            parked=message.parked,
            can_detach=hello.can(FEATURE_DETACH),
            detached=message.detached,
            can_pause=hello.can(FEATURE_PAUSE),
            paused=message.paused,
        )
        self._gone_by_cancel.pop(message.request_id, None)
        if not self._registry.open(self.connection_id, stream):
            _log.warning(
                "engine %r (pid %d) announced more streams than the agent keeps; %r not "
                "tracked (close finished requests, or run fewer streams per connection)",
                hello.engine,
                self.peer.pid,
                message.request_id,
            )

    def _update(self, message: Update) -> None:
        self._counters.add("updates")
        request_id = message.request_id
        changes: dict[str, bool] = {"detached": False} if message.egress_buffer_full else {}
        if self.hello is not None and self.hello.can(FEATURE_PAUSE):
            changes["paused"] = message.paused
        known = self._registry.update(
            self.connection_id,
            request_id,
            kv_blocks=message.kv_blocks,
            tokens_out=message.tokens_out,
            kv_estimated=message.kv_estimated,
            egress_buffer_full=message.egress_buffer_full,
            **changes,
        )
        if not known and request_id not in self._gone_by_cancel:
            self._counters.add("unknown_request_events")

    def _resumed(self, message: Resumed) -> None:
        self._counters.add("resumes")
        for pending in self._pending.values():
            pending.resumed = pending.resumed or pending.command.request_id == message.request_id
        known = self._registry.update(
            self.connection_id,
            message.request_id,
            kv_blocks=message.kv_blocks,
            parked=False,
            parked_blocks=0,
        )
        if not known:
            self._counters.add("unknown_request_events")

    def _close_stream(self, message: Close) -> None:
        self._counters.add("closes")
        request_id = message.request_id
        if self._registry.remove(self.connection_id, request_id):
            return
        if request_id in self._gone_by_cancel:  # the cancelled answer came first
            del self._gone_by_cancel[request_id]
        else:
            self._counters.add("unknown_request_events")

    def _answered(self, message: Answer) -> None:
        pending = self._pending.get(message.correlation_id)
        if (
            pending is None
            or pending.command.request_id != message.request_id
            or pending.command.ANSWER is not type(message)
            or pending.answer.done()
        ):
            self._counters.add(f"unmatched_{message.COMMAND}_answers")
        else:
            self._counters.add(f"{plural(message.COMMAND)}_answered")
            pending.answer.set_result(message.outcome())
        self._took_effect(message, resumed=pending is not None and pending.resumed)

    def _took_effect(self, message: Answer, resumed: bool) -> None:
        """What an answer says about its stream, whoever waits: parked (unless the request
        `resumed` before the answer came), detached (unless an update already said its
        buffer is full: coupled again), paused or released, or gone — forgotten now, its
        close expected."""
        request_id = message.request_id
        if message.status == "parked" and not resumed:
            self._registry.update(
                self.connection_id, request_id, parked=True, parked_blocks=message.freed_blocks
            )
        elif message.status == "detached" and (stream := self._registry.get(request_id)):
            detached = not stream.egress_buffer_full
            self._registry.update(self.connection_id, request_id, detached=detached, paused=False)
        elif message.status == "paused":
            self._registry.update(self.connection_id, request_id, paused=True)
        elif message.status == "released":  # a parked one has its KV back later: `resumed`
            self._registry.update(
                self.connection_id, request_id, paused=False, parked=False, parked_blocks=0
            )
        gone = message.status in GONE_STATUSES
        if gone and self._registry.remove(self.connection_id, request_id):
            self._gone_by_cancel[request_id] = None
            if len(self._gone_by_cancel) > MAX_REMEMBERED_CANCELS:
                self._gone_by_cancel.popitem(last=False)

    def _send(self, message: Message) -> bool:
        """Queues one of the agent's own messages (they always encode)."""
        return self._write(encode(message))

    def _write(self, line: bytes) -> bool:
        """Queues a line without waiting; False (and the connection dropped) if it cannot."""
        if self._writer.is_closing():
            return False
        self._writer.write(line)
        if self._writer.transport.get_write_buffer_size() > MAX_PENDING_OUT_BYTES:
            self._counters.add("send_overflows")
            _log.warning(
                "engine connection %d (pid %d) reads nothing; over %d bytes pending, dropping it",
                self.connection_id,
                self.peer.pid,
                MAX_PENDING_OUT_BYTES,
            )
            self._writer.transport.abort()
            return False
        return True

    def _end(self) -> None:
        """Forgets this connection's streams and fails the commands still waiting."""
        for pending in self._pending.values():
            if not pending.answer.done():
                self._counters.add(f"{plural(pending.command.TYPE)}_lost")
                detail = "the engine connection closed before it answered"
                pending.answer.set_result(_failed(pending.command, detail))
        self._pending.clear()
        self._registry.forget_owner(self.connection_id)
        self._counters.add("disconnects")

    async def finish(self) -> None:
        """Closes after flushing what is queued; an engine that reads nothing gets an abort."""
        self._writer.close()
        try:
            await asyncio.wait_for(self._writer.wait_closed(), CLOSE_FLUSH_SECONDS)
        except asyncio.TimeoutError:
            self._writer.transport.abort()
        except OSError:
            pass


def _failed(command: Command, detail: str) -> CommandOutcome:
    return CommandOutcome(command.request_id, "failed", detail=detail)

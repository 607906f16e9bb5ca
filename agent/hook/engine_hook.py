"""`EngineHook`: the engine side of the kvwatch agent protocol, on a background thread."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
import threading
import time

from kvwatch.errors import ConfigError, ProtocolError
from kvwatch.hook.book import COUNTER_NAMES, StreamBook
from kvwatch.hook.commands import CommandRunner
from kvwatch.hook.holds import HoldKeeper
from kvwatch.hook.session import Session, Waker
from kvwatch.hookwire.commands import COMMAND_KINDS
from kvwatch.hookwire.counters import EventCounters
from kvwatch.hookwire.protocol import EngineInfo
from kvwatch.hookwire.types import CommandHandler, CommandOutcome, resolve_socket_path
from kvwatch.sockets import Endpoint

CONNECT_TIMEOUT_SECONDS = 0.5
STOP_JOIN_SECONDS = 2.0
FIRST_RETRY_FRACTION = 0.125

_log = logging.getLogger("kvwatch.hook")


class EngineHook:
    """Tells the kvwatch agent about the engine's streams and runs the agent's commands:
    cancels, and, for an engine that passes their handlers, parks (`park_handler`), detaches
    (`detach_handler`), pauses and releases (`pause_handler` and `release_handler`, both):
    its hello then lists "park", "detach", "pause" (kvwatch.hookwire.commands).

    A pause or a park that took effect holds its request for the lease the command asked
    (kvwatch.hook.holds); the hook releases it itself through `release_handler` when the
    agent does not renew it in time, and releases every held request when the agent's
    connection ends: without the agent the engine runs as if kvwatch did not exist.

    The engine owns the hook; `stream_*` may be called from any thread (the event loop
    included) and never block on the agent: they update the live-stream book and queue a
    message, dropping and counting it when the bounded queue is full. One background thread
    (`kvwatch-hook`) owns the agent connection: it connects to the unix socket, sends hello and
    re-announces every live stream on each (re)connect, retries with backoff (at most
    `reconnect_seconds` apart) while the agent is absent, and hands the agent's commands to
    the engine's handlers on worker threads. Nothing the agent does or fails to do raises
    into the engine.
    """

    def __init__(
        self,
        info: EngineInfo,
        cancel_handler: CommandHandler,
        socket_path: str | None = None,
        *,
        park_handler: CommandHandler | None = None,
        detach_handler: CommandHandler | None = None,
        pause_handler: CommandHandler | None = None,
        release_handler: CommandHandler | None = None,
        queue_size: int = 1024,
        reconnect_seconds: float = 1.0,
        cancel_timeout_seconds: float = 5.0,
        send_timeout_seconds: float = 5.0,
    ) -> None:
        for name, value in (
            ("queue_size", queue_size),
            ("reconnect_seconds", reconnect_seconds),
            ("cancel_timeout_seconds", cancel_timeout_seconds),
            ("send_timeout_seconds", send_timeout_seconds),
        ):
            if value <= 0:
                raise ConfigError(f"EngineHook {name} must be positive, got {value}")
        self.socket_path = resolve_socket_path(socket_path)
        self._reconnect_seconds = reconnect_seconds
        self._send_timeout_seconds = send_timeout_seconds
        given = {
            "cancel": cancel_handler,
            "park": park_handler,
            "detach": detach_handler,
            "pause": pause_handler,
            "release": release_handler,
        }
        handlers = {name: handler for name, handler in given.items() if handler is not None}
        info = dataclasses.replace(info, features=_features(info.features, handlers))
        self._counters = EventCounters(COUNTER_NAMES)
        self._book = StreamBook(info, queue_size, self._counters, self._wake)  # checks info
        self._commands = CommandRunner(handlers, cancel_timeout_seconds, self._counters, self._wake)
        self._holds = HoldKeeper(release_handler, self._counters, self._released_by_hook)
        self._stop = threading.Event()
        self._waker: Waker | None = None
        self._thread: threading.Thread | None = None
        self._connected = False
        self._connects = 0
        self._absence_logged = False

    def start(self) -> None:
        """Starts the background thread and returns at once (a no-op when running)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._waker = Waker()
        self._thread = threading.Thread(target=self._run, name="kvwatch-hook", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Closes the connection and joins the background thread (within about a second)."""
        thread, waker = self._thread, self._waker
        if thread is None or waker is None:
            return
        self._stop.set()
        waker.wake()
        thread.join(STOP_JOIN_SECONDS)
        if thread.is_alive():
            _log.error("the kvwatch hook thread did not stop within %g s", STOP_JOIN_SECONDS)
        self._thread = self._waker = None
        waker.close()

    def stream_opened(
        self,
        request_id: str,
        local: tuple[str, int],
        remote: tuple[str, int],
        kv_blocks: int,
        *,
        kv_estimated: bool = False,
    ) -> None:
        """A streaming response started; `kv_estimated` marks `kv_blocks` as an estimate."""
        try:
            self._book.opened(
                request_id, _endpoint(local), _endpoint(remote), kv_blocks, kv_estimated
            )
        except (ProtocolError, ValueError, TypeError, IndexError) as exc:
            self._drop_invalid("stream_opened", exc)

    def stream_updated(
        self,
        request_id: str,
        kv_blocks: int,
        tokens_out: int,
        *,
        egress_buffer_full: bool = False,
    ) -> None:
        """New numbers; `egress_buffer_full` says the engine's output buffer for it is full."""
        try:
            if not self._book.updated(request_id, kv_blocks, tokens_out, egress_buffer_full):
                self._counters.add("unknown_stream_events")
        except ProtocolError as exc:
            self._drop_invalid("stream_updated", exc)

    def stream_resumed(self, request_id: str, kv_blocks: int, recomputed_tokens: int) -> None:
        """A parked request runs again: `kv_blocks` it holds now, `recomputed_tokens` whose
        KV was computed again (0 when it was copied back from host memory)."""
        try:
            if self._book.resumed(request_id, kv_blocks, recomputed_tokens):
                self._counters.add("resumes")
            else:
                self._counters.add("unknown_stream_events")
        except ProtocolError as exc:
            self._drop_invalid("stream_resumed", exc)

    def stream_closed(self, request_id: str, reason: str) -> None:
        try:
            if not self._book.closed(request_id, reason):
                self._counters.add("unknown_stream_events")
        except ProtocolError as exc:
            self._drop_invalid("stream_closed", exc)

    @property
    def connected(self) -> bool:
        return self._connected

    def counters(self) -> dict[str, int]:
        """Event counts since construction, plus the `live_streams` gauge."""
        return {**self._counters.snapshot(), "live_streams": self._book.live_count}

    def _drop_invalid(self, call: str, exc: Exception) -> None:
        self._counters.add("dropped_invalid")
        _log.debug("%s ignored: %s", call, exc)

    def _released_by_hook(self, request_id: str, outcome: CommandOutcome | None) -> None:
        """A release the hook started itself (lease over, agent gone) is done: the agent
        hears that the request is no longer paused."""
        if outcome is not None and outcome.status == "released":
            self._book.unpaused(request_id)

    def _wake(self) -> None:
        waker = self._waker
        if waker is not None:
            waker.wake()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            sock = self._connect()
            if sock is None:
                failures += 1
                self._stop.wait(self._retry_delay(failures))
                continue
            started = time.monotonic()
            try:
                reason = self._serve(sock)
            except Exception:  # a hook bug must not end the hook, let alone the engine
                self._counters.add("internal_errors")
                _log.exception("kvwatch hook session failed; reconnecting")
                reason = "internal error"
            if self._stop.is_set():
                break
            self._counters.add("disconnects")
            _log.warning("kvwatch agent connection ended: %s; reconnecting", reason)
            lasted_seconds = time.monotonic() - started
            failures = 1 if lasted_seconds >= self._reconnect_seconds else failures + 1
            self._stop.wait(self._retry_delay(failures))

    def _serve(self, sock: socket.socket) -> str:
        waker = self._waker
        assert waker is not None, "the hook thread runs only between start() and stop()"
        self._connects += 1
        self._counters.add("connects")
        if self._connects > 1:
            self._counters.add("reconnects")
        _log.info("connected to the kvwatch agent at %s", self.socket_path)
        self._connected = True
        try:
            session = Session(
                sock,
                self._book,
                commands=self._commands,
                holds=self._holds,
                counters=self._counters,
                waker=waker,
                stop=self._stop,
                send_timeout_seconds=self._send_timeout_seconds,
            )
            return session.run()
        finally:
            self._connected = False

    def _retry_delay(self, failures: int) -> float:
        """Doubles from an eighth of reconnect_seconds up to reconnect_seconds."""
        first = self._reconnect_seconds * FIRST_RETRY_FRACTION
        return min(self._reconnect_seconds, first * (1 << min(failures - 1, 16)))

    def _connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT_SECONDS)
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            self._counters.add("connect_failures")
            log = _log.debug if self._absence_logged else _log.info
            self._absence_logged = True
            log(
                "kvwatch agent not reachable at %s (%s); the engine runs normally, retrying",
                self.socket_path,
                exc.strerror or exc,
            )
            return None
        sock.setblocking(False)
        self._absence_logged = False
        return sock


def _endpoint(address: tuple[str, int]) -> Endpoint:
    """An endpoint from a socket address tuple (IPv6 scope dropped, IPv4-mapped shown as IPv4)."""
    ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    port = address[1]
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"not a TCP port: {port!r}")
    return Endpoint(str(ip), port)


def _features(announced: tuple[str, ...], handlers: dict[str, CommandHandler]) -> tuple[str, ...]:
    """The hello's features: those the engine announced that name no command, and each
    command feature whose every command has a handler (kvwatch.hookwire.commands). A feature
    with handlers for only some of its commands is a ConfigError."""
    command_features = {kind.feature for kind in COMMAND_KINDS.values() if kind.feature}
    features = [feature for feature in announced if feature not in command_features]
    for feature in sorted(command_features):
        names = [kind.name for kind in COMMAND_KINDS.values() if kind.feature == feature]
        given = [name for name in names if name in handlers]
        if given and len(given) < len(names):
            missing = ", ".join(name for name in names if name not in handlers)
            raise ConfigError(
                f"the {feature!r} feature needs a handler for each of {', '.join(names)}",
                f"pass the {missing} handler too, or none of them",
            )
        if given:
            features.append(feature)
    return tuple(features)

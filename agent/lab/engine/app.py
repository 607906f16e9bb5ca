"""The Starlette app: OpenAI-compatible routes over one `Engine`, the SSE writer, and
`GET /v1/requests` (every live request and the last finished ones, with their token counts).

The SSE writer is where the egress modes meet the network: it takes a request's tokens from its
bounded queue and sends them, coalesced into writes of about a kilobyte after the first token
(kvwatch.hook.asgi_coalesce); it keeps taking tokens while it gathers them. When the client
stops reading, a write blocks, the queue fills and (in coupled mode) the engine stops advancing
the request, which keeps its KV blocks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvwatch.errors import KvwatchError
from kvwatch.hook.asgi_coalesce import CoalescedSend
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.engine.http_connection import TRANSPORT_EXTENSION, reset_connection
from kvwatch.lab.engine.openai_api import (
    ApiError,
    ParsedRequest,
    ResponseFormat,
    parse_json_object,
    parse_request,
    request_id,
)
from kvwatch.lab.engine.output import FINISH_ABORT, FINISH_ERROR, Finish
from kvwatch.lab.engine.requests import (
    EngineOverloadedError,
    EngineUnavailableError,
    GenerationRequest,
    RequestHandle,
    RequestRejectedError,
)

MAX_BODY_BYTES = 1 << 20


class StreamObserver(Protocol):
    """Who hears about streams: `kvwatch.hook.EngineHook` has exactly these methods."""

    def stream_opened(
        self, request_id: str, local: tuple[str, int], remote: tuple[str, int], kv_blocks: int
    ) -> None: ...

    def stream_updated(self, request_id: str, kv_blocks: int, tokens_out: int) -> None: ...

    def stream_resumed(self, request_id: str, kv_blocks: int, recomputed_tokens: int) -> None: ...

    def stream_closed(self, request_id: str, reason: str) -> None: ...


def socket_ends(scope: Scope) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """The request's connection as its socket sees it (local, remote), from the transport;
    never the scope's `client`, which uvicorn rewrites from X-Forwarded-For behind a proxy,
    while the agent joins on what the kernel reports. None when the socket is gone."""
    transport = scope.get("extensions", {}).get(TRANSPORT_EXTENSION)
    if transport is None:
        return None
    local, remote = transport.get_extra_info("sockname"), transport.get_extra_info("peername")
    if not local or not remote:
        return None
    return (str(local[0]), int(local[1])), (str(remote[0]), int(remote[1]))


class StreamAnnouncer:
    """Forwards stream events to an optional observer: open, updates and resumes, close, in
    that order.

    Thread-safe: `kv_changed` and `resumed` run on the engine thread, the rest on the event
    loop. The lock
    is held across the observer's calls, which never block (the hook only queues)."""

    def __init__(self, observer: StreamObserver | None) -> None:
        self._observer = observer
        self._lock = threading.Lock()
        self._open: set[str] = set()

    def opened(self, request_id: str, scope: Scope, kv_blocks: int) -> None:
        ends = socket_ends(scope)
        if self._observer is None or ends is None:
            return
        with self._lock:  # held across the call: no update can overtake the open
            self._open.add(request_id)
            self._observer.stream_opened(request_id, ends[0], ends[1], kv_blocks)

    def kv_changed(self, request_id: str, kv_blocks: int, tokens_out: int) -> None:
        with self._lock:
            if self._observer is not None and request_id in self._open:
                self._observer.stream_updated(request_id, kv_blocks, tokens_out)

    def resumed(self, request_id: str, kv_blocks: int, recomputed_tokens: int) -> None:
        with self._lock:
            if self._observer is not None and request_id in self._open:
                self._observer.stream_resumed(request_id, kv_blocks, recomputed_tokens)

    def closed(self, request_id: str, reason: str) -> None:
        with self._lock:
            if self._observer is not None and request_id in self._open:
                self._open.discard(request_id)
                self._observer.stream_closed(request_id, reason)


def error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _engine_error(exc: KvwatchError) -> ApiError:
    if isinstance(exc, RequestRejectedError):
        return ApiError(400, str(exc), param=exc.param, code=exc.code or None)
    code = "overloaded" if isinstance(exc, EngineOverloadedError) else "unavailable"
    return ApiError(503, str(exc), code=code, error_type="server_error")


class SseStream:
    """The ASGI response of one streaming request: `data:` chunks, then `data: [DONE]`.

    Ends one of four ways: finished (final chunk and [DONE]); cancelled (the engine freed the
    blocks and resets the connection: nothing more is written); client gone (the request is
    aborted); engine stopped (finish reason "abort", then [DONE])."""

    def __init__(
        self,
        engine: Engine,
        handle: RequestHandle,
        response: ResponseFormat,
        include_usage: bool,
        announcer: StreamAnnouncer,
    ) -> None:
        self.engine = engine
        self.handle = handle
        self.response = response
        self.include_usage = include_usage
        self.announcer = announcer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-request-id", self.handle.request_id.encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        watcher = asyncio.create_task(self._watch_disconnect(receive))
        reason = "error"
        try:
            reason = await self._pump(scope, send)
        finally:
            watcher.cancel()
            if reason == "error":
                self.engine.abort(self.handle.request_id)
            self.announcer.closed(self.handle.request_id, reason)

    async def _watch_disconnect(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.engine.abort(self.handle.request_id)

    async def _pump(self, scope: Scope, send: Send) -> str:
        """Writes until the request ends; returns the stream's close reason for the hook."""
        transport = scope.get("extensions", {}).get(TRANSPORT_EXTENSION)
        sock = transport.get_extra_info("socket") if transport is not None else None
        coalesced = CoalescedSend(send, self.engine.config.coalescing.for_connection(sock))
        try:
            return await self._write(scope, coalesced)
        finally:
            coalesced.discard()

    async def _write(self, scope: Scope, send: CoalescedSend) -> str:
        """Takes each batch of tokens as it comes and sends its events; those after the first
        token's are coalesced, the last ones go at once."""
        opened = False
        prefix = self.response.role_event() if self.response.chat else b""
        while True:
            batch = await self.handle.channel.next_batch()
            body = prefix + b"".join(self.response.token_event(text) for text in batch.texts)
            prefix = b""
            finish = batch.finish
            if finish is not None and finish.cancelled:
                return "cancelled"
            if finish is not None:
                body += self.response.final_events(finish, self.include_usage)
            message = {"type": "http.response.body", "body": body, "more_body": finish is None}
            if not opened and batch.token_ids:
                self.announcer.opened(self.handle.request_id, scope, self.handle.kv_blocks)
                opened = True
                send.coalesce_after(message)  # the first token never waits
            await send(message)
            if finish is not None:
                return _close_reason(finish)


def _close_reason(finish: Finish) -> str:
    return {FINISH_ABORT: "aborted", FINISH_ERROR: "error"}.get(finish.reason, "finished")


class EngineRoutes:
    """The route handlers, bound to one engine and one stream announcer."""

    def __init__(self, engine: Engine, announcer: StreamAnnouncer) -> None:
        self.engine = engine
        self.announcer = announcer

    async def models(self, request: Request) -> Response:
        model = self.engine.description.model
        card = {"id": model, "object": "model", "created": 0, "owned_by": "kvwatch"}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        if self.engine.error is not None:
            return PlainTextResponse("engine failed\n", status_code=503)
        return PlainTextResponse("ok\n")

    async def requests(self, request: Request) -> Response:
        reports = [report.as_json() for report in self.engine.request_reports()]
        return JSONResponse({"object": "list", "data": reports})

    async def request_report(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        reports = self.engine.request_reports()
        report = next((r for r in reports if r.request_id == request_id), None)
        if report is None:
            message = f"no live or recently finished request {request_id!r}"
            return error_response(ApiError(404, message, code="request_not_found"))
        return JSONResponse(report.as_json())

    async def metrics(self, request: Request) -> Response:
        return Response(self.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        try:
            parsed = parse_request(
                parse_json_object(await _read_body(request)),
                chat=chat,
                model=self.engine.description.model,
                max_tokens_limit=self.engine.config.max_tokens_limit,
            )
            rid = request_id(chat, request.headers.get("x-request-id"))
            handle = self._submit(rid, parsed, request.scope)
        except ApiError as exc:
            return error_response(exc)
        response = ResponseFormat(chat, rid, self.engine.description.model)
        if parsed.stream:
            stream = SseStream(self.engine, handle, response, parsed.include_usage, self.announcer)
            return _AsgiResponse(stream)
        texts: list[str] = []
        while True:
            batch = await handle.channel.next_batch()
            texts.extend(batch.texts)
            if batch.finish is not None:
                body = response.full("".join(texts), batch.finish)
                return JSONResponse(body, headers={"x-request-id": rid})

    def _submit(self, rid: str, parsed: ParsedRequest, scope: Scope) -> RequestHandle:
        loop = asyncio.get_running_loop()
        transport = scope.get("extensions", {}).get(TRANSPORT_EXTENSION)

        def on_cancelled() -> None:
            if transport is not None:
                loop.call_soon_threadsafe(reset_connection, transport)

        def on_kv_change(kv_blocks: int, tokens_out: int) -> None:
            self.announcer.kv_changed(rid, kv_blocks, tokens_out)

        def on_resumed(kv_blocks: int, recomputed_tokens: int) -> None:
            self.announcer.resumed(rid, kv_blocks, recomputed_tokens)

        try:
            return self.engine.submit(
                GenerationRequest(
                    request_id=rid,
                    prompt_token_ids=self.engine.tokenizer.encode(parsed.prompt),
                    max_tokens=parsed.max_tokens,
                    temperature=parsed.temperature,
                    seed=parsed.seed,
                    on_cancelled=on_cancelled,
                    on_kv_change=on_kv_change if parsed.stream else None,
                    on_resumed=on_resumed if parsed.stream else None,
                )
            )
        except (RequestRejectedError, EngineOverloadedError, EngineUnavailableError) as exc:
            raise _engine_error(exc) from exc


async def _read_body(request: Request) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    return bytes(body)


class _AsgiResponse(Response):
    """Lets a route return a raw ASGI callable as its response."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Any]) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    return error_response(ApiError(status, str(detail), code=None))


def build_app(engine: Engine, observer: StreamObserver | None = None) -> Starlette:
    """The ASGI app serving `engine`; `observer` (the kvwatch hook) hears about streams."""
    routes = EngineRoutes(engine, StreamAnnouncer(observer))
    return Starlette(
        routes=[
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/requests", routes.requests, methods=["GET"]),
            Route("/v1/requests/{request_id}", routes.request_report, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _http_error},
    )

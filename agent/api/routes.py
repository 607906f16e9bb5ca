"""The agent's HTTP API: /metrics, /api/v1/sockets, /api/v1/streams, /api/v1/events,
/healthz (Starlette on uvicorn, inside the daemon's event loop)."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse as StarletteJSONResponse
from starlette.responses import Response
from starlette.routing import Route

from kvwatch.api.state import AgentState
from kvwatch.collect.collectors import TableStatus, needed_sockets
from kvwatch.sockets import Endpoint
from kvwatch.streams.timeline import connection_id


class JSONResponse(StarletteJSONResponse):
    """JSON that encodes whatever an engine sent: a string that is not Unicode text (a lone
    surrogate) has those characters replaced by "?" instead of failing the request with 500."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8", "replace")


def build_app(state: AgentState, registry: CollectorRegistry) -> Starlette:
    """The routes over `state`; /metrics serves `registry`, which the daemon built."""

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def sockets(_: Request) -> JSONResponse:
        return JSONResponse([view.socket_row() for view in state.stream_views()])

    async def streams(_: Request) -> JSONResponse:
        return JSONResponse([view.to_json() for view in state.stream_views()])

    async def events(request: Request) -> JSONResponse:
        try:
            since = int(request.query_params.get("since", "0"))
        except ValueError:
            return JSONResponse({"error": "since must be an integer event id"}, status_code=400)
        return JSONResponse(state.events_after(since))

    async def explain(request: Request) -> JSONResponse:
        key = request.path_params["request_id"]
        endpoint = _endpoint_or_none(key)
        if endpoint is not None:
            timeline = state.timelines.find_endpoint(endpoint)
            what = f"connection with endpoint {endpoint}"
        else:
            timeline = state.timelines.find(key)
            what = f"stream with request id {key!r}"
        if timeline is None:
            return JSONResponse(
                {
                    "error": f"no {what} is live or in the history of the last "
                    f"{state.timelines.history_size} streams"
                },
                status_code=404,
            )
        body = timeline.to_json()
        body["live"] = not timeline.closed and any(
            connection_id(s.local, s.remote) == timeline.connection for s in state.samples()
        )
        if body["live"]:
            view = next(
                (
                    v
                    for v in state.stream_views()
                    if connection_id(v.sample.local, v.sample.remote) == timeline.connection
                ),
                None,
            )
            body["stream"] = view.to_json() if view is not None else body["stream"]
        return JSONResponse(body)

    async def health(_: Request) -> JSONResponse:
        opened = state.opened
        bpf = state.bpf
        return JSONResponse(
            {
                "status": "ok",
                "mode": state.mode,
                "backend": opened.backend if opened else None,
                "collector": opened.note if opened else None,
                "attach_points": bpf.report.points if bpf is not None else {},
                "engines": state.hooks.engines(),
                "uptime_seconds": round((time.monotonic_ns() - state.started_ns) / 1e9, 1),
                "gpu": state.gpus.available,
                "socket_table": table_json(state.table),
            }
        )

    return Starlette(
        routes=[
            Route("/metrics", metrics),
            Route("/api/v1/sockets", sockets),
            Route("/api/v1/streams", streams),
            Route("/api/v1/events", events),
            Route("/api/v1/explain/{request_id:path}", explain),
            Route("/healthz", health),
        ]
    )


def table_json(table: TableStatus | None) -> dict[str, Any] | None:
    """The kernel socket table's fill and the --max-sockets that would fit (null without BPF)."""
    if table is None:
        return None
    return {**dataclasses.asdict(table), "needed_sockets": needed_sockets(table)}


def _endpoint_or_none(text: str) -> str | None:
    """`text` as a canonical "ip:port" when it is a socket address, else None."""
    try:
        return str(Endpoint.parse(text))
    except ValueError:
        return None

"""Coalesced egress (kvwatch.hook.asgi_coalesce): what it costs a healthy reader.

Coalescing gathers a stream's SSE events after its first token into writes of up to
`coalesce_bytes`, or what came within `coalesce_ms` of the first unwritten token, so that a
reader that stops shows in the server's kernel as a closing window (bench_visibility.py). A
reader that keeps up pays with latency: a token may wait in the writer until the write is full
or the timer fires. Two measurements, each with coalescing off (a write per message) and on
(the defaults, 1024 bytes / 250 ms), REPETITIONS times, interleaved:

1. Paced tokens through the ASGI middleware: a Starlette app under uvicorn in this process
   yields EVENT_BYTES-byte OpenAI-style events at a fixed rate (RATES tokens/s: a large model's
   decode speed and faster), a client reads as fast as it can. Per token, the delay from the
   app yielding it to the client receiving it (same process, one monotonic clock): p50, p99,
   max; and the writes (HTTP chunks) per stream.
2. The reference engine (tiny model, CPU) at full speed, a client reading as fast as it can:
   the gaps between the chunks the client receives (p50, p99), the writes, and the time to
   [DONE].

Run: `python -m bench.bench_coalesce`. Writes bench/results/coalesce.json.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from bench.common import write_result
from kvwatch.hook.asgi import Middleware
from kvwatch.hook.asgi_coalesce import DEFAULT_COALESCE_BYTES, DEFAULT_COALESCE_MS
from kvwatch.lab.asgi_servers import serving
from kvwatch.lab.engine.config import EngineConfig
from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.engine.engine_server import EngineServer
from kvwatch.lab.http_chunks import ChunkedResponse

RATES = (20, 50, 100, 200)
PACED_SECONDS = 3.0
EVENT_BYTES = 214  # a reference-engine completion chunk of one token is about this long
ENGINE_TOKENS = 600
REPETITIONS = 3
SETTINGS = {"off": 0, "on": DEFAULT_COALESCE_BYTES}
TIMEOUT_SECONDS = 120.0


class PacedApp:
    """`POST /v1/completions` streams `tokens` events of EVENT_BYTES at `rate` a second, on an
    absolute schedule; `yielded_at[tag]` holds when each was yielded."""

    def __init__(self) -> None:
        self.yielded_at: dict[str, list[float]] = {}
        self.app = Starlette(routes=[Route("/v1/completions", self._stream, methods=["POST"])])

    async def _stream(self, request: Request) -> StreamingResponse:
        body = await request.json()
        return StreamingResponse(
            self._events(body["tag"], int(body["tokens"]), float(body["rate"])),
            media_type="text/event-stream",
        )

    async def _events(self, tag: str, tokens: int, rate: float) -> AsyncIterator[bytes]:
        times = self.yielded_at.setdefault(tag, [])
        start = time.monotonic()
        for index in range(tokens):
            await asyncio.sleep(max(0.0, start + index / rate - time.monotonic()))
            head = f'data: {{"id":"cmpl-{tag}","choices":[{{"text":" t{index}","pad":"'
            tail = '"}]}\n\n'
            times.append(time.monotonic())
            yield (head + "x" * (EVENT_BYTES - len(head) - len(tail)) + tail).encode()
        yield b"data: [DONE]\n\n"


def request(port: int, payload: dict[str, Any]) -> ChunkedResponse:
    body = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return ChunkedResponse(sock).start()


def finished(response: ChunkedResponse) -> ChunkedResponse:
    if not response.ended.wait(TIMEOUT_SECONDS):
        raise RuntimeError("the stream did not end")
    response.sock.close()
    return response


def arrivals_per_event(response: ChunkedResponse) -> list[float]:
    """When the client had each `data:` event whole (the chunk that completed it)."""
    arrivals: list[float] = []
    seen = b""
    for chunk, arrived in zip(response.chunks, response.arrived, strict=True):
        seen += chunk
        complete = [e for e in seen.split(b"\n\n")[:-1] if e.startswith(b"data: ")]
        arrivals += [arrived] * (len(complete) - len(arrivals))
    return arrivals


def percentiles(samples: list[float], scale: float = 1000.0) -> dict[str, float]:
    ordered = sorted(samples)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    return {
        "p50": round(cuts[49] * scale, 2),
        "p99": round(cuts[98] * scale, 2),
        "max": round(ordered[-1] * scale, 2),
    }


def paced(rate: int, setting: str, repetition: int, app: PacedApp, port: int) -> dict[str, Any]:
    tag = f"{setting}-{rate}-{repetition}"
    tokens = int(rate * PACED_SECONDS)
    response = finished(request(port, {"tag": tag, "tokens": tokens, "rate": rate}))
    arrivals = arrivals_per_event(response)[:tokens]  # [DONE] aside
    delays = [got - sent for got, sent in zip(arrivals, app.yielded_at[tag], strict=True)]
    return {"delays": delays, "writes": len(response.chunks)}


def paced_section() -> dict[str, Any]:
    app = PacedApp()
    samples: dict[tuple[int, str], list[dict[str, Any]]] = {}
    servers = {
        setting: Middleware(app.app, socket_path="/nonexistent/kvwatch.sock", coalesce_bytes=size)
        for setting, size in SETTINGS.items()
    }
    with serving("uvicorn", servers["off"]) as off, serving("uvicorn", servers["on"]) as on:
        ports = {"off": off.port, "on": on.port}
        for repetition in range(REPETITIONS):
            for rate in RATES:
                for setting, port in ports.items():
                    run = paced(rate, setting, repetition, app, port)
                    samples.setdefault((rate, setting), []).append(run)
    for middleware in servers.values():
        middleware.close()
    rows = []
    for (rate, setting), runs in samples.items():
        delays = [delay for run in runs for delay in run["delays"]]
        rows.append(
            {
                "tokens_per_second": rate,
                "coalescing": setting,
                "delivery_delay_ms": percentiles(delays),
                "writes_per_stream": statistics.median(run["writes"] for run in runs),
                "tokens_per_stream": int(rate * PACED_SECONDS),
            }
        )
    return {"event_bytes": EVENT_BYTES, "rows": rows}


def engine_run(server: EngineServer) -> dict[str, Any]:
    payload = {"prompt": "coalesce", "max_tokens": ENGINE_TOKENS, "stream": True}
    started = time.monotonic()
    response = finished(request(server.address[1], payload))
    gaps = [b - a for a, b in zip(response.arrived, response.arrived[1:], strict=False)]
    return {"gaps": gaps, "writes": len(response.chunks), "done": response.arrived[-1] - started}


def engine_section() -> dict[str, Any]:
    servers = {}
    for setting, size in SETTINGS.items():
        config = EngineConfig(model_size="tiny", device="cpu", kv_blocks=256, coalesce_bytes=size)
        servers[setting] = EngineServer(Engine(config), "127.0.0.1", 0)
        servers[setting].start_in_thread()
    runs: dict[str, list[dict[str, Any]]] = {setting: [] for setting in SETTINGS}
    try:
        for _ in range(REPETITIONS):
            for setting, server in servers.items():
                runs[setting].append(engine_run(server))
    finally:
        for server in servers.values():
            server.stop()
    return {
        "model": "tiny",
        "tokens": ENGINE_TOKENS,
        "rows": [
            {
                "coalescing": setting,
                "chunk_gap_ms": percentiles([gap for run in setting_runs for gap in run["gaps"]]),
                "writes_per_stream": statistics.median(run["writes"] for run in setting_runs),
                "done_seconds": round(statistics.median(run["done"] for run in setting_runs), 3),
            }
            for setting, setting_runs in runs.items()
        ],
    }


def main() -> None:
    payload = {
        "coalesce_bytes": DEFAULT_COALESCE_BYTES,
        "coalesce_ms": DEFAULT_COALESCE_MS,
        "repetitions": REPETITIONS,
        "paced_through_the_middleware": paced_section(),
        "reference_engine_full_speed": engine_section(),
    }
    path = write_result("coalesce", payload)
    print(path.read_text())


if __name__ == "__main__":
    main()

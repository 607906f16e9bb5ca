"""Benchmark-only load shapes on top of kvwatch.lab.harness.stack: stalled clients that arrive
at random times rather than all together."""

from __future__ import annotations

import asyncio
import random
import socket

import httpx

from kvwatch.lab.loadgen.clients import Behaviour, Connection, stream_request
from kvwatch.lab.loadgen.http import Target, completion_body
from kvwatch.lab.loadgen.report import ClassStats, Outcome

STALLED_RCVBUF_BYTES = 4096
MAX_STALLED_IN_FLIGHT = 32


def engine_connection(engine_url: str, prompt: str, max_tokens: int) -> Connection:
    """What the load generator's clients need to send completions to the engine."""
    target = Target.parse(engine_url)
    model = httpx.get(f"{engine_url}/v1/models", timeout=5.0).json()["data"][0]["id"]
    return Connection(
        socket.AF_INET,
        (target.host, target.port),
        target,
        target.path("completions"),
        completion_body("completions", model, prompt, max_tokens),
        "completions",
    )


async def stall_arrivals(
    conn: Connection,
    seconds: float,
    per_second: float,
    seed: int = 0,
    rcvbuf_bytes: int = STALLED_RCVBUF_BYTES,
) -> ClassStats:
    """Stalled clients arriving at random (a Poisson process of `per_second`) for `seconds`:
    each sends one request, reads its first token, then stops reading and waits for the reset
    that ends it, with an SO_RCVBUF of `rcvbuf_bytes` (0: the kernel's default). At most
    MAX_STALLED_IN_FLIGHT are open at once; the rest are not started."""
    rng = random.Random(seed)
    stats = ClassStats("stalled", 0)
    behaviour = Behaviour(stall_after_tokens=1, rcvbuf_bytes=rcvbuf_bytes)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    tasks: set[asyncio.Task[Outcome]] = set()
    while loop.time() < deadline:
        if len(tasks) < MAX_STALLED_IN_FLIGHT:
            task = asyncio.create_task(stream_request(conn, stats, behaviour))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.sleep(rng.expovariate(per_second))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return stats

"""`kvwatch engine`: run the reference inference engine."""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from kvwatch.cli.ranges import NumberRange
from kvwatch.hook.asgi_coalesce import DEFAULT_COALESCE_BYTES, DEFAULT_COALESCE_MS, Coalescing
from kvwatch.lab.engine.config import (
    DEFAULT_MODEL_SIZE,
    DEFAULT_SNDBUF_BYTES,
    DEVICES,
    DTYPES,
    EGRESS_MODES,
    MODEL_SHAPES,
    EngineConfig,
)

if TYPE_CHECKING:
    from kvwatch.lab.engine.engine_server import EngineServer

# Options that configure the HTTP server and the hook; all others are EngineConfig fields.
_SERVER_OPTIONS = ("host", "port", "sndbuf_bytes", "kvwatch_socket", "no_kvwatch_hook", "log_level")
# torch.manual_seed's range.
SEEDS = click.IntRange(-(1 << 63), (1 << 64) - 1)
MAX_SOCKET_BUFFER = (1 << 31) - 1  # SO_SNDBUF is a C int


@click.command("engine")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="TCP port; 0 picks a free one.",
)
@click.option(
    "--model-size",
    type=click.Choice(sorted(MODEL_SHAPES)),
    default=DEFAULT_MODEL_SIZE,
    show_default=True,
    help="Transformer size (random weights): tiny 2x128, small 4x256, medium 8x512.",
)
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    default="auto",
    show_default=True,
    help="auto: CUDA when torch sees a GPU, else CPU.",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default="auto",
    show_default=True,
    help="auto: bfloat16 on CUDA, float32 on CPU.",
)
@click.option(
    "--seed", type=SEEDS, default=0, show_default=True, help="Seed of the random weights."
)
@click.option(
    "--cpu-threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="torch threads on CPU. 1 leaves a core to the HTTP server and beats 2 on a busy "
    "2-core machine.",
)
@click.option(
    "--kv-blocks",
    type=click.IntRange(min=1),
    default=None,
    help="KV pool size in blocks. Default: --kv-fraction of free GPU memory on "
    "CUDA, 2048 blocks on CPU. A small pool shows the stall quickly.",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Tokens per KV block.",
)
@click.option(
    "--kv-fraction",
    type=NumberRange(0.0, 0.95, min_open=True),
    default=0.3,
    show_default=True,
    help="Share of free GPU memory for the KV pool (CUDA).",
)
@click.option(
    "--egress",
    type=click.Choice(EGRESS_MODES),
    default="coupled",
    show_default=True,
    help="coupled: a request whose client stops reading stops advancing and KEEPS its "
    "KV blocks (the pathology kvwatch finds). decoupled: generation runs on "
    "into a host-RAM buffer and frees its KV at finish.",
)
@click.option(
    "--egress-queue-tokens",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Coupled mode: tokens a request may run ahead of its client.",
)
@click.option(
    "--pause/--no-pause",
    default=True,
    show_default=True,
    help="Let the kvwatch agent pause a request whose reader is behind (no more decode "
    "steps; it keeps its KV and its place) and release it, with the same output. The hook "
    "releases it itself when the agent's lease runs out. --no-pause: the hook does not "
    "offer it (nor parking, which needs it).",
)
@click.option(
    "--park/--no-park",
    default=True,
    show_default=True,
    help="Let the kvwatch agent park a request: its KV goes to host memory and its blocks "
    "back to the pool; once released, it runs on ahead of new work, with the same output. "
    "--no-park: the hook does not offer it.",
)
@click.option(
    "--coalesce-bytes",
    type=click.IntRange(min=0),
    default=DEFAULT_COALESCE_BYTES,
    show_default=True,
    help="Gather a stream's SSE events (after its first token) into writes of this size, "
    "so a reader that stops shows as a closing TCP window. 0: one write per batch of tokens.",
)
@click.option(
    "--coalesce-ms",
    type=click.IntRange(min=0),
    default=DEFAULT_COALESCE_MS,
    show_default=True,
    help="Write what gathered this long after its first token, full or not. 0: coalescing off.",
)
@click.option(
    "--max-running",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Requests in the running batch at most.",
)
@click.option(
    "--max-waiting",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Waiting queue bound; beyond it requests get HTTP 503.",
)
@click.option(
    "--max-tokens-limit",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="Largest max_tokens a request may ask for.",
)
@click.option(
    "--sndbuf-bytes",
    type=click.IntRange(0, MAX_SOCKET_BUFFER),
    default=DEFAULT_SNDBUF_BYTES,
    show_default=True,
    help="SO_SNDBUF of each client connection (0: kernel default, autotuned to "
    "megabytes). Small buffers make a stalled client block the server's writes "
    "after kilobytes rather than megabytes.",
)
@click.option(
    "--kvwatch-socket",
    metavar="PATH",
    default=None,
    help="The kvwatch agent's engine socket. Default: $KVWATCH_ENGINE_SOCKET, else "
    "/run/kvwatch/engine.sock.",
)
@click.option("--no-kvwatch-hook", is_flag=True, help="Do not talk to the kvwatch agent at all.")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="warning",
    show_default=True,
    help="uvicorn and engine log level.",
)
def command(**options: Any) -> None:
    """Run the reference inference engine: a small torch transformer with random weights,
    a paged KV cache, continuous batching and an OpenAI-compatible streaming API.

    \b
    Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
    (stream: true gives SSE chunks ending in `data: [DONE]`), GET /v1/requests (live and
    recently finished requests, with tokens generated and taken by their writers),
    GET /metrics, GET /health.

    \b
    Try it:
      kvwatch engine --kv-blocks 256 &
      curl -N localhost:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"prompt": "hello", "max_tokens": 32, "stream": true}'

    With the hook on (the default) the engine tells a kvwatch agent about each stream and
    its KV blocks, and the agent can cancel a stalled stream: the engine frees its blocks and
    resets the client's connection. It can also pause a stream whose reader is behind
    (unless --no-pause) and park one (unless --no-park): its blocks are freed, the
    connection stays, and the stream runs on when released. Without an agent it runs
    normally. Stops on Ctrl-C/SIGTERM.
    """
    # torch and uvicorn load only when the engine runs, so `kvwatch --help` stays quick.
    from kvwatch.lab.engine.engine import Engine
    from kvwatch.lab.engine.engine_server import EngineServer, attach_hook

    logging.basicConfig(
        level=options["log_level"].upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    engine = Engine(EngineConfig(**{k: v for k, v in options.items() if k not in _SERVER_OPTIONS}))
    hook = None if options["no_kvwatch_hook"] else attach_hook(engine, options["kvwatch_socket"])
    server = EngineServer(
        engine,
        options["host"],
        options["port"],
        sndbuf_bytes=options["sndbuf_bytes"],
        hook=hook,
        log_level=options["log_level"],
    )

    def request_stop(signum: int, frame: FrameType | None) -> None:
        server.stop()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    _describe(server, options["sndbuf_bytes"])
    server.run()
    click.echo("kvwatch engine: stopped", err=True)


def _describe(server: EngineServer, sndbuf_bytes: int) -> None:
    """Where the engine listens and what its KV pool is, on stderr."""
    desc = server.engine.description
    lines = [
        f"kvwatch engine: serving {desc.model} on {server.url}",
        f"  device {desc.device}, {desc.dtype}, egress {desc.egress}, "
        f"max context {desc.max_model_len} tokens",
        f"  KV pool: {desc.kv_blocks_total} blocks x {desc.block_size} tokens, "
        f"{desc.bytes_per_block} bytes per block, {desc.kv_bytes_total / 2**20:.1f} MiB in all",
        "  connection send buffer: "
        + (f"{sndbuf_bytes} bytes" if sndbuf_bytes else "kernel default"),
        f"  SSE writes: {_coalescing(server.engine.config.coalescing)}",
    ]
    socket_path = getattr(server.hook, "socket_path", None)
    if socket_path is None:
        lines.append("  kvwatch hook: off")
    else:
        lines.append(f"  kvwatch hook: agent socket {socket_path} (runs normally without an agent)")
    click.echo("\n".join(lines), err=True)


def _coalescing(coalescing: Coalescing) -> str:
    if not coalescing.enabled:
        return "one per batch of tokens (coalescing off)"
    return f"coalesced up to {coalescing.coalesce_bytes} bytes or {coalescing.coalesce_ms} ms"

"""`kvwatch run`: the agent daemon."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import socket

import click

from kvwatch.api.api_server import ApiServer
from kvwatch.api.routes import build_app
from kvwatch.cli.options import collector_flags, collector_options, load_with_flags, setting_option
from kvwatch.daemon.daemon import Daemon
from kvwatch.daemon.logrepeat import RepeatFilter
from kvwatch.daemon.preflight import check_before_start, raise_descriptor_limit
from kvwatch.tools.sdnotify import Watchdog, notify

log = logging.getLogger("kvwatch")
M_ARENA_MAX = -8


def one_malloc_arena() -> None:
    """glibc gives each thread that allocates its own malloc arena; the collector thread's
    would keep ~10 MB freed after loading BPF. One arena is enough for this process."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):
        libc.mallopt(M_ARENA_MAX, 1)


async def serve(daemon: Daemon, listener: socket.socket) -> None:
    """Runs the daemon and its HTTP API (on `listener`, bound) until SIGINT/SIGTERM."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, daemon.stop)
    server = ApiServer(build_app(daemon, daemon.registry), listener)
    try:
        await daemon.start()
        await server.start()
        host, port = server.address
        log.info(
            "kvwatch agent ready: mode=%s, http://%s:%d, engine hook %s",
            daemon.config.policy.mode,
            host,
            port,
            daemon.config.hook.socket,
        )
        backend = daemon.opened.backend if daemon.opened is not None else "none"
        notify(
            f"READY=1\nSTATUS=watching streams, collector {backend}, "
            f"mode {daemon.config.policy.mode}"
        )
        watchdog = Watchdog.from_env()
        pinging = asyncio.create_task(watchdog.run()) if watchdog is not None else None
        await daemon.run()
        notify("STOPPING=1")
        if pinging is not None:
            pinging.cancel()
    finally:
        await server.close()
        await daemon.close()


@click.command("run")
@click.option(
    "--config",
    "config_path",
    metavar="FILE",
    default=None,
    help="TOML config file (see docs/configuration.md): a regular file of at most 1 MiB. "
    "Flags override it, and KVWATCH_* environment variables sit in between.",
)
@click.option(
    "--mode",
    type=click.Choice(["observe", "enforce"]),
    default=None,
    help="observe (default): decide and log, touch nothing. enforce: act.",
)
@click.option(
    "--action",
    "actions",
    type=click.Choice(["cancel", "reset"]),
    multiple=True,
    help="What to do to a stalled stream (repeatable): cancel through the engine "
    "hook (frees its KV), reset its TCP connection (SOCK_DESTROY).",
)
@setting_option(
    "--min-kv-bytes",
    key="policy.min_kv_bytes",
    metavar="BYTES",
    default=None,
    help="Act only on requests holding at least this much KV cache.",
)
@setting_option(
    "--grace-seconds",
    key="policy.grace_seconds",
    metavar="SECONDS",
    default=None,
    help="Never act on a stream younger than this.",
)
@click.option(
    "--pause",
    type=click.Choice(["on", "off"]),
    default=None,
    help="Pause (on, default): an engine that can pause stops decoding for a stream whose "
    "reader is --pause-seconds of its output behind, and decodes on once the reader is back "
    "under --release-seconds. Not a byte of the stream changes.",
)
@setting_option(
    "--pause-seconds",
    key="policy.pause_seconds",
    metavar="SECONDS",
    default=None,
    help="Unread backlog, in seconds of the stream's own output, that pauses it [default: 2.0].",
)
@setting_option(
    "--release-seconds",
    key="policy.release_seconds",
    metavar="SECONDS",
    default=None,
    help="Unread backlog under which a paused or parked stream is released "
    "[default: 1.0; below --pause-seconds].",
)
@click.option(
    "--park",
    type=click.Choice(["on", "off"]),
    default=None,
    help="Park (on, default): free the KV of a stream paused for --park-seconds (or whose "
    "reader has been behind that long, where its engine cannot pause), without cutting it; "
    "it comes back when the reader catches up. Cutting still waits for the stall's proof.",
)
@setting_option(
    "--park-seconds",
    key="policy.park_seconds",
    metavar="SECONDS",
    default=None,
    help="How long a stream is paused (or its reader behind) before it is parked [default: 2.0].",
)
@setting_option(
    "--max-cancels-per-minute",
    key="policy.max_cancels_per_minute",
    metavar="N",
    default=None,
    help="Budget of actions per rolling minute.",
)
@collector_options(with_defaults=False)
@setting_option(
    "--hook-socket",
    key="hook.socket",
    metavar="PATH",
    default=None,
    help="Unix socket engines connect to [default: /run/kvwatch/engine.sock].",
)
@setting_option(
    "--allowed-uid",
    "allowed_uids",
    key="hook.allowed_uids",
    metavar="UID",
    multiple=True,
    help="uid allowed to connect as an engine (repeatable; root always is).",
)
@setting_option(
    "--listen",
    key="http.listen",
    metavar="HOST:PORT",
    default=None,
    help="HTTP API address [default: 127.0.0.1:9431].",
)
@setting_option(
    "--audit-log",
    key="audit.path",
    metavar="FILE",
    default=None,
    help="Audit log file, JSON lines [default: /var/log/kvwatch/audit.jsonl]; empty: stdout only.",
)
@click.option("-v", "--verbose", count=True, help="More log detail (-vv: libbpf's too).")
def command(
    config_path: str | None,
    mode: str | None,
    actions: tuple[str, ...],
    min_kv_bytes: int | None,
    grace_seconds: float | None,
    pause: str | None,
    pause_seconds: float | None,
    release_seconds: float | None,
    park: str | None,
    park_seconds: float | None,
    max_cancels_per_minute: int | None,
    ports: tuple[int, ...],
    pid: int | None,
    backend: str | None,
    send_mode: str | None,
    max_sockets: int | None,
    stall_seconds: float | None,
    min_reader_rate: int | None,
    procfs_root: str | None,
    hook_socket: str | None,
    allowed_uids: tuple[int, ...],
    listen: str | None,
    audit_log: str | None,
    verbose: int,
) -> None:
    """Run the agent: watch streams, join them with engine requests, act on stalls.

    \b
    Every decision goes to the audit log with its evidence. Nothing is touched unless
    --mode enforce is given (or policy.mode = "enforce" in the config).

    \b
    Examples:
      kvwatch run --port 8000                         observe the engine on port 8000
      kvwatch run --port 8000 --mode enforce --action cancel
      kvwatch run --port 8000 --mode enforce --pause-seconds 3 --park-seconds 1.5
      kvwatch run --config /etc/kvwatch/kvwatch.toml
    """
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RepeatFilter())  # on our handler only, never on one a host process set up
    logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.INFO, handlers=[handler])
    if verbose < 2:
        logging.getLogger("kvwatch.libbpf").setLevel(logging.WARNING)
    flags = {
        "policy.mode": mode,
        "policy.actions": actions or None,
        "policy.min_kv_bytes": min_kv_bytes,
        "policy.grace_seconds": grace_seconds,
        "policy.pause": pause,
        "policy.pause_seconds": pause_seconds,
        "policy.release_seconds": release_seconds,
        "policy.park": park,
        "policy.park_seconds": park_seconds,
        "policy.max_cancels_per_minute": max_cancels_per_minute,
        **collector_flags(
            ports, pid, backend, send_mode, max_sockets, stall_seconds, min_reader_rate, procfs_root
        ),
        "hook.socket": hook_socket,
        "hook.allowed_uids": allowed_uids or None,
        "http.listen": listen,
        "audit.path": audit_log,
    }
    config = load_with_flags(config_path, flags)
    listener = check_before_start(config)
    raise_descriptor_limit()
    one_malloc_arena()
    asyncio.run(serve(Daemon(config), listener))

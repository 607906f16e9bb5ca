"""`kvwatch sockets`: per-socket send backpressure, live from the kernel."""

from __future__ import annotations

import json
import time

import click
from rich.console import Console
from rich.live import Live

from kvwatch.cli.options import (
    announce_collector,
    collector_options,
    collector_settings,
    state_filter_option,
    state_policy,
)
from kvwatch.collect import open_collector
from kvwatch.sockets import SocketSample
from kvwatch.states import StatePolicy, classify
from kvwatch.views import socket_json, sockets_table


@click.command("sockets")
@collector_options()
@state_filter_option()
@click.option("--json", "as_json", is_flag=True, help="Print the JSON contract (an array).")
@click.option("--watch", is_flag=True, help="Refresh until interrupted (Ctrl-C).")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
)
@click.option(
    "--settle",
    type=click.FloatRange(min=0),
    default=0.5,
    show_default=True,
    help="Seconds to observe before the first report (lets BPF see live sockets).",
)
def command(
    ports: tuple[int, ...],
    pid: int | None,
    backend: str,
    send_hook: str,
    max_sockets: int,
    stall_seconds: float,
    min_reader_rate: int,
    procfs_root: str,
    states: tuple[str, ...],
    as_json: bool,
    watch: bool,
    interval: float,
    settle: float,
) -> None:
    """Show each TCP socket's send backpressure and stream state.

    \b
    States: healthy, slow (queue mostly full or window touching zero, ACKs still moving),
    zero_window (peer window 0 now), stalled (data pending, no ACK progress, window 0 or
    send buffer full, for --stall-seconds). Only `stalled` is ever acted on.

    \b
    Examples:
      kvwatch sockets --port 8000                  what the engine's clients are doing
      kvwatch sockets --port 8000 --state stalled --json | jq '.[].remote'
      kvwatch sockets --watch --interval 0.5       live view
    """
    settings = collector_settings(ports, pid, send_hook, max_sockets)
    policy = state_policy(stall_seconds, min_reader_rate)
    opened = open_collector(settings, backend, procfs_root)
    announce_collector(opened.note)
    try:
        time.sleep(settle)
        if watch and not as_json:
            with Live(console=Console(), auto_refresh=False) as live:
                while True:
                    samples, now_ns = _filtered(opened.collector.samples(), states, policy)
                    live.update(sockets_table(samples, now_ns, policy), refresh=True)
                    time.sleep(interval)
        while True:
            samples, now_ns = _filtered(opened.collector.samples(), states, policy)
            if as_json:
                rows = [socket_json(s, now_ns, policy) for s in samples]
                click.echo(json.dumps(rows, indent=None if watch else 2))
            else:
                Console().print(sockets_table(samples, now_ns, policy))
            if not watch:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return
    finally:
        opened.collector.close()


def _filtered(
    samples: list[SocketSample], states: tuple[str, ...], policy: StatePolicy
) -> tuple[list[SocketSample], int]:
    now_ns = time.monotonic_ns()
    if states:
        samples = [s for s in samples if classify(s, now_ns, policy).value in states]
    return samples, now_ns

"""`kvwatch sockets`: per-socket send backpressure, live from the kernel."""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import click
from rich.console import Console
from rich.live import Live

from kvwatch.cli.options import (
    agent_url_option,
    announce_collector,
    collector_flags,
    collector_options,
    load_with_flags,
    state_filter_option,
)
from kvwatch.cli.ranges import MAX_WAIT_SECONDS, NumberRange
from kvwatch.collect.collectors import OpenedCollector, open_collector
from kvwatch.sockets import Endpoint
from kvwatch.streams.states import StallThresholds
from kvwatch.streams.view import socket_json
from kvwatch.tools.client import AgentUnreachableError, get_json, reading_answer
from kvwatch.tools.tables import sockets_table

AGENT_TIMEOUT_SECONDS = 2.0


@click.command("sockets")
@collector_options(with_defaults=False)
@state_filter_option()
@click.option("--json", "as_json", is_flag=True, help="Print the JSON contract (an array).")
@click.option("--watch", is_flag=True, help="Refresh until interrupted (Ctrl-C).")
@click.option(
    "--interval",
    type=NumberRange(min=0.05, max=MAX_WAIT_SECONDS),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
)
@agent_url_option(
    "The agent to ask first: when one answers, its view is shown (it has each socket's "
    "history and the policy's settings); the collector options then do not apply."
)
@click.option(
    "--standalone",
    is_flag=True,
    help="Never ask an agent: load a collector in this process and read the kernel.",
)
@click.option(
    "--settle",
    type=NumberRange(min=0, max=MAX_WAIT_SECONDS),
    default=0.5,
    show_default=True,
    help="Seconds to observe before the first report (lets BPF see live sockets).",
)
def command(
    ports: tuple[int, ...],
    pid: int | None,
    backend: str | None,
    send_mode: str | None,
    max_sockets: int | None,
    stall_seconds: float | None,
    min_reader_rate: int | None,
    procfs_root: str | None,
    states: tuple[str, ...],
    as_json: bool,
    watch: bool,
    interval: float,
    url: str,
    standalone: bool,
    settle: float,
) -> None:
    """Show each TCP socket's send backpressure and stream state.

    \b
    States: healthy, slow (queue mostly full or window touching zero, ACKs still moving),
    zero_window (peer window 0 now), stalled (data pending, no ACK progress, window 0 or
    send buffer full, for --stall-seconds and as long as --min-reader-rate requires; an
    old stall is dated from the kernel's own timers). Only `stalled` is ever acted on.
    When an agent answers at --url its view is shown, else this process reads the kernel;
    the first line on stderr says which.

    \b
    Examples:
      kvwatch sockets --port 8000                  what the engine's clients are doing
      kvwatch sockets --port 8000 --state stalled --json | jq '.[].remote'
      kvwatch sockets --watch --interval 0.5       live view
    """
    source: AgentRows | KernelRows | None = (
        None if standalone else AgentRows.reached(url, ports, pid)
    )
    if source is None:
        flags = collector_flags(
            ports, pid, backend, send_mode, max_sockets, stall_seconds, min_reader_rate, procfs_root
        )
        config = load_with_flags(None, flags)
        opened = open_collector(
            config.collector.settings(), config.collector.backend, config.path.procfs
        )
        source = KernelRows(opened, StallThresholds.of_policy(config.policy))
        time.sleep(settle)
    announce_collector(source.note)
    try:
        with source.reading():
            show(source, states, as_json, watch, interval)
    except KeyboardInterrupt:
        return
    finally:
        source.close()


def show(
    source: AgentRows | KernelRows,
    states: tuple[str, ...],
    as_json: bool,
    watch: bool,
    interval: float,
) -> None:
    """The rows once, or every `interval` seconds with --watch: a table, or JSON."""
    if watch and not as_json:
        with Live(console=Console(), auto_refresh=False) as live:
            while True:
                live.update(sockets_table(_filtered(source.rows(), states)), refresh=True)
                time.sleep(interval)
    while True:
        rows = _filtered(source.rows(), states)
        if as_json:
            click.echo(json.dumps(rows, indent=None if watch else 2))
        else:
            Console().print(sockets_table(rows))
        if not watch:
            return
        time.sleep(interval)


def _filtered(rows: list[dict[str, Any]], states: tuple[str, ...]) -> list[dict[str, Any]]:
    return [row for row in rows if not states or row["state"] in states]


class KernelRows:
    """This process's own collector; owns it."""

    def __init__(self, opened: OpenedCollector, thresholds: StallThresholds) -> None:
        self.opened = opened
        self.thresholds = thresholds
        self.note = f"view: this process, {opened.note}"

    def rows(self) -> list[dict[str, Any]]:
        samples = self.opened.collector.samples()
        now_ns = time.monotonic_ns()
        return [socket_json(sample, now_ns, self.thresholds) for sample in samples]

    def reading(self) -> AbstractContextManager[None]:
        """Rows this process built itself need no guard."""
        return nullcontext()

    def close(self) -> None:
        self.opened.collector.close()


class AgentRows:
    """A running agent's view (/api/v1/sockets), filtered like the collector would be."""

    def __init__(self, url: str, ports: tuple[int, ...], pid: int | None) -> None:
        self.url = url
        self.ports = set(ports)
        self.pid = pid
        self.note = f"view: the agent at {url} (it has each socket's history)"

    @classmethod
    def reached(cls, url: str, ports: tuple[int, ...], pid: int | None) -> AgentRows | None:
        """The agent's view when an agent answers at `url` right now, else None. Something
        that answers but is no kvwatch agent is an error, not a reason to read the kernel."""
        source = cls(url, ports, pid)
        try:
            with source.reading():
                source.rows()
        except AgentUnreachableError:
            return None
        return source

    def rows(self) -> list[dict[str, Any]]:
        rows: list[Any] = get_json(self.url, "/api/v1/sockets", AGENT_TIMEOUT_SECONDS, list)
        return [
            row
            for row in rows
            if (not self.ports or Endpoint.parse(row["local"]).port in self.ports)
            and (not self.pid or row["pid"] == self.pid)
        ]

    def reading(self) -> AbstractContextManager[None]:
        """What a malformed answer makes the code that reads it raise becomes one error."""
        return reading_answer(self.url)

    def close(self) -> None:
        pass

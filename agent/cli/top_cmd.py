"""`kvwatch top`: the streams the agent watches, live, worst first."""

from __future__ import annotations

import sys
import time
from contextlib import AbstractContextManager, nullcontext

import click
from rich.console import Console

from kvwatch.cli.options import (
    agent_url_option,
    announce_collector,
    collector_flags,
    collector_options,
    load_with_flags,
    state_filter_option,
)
from kvwatch.cli.ranges import MAX_WAIT_SECONDS, NumberRange
from kvwatch.streams.states import StallThresholds
from kvwatch.tools.client import reading_answer
from kvwatch.top.app import print_frame, run_live, run_piped
from kvwatch.top.model import SORT_KEYS, RowFilter
from kvwatch.top.sources import DaemonSource, FrameSource, StandaloneSource


@click.command("top")
@agent_url_option("The agent's HTTP API to read streams, health and metrics from.")
@click.option(
    "--standalone",
    is_flag=True,
    help="Load the socket collector in this process instead (no daemon needed; no engine "
    "join, so no request IDs or KV). --backend, --send-mode, --max-sockets and "
    "--stall-seconds apply only here.",
)
@collector_options(with_defaults=False)
@state_filter_option()
@click.option(
    "--sort", type=click.Choice(SORT_KEYS), default="stuck", show_default=True, help="Row order."
)
@click.option("--once", is_flag=True, help="Print one frame and exit (for scripts).")
@click.option(
    "--interval",
    type=NumberRange(min=0.1, max=MAX_WAIT_SECONDS),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@click.option(
    "--settle",
    type=NumberRange(min=0, max=MAX_WAIT_SECONDS),
    default=1.0,
    show_default=True,
    help="With --standalone: seconds to observe before the first frame.",
)
def command(
    url: str,
    standalone: bool,
    ports: tuple[int, ...],
    pid: int | None,
    backend: str | None,
    send_mode: str | None,
    max_sockets: int | None,
    stall_seconds: float | None,
    min_reader_rate: int | None,
    procfs_root: str | None,
    states: tuple[str, ...],
    sort: str,
    once: bool,
    interval: float,
    settle: float,
) -> None:
    """Live view of every stream: state, send queue, peer window, request and KV held.

    \b
    Header: HBM used/total per GPU, KV held by stalled streams, cancels per minute, the
    mode each BPF attach point attached with, and the policy mode (observe/enforce).
    Rows: PID/COMM, CONNECTION (:local port→remote), REQUEST, STATE, FILL (send queue
    % of the send buffer), RWND (peer window), ZW (current zero-window time),
    NSENT/UNACK (bytes not sent / sent, unacknowledged), SRTT, KV (blocks/size), AGE.
    Columns are dropped, least important first, to fit the terminal width.
    --port (either end of the connection), --pid and --state filter the rows.

    \b
    Keys (on a terminal):
      s  next sort (stuck, state, kv, fill, age, port, pid)   r  reverse the order
      t  next state filter (stalled, zero_window, ... , all)  c  clear the filters
      p  filter by port: digits, then Enter (empty clears)    q  quit (or Ctrl-C)
      i  filter by pid: digits, then Enter

    \b
    Piped (not a terminal) it prints plain frames, no control codes; --once prints one.
    Examples:
      kvwatch top                               the local agent, live
      kvwatch top --state stalled --once        what is stalled now, for a script
      kvwatch top --standalone --port 8000      no agent running on this node
    """
    view = RowFilter(ports=tuple(ports), pid=pid, states=tuple(states), sort=sort)
    console = Console()
    source: FrameSource
    reading: AbstractContextManager[None] = nullcontext()
    if standalone:
        flags = collector_flags(
            ports, pid, backend, send_mode, max_sockets, stall_seconds, min_reader_rate, procfs_root
        )
        config = load_with_flags(None, flags)
        standalone_source = StandaloneSource(
            config.collector.settings(),
            config.collector.backend,
            config.path.procfs,
            StallThresholds.of_policy(config.policy),
        )
        announce_collector(standalone_source.note)
        source = standalone_source
        time.sleep(settle)
    else:
        source = DaemonSource(url)
        reading = reading_answer(url)  # a frame the agent's answer cannot be drawn into
    try:
        with reading:
            if once:
                print_frame(source, view, console)
            elif console.is_terminal and sys.stdin.isatty():
                run_live(source, view, console, interval)
            else:
                run_piped(source, view, console, interval)
    except KeyboardInterrupt:
        return
    finally:
        source.close()

"""`kvwatch streams`: the running agent's streams, joined with engine requests."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvwatch.cli.options import agent_url_option, state_filter_option
from kvwatch.streams.states import StreamState
from kvwatch.tools.client import get_json, reading_answer
from kvwatch.tools.tables import STATE_STYLES, kv_text, state_label


@click.command("streams")
@agent_url_option("The agent's HTTP API.")
@state_filter_option()
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the JSON contract: the `sockets` fields plus request_id, engine, "
    "engine_pid, kv_blocks, kv_bytes (kv_estimated: true when the engine hook "
    "estimated it), gpu.",
)
def command(url: str, states: tuple[str, ...], as_json: bool) -> None:
    """List the streams the agent sees, with the engine request and KV behind each.

    \b
    VIA names the proxy that relays a client socket (nginx[812]): the engine request behind
    it is found through the proxy's upstream connection. STUCK is the time without ACK
    progress; STALL/NEEDED how long the stall conditions have
    held and how long the judge requires before it calls the stream stalled (derived per
    socket from --min-reader-rate and the kernel's evidence; docs/collector.md)."""
    answer: list[Any] = get_json(url, "/api/v1/streams", shape=list)
    with reading_answer(url):
        rows = [row for row in answer if not states or row["state"] in states]
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        print_streams(rows)


def print_streams(rows: list[dict[str, Any]]) -> None:
    """The streams as a table; what engines sent (request ids) is shown as plain text, never
    read as markup."""
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    for header in ("REQUEST", "CLIENT", "VIA", "STATE", "KV", "STUCK", "STALL/NEEDED"):
        table.add_column(header, no_wrap=True)
    for row in rows:
        state = StreamState(row["state"])
        table.add_row(
            Text(str(row["request_id"] or "-")),
            Text(str(row["remote"])),
            Text(via_text(row)),
            Text(state_label(row), style=STATE_STYLES[state]),
            kv_text(row),
            f"{row['no_progress_seconds']:.1f}s",
            stall_text(row),
        )
    Console().print(table)


def via_text(row: dict[str, Any]) -> str:
    """The proxy a client socket is relayed by: `nginx[812]`, with the link's status when it
    joined no request ("-" for a socket the engine announced itself)."""
    relay = row.get("relay")
    if not relay:
        return "-"
    via = f"{relay['comm']}[{relay['pid']}]"
    return via if relay["status"] == "joined" else f"{via} {relay['status']}"


def stall_text(row: dict[str, Any]) -> str:
    required = row.get("stall_required_seconds")
    if required is None:
        return "-"
    return f"{row['stalled_seconds']:.1f}/{required:.1f}s"

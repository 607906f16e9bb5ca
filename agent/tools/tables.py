"""How streams and sockets read for people: sizes, states in colour, the `sockets` table.
Built from the JSON rows of kvwatch.streams.view, so a table and `--json` never disagree."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from kvwatch.sockets import Endpoint
from kvwatch.streams.states import StreamState

STATE_STYLES = {
    StreamState.HEALTHY: "green",
    StreamState.SLOW: "yellow",
    StreamState.ZERO_WINDOW: "magenta",
    StreamState.STALLED: "bold red",
    StreamState.CANCELLED: "cyan",
    StreamState.CLOSED: "dim",
}


def state_label(row: dict[str, Any]) -> str:
    """The stream's state, whether its request is parked (its KV freed, the request kept),
    paused (no decode steps, its KV kept) or detached (its output buffered on the host), and
    whether its action failed on every try (`action_failed`)."""
    state = str(row.get("state", "?"))
    marks = [
        mark
        for key, mark in (
            ("parked", "parked"),
            ("paused", "paused"),
            ("detached", "detached"),
            ("action_failed", "action failed"),
        )
        if row.get(key) and not (key == "paused" and row.get("parked"))
    ]
    return f"{state} ({', '.join(marks)})" if marks else state


def human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "K", "M", "G"):
        if abs(value) < 1024 or unit == "G":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}G"


ESTIMATE_MARK = " (est.)"


def behind_text(row: dict[str, Any]) -> str:
    """What the stream's reader has not read: seconds of its output where the agent measured
    its rate, else bytes; "-" when nothing is unread."""
    backlog = row.get("backlog")
    if not isinstance(backlog, dict) or not backlog.get("bytes"):
        return "-"
    seconds = backlog.get("seconds")
    if isinstance(seconds, int | float):
        return f"{seconds:.1f}s"
    return human_bytes(int(backlog["bytes"]))


def kv_text(row: dict[str, Any]) -> str:
    """A stream row's KV bytes for people: "-" when unknown, marked when an estimate."""
    kv_bytes = row.get("kv_bytes")
    if not isinstance(kv_bytes, int):
        return "-"
    return human_bytes(kv_bytes) + (ESTIMATE_MARK if row.get("kv_estimated") else "")


def sockets_table(rows: list[dict[str, Any]]) -> Table:
    """`socket_json` rows as a table that fits 80 columns: the local side shows only its port
    (the server's, usually); ZW is the current zero-window episode, BEHIND what the reader
    has not read (`behind_text`) and STUCK the time without ACK progress, in seconds."""
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    for header, justify in (
        ("PID/COMM", "left"),
        ("CONNECTION", "left"),
        ("STATE", "left"),
        ("FILL", "right"),
        ("RWND", "right"),
        ("ZW", "right"),
        ("PEND", "right"),
        ("BEHIND", "right"),
        ("STUCK", "right"),
    ):
        table.add_column(header, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in sorted(rows, key=lambda r: -float(r["no_progress_seconds"])):
        state = StreamState(row["state"])
        owner = f"{row['pid']}/{row['comm']}" if row["pid"] else "-"
        rwnd = human_bytes(row["peer_rwnd"]) if row["peer_rwnd"] >= 0 else "?"
        fill = row["wmem_queued"] / row["sndbuf"] if row["sndbuf"] > 0 else 0.0
        table.add_row(  # process names and addresses as plain text, never read as markup
            Text(owner[:12]),
            Text(f":{Endpoint.parse(row['local']).port} → {row['remote']}"),
            Text(state.value, style=STATE_STYLES[state]),
            f"{fill:.0%}",
            rwnd,
            f"{row['zero_window_seconds']:.1f}",
            human_bytes(row["notsent_bytes"] + row["unacked_bytes"]),
            behind_text(row),
            f"{row['no_progress_seconds']:.1f}",
        )
    return table

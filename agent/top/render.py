"""A frame as rich renderables: a header, one row per stream, a footer; fitted to a width.

Columns are dropped, least important first, until the table fits the terminal (80 columns
keep state, connection, request, KV, owner and the window/queue basics). Styles are only
emitted on a terminal: rich prints plain text when output is piped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvwatch.streams.states import StreamState
from kvwatch.tools.tables import (
    ESTIMATE_MARK,
    STATE_STYLES,
    behind_text,
    human_bytes,
    state_label,
)
from kvwatch.top.model import Frame, Header, Row, RowFilter, fill_fraction

COLUMN_GAP = 1
POINT_ABBREVIATIONS = {"zero_window_probe": "zw_probe"}
STYLE_OF_STATE = {state.value: style for state, style in STATE_STYLES.items()}


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _seconds(value: object) -> str:
    if not isinstance(value, int | float) or value < 0:
        return "-"
    if value < 60:
        return f"{value:.1f}s"
    minutes, seconds = divmod(int(value), 60)
    return f"{minutes}m{seconds:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def _bytes(value: object) -> str:
    return human_bytes(value) if isinstance(value, int) and value >= 0 else "?"


def _owner(row: Row) -> str:
    pid = row.get("pid")
    return clip(f"{pid}/{row.get('comm') or '?'}", 14) if pid else "-"


def _connection(row: Row) -> str:
    local = str(row.get("local", ""))
    return clip(f":{local.rpartition(':')[2]}→{row.get('remote', '?')}", 26)


def _window(row: Row) -> str:
    return _bytes(row.get("peer_rwnd"))


def _pending(row: Row) -> str:
    return f"{_bytes(row.get('notsent_bytes'))}/{_bytes(row.get('unacked_bytes'))}"


def _srtt(row: Row) -> str:
    srtt = row.get("srtt_us")
    return f"{srtt / 1000:.1f}ms" if isinstance(srtt, int) and srtt > 0 else "-"


def _request(row: Row) -> str:
    """The request; `⇄` marks one found through a proxy (a client socket the proxy relays),
    and a relayed socket that joined none shows why (request_ended, ambiguous, no_engine)."""
    relay = row.get("relay")
    request = str(row.get("request_id") or "-")
    if not isinstance(relay, dict):
        return clip(request, 16)
    return clip(
        "⇄" + (request if relay.get("status") == "joined" else str(relay.get("status"))), 16
    )


def _kv(row: Row) -> str:
    blocks, size = row.get("kv_blocks"), row.get("kv_bytes")
    mark = ESTIMATE_MARK if row.get("kv_estimated") else ""
    return "-" if blocks is None else f"{blocks}/{_bytes(size)}{mark}"


@dataclass(frozen=True)
class Column:
    """One table column: `importance` 1 is kept longest when the width runs out."""

    header: str
    importance: int
    cell: Callable[[Row], str]
    justify: str = "right"


# Display order; importance decides what narrow terminals keep.
COLUMNS = (
    Column("PID/COMM", 6, _owner, "left"),
    Column("CONNECTION", 2, _connection, "left"),
    Column("REQUEST", 3, _request, "left"),
    Column("STATE", 1, state_label, "left"),
    Column("FILL", 7, lambda r: f"{fill_fraction(r):.0%}"),
    Column("BEHIND", 5, behind_text),
    Column("RWND", 8, _window),
    Column("ZW", 9, lambda r: _seconds(r.get("zero_window_seconds"))),
    Column("NSENT/UNACK", 11, _pending),
    Column("SRTT", 12, _srtt),
    Column("KV", 4, _kv),
    Column("AGE", 10, lambda r: _seconds(r.get("age_seconds"))),
)


def fit_columns(rows: list[list[str]], width: int) -> list[int]:
    """Indexes (in display order) of the columns to show: by importance, each one that still
    fits beside those already chosen."""
    widths = [
        max([cell_len(COLUMNS[i].header), *(cell_len(cells[i]) for cells in rows)])
        for i in range(len(COLUMNS))
    ]
    chosen: list[int] = []
    used = -COLUMN_GAP
    for index in sorted(range(len(COLUMNS)), key=lambda i: COLUMNS[i].importance):
        if used + COLUMN_GAP + widths[index] <= width:
            chosen.append(index)
            used += COLUMN_GAP + widths[index]
    return sorted(chosen)


def stream_table(rows: list[Row], width: int) -> Table:
    cells = [[column.cell(row) for column in COLUMNS] for row in rows]
    shown = fit_columns(cells, width)
    table = Table(
        box=None, pad_edge=False, padding=(0, COLUMN_GAP, 0, 0), header_style="bold", expand=False
    )
    for index in shown:
        column = COLUMNS[index]
        table.add_column(column.header, justify=column.justify, no_wrap=True)  # type: ignore[arg-type]
    for row, row_cells in zip(rows, cells, strict=True):
        state_style = STYLE_OF_STATE.get(str(row.get("state")), "")
        table.add_row(
            *(
                Text(row_cells[i], style=state_style if COLUMNS[i].header == "STATE" else "")
                for i in shown
            )
        )
    return table


def _gpu_text(header: Header) -> str:
    if header.gpus is None:
        return "HBM n/a (no NVML)"
    if not header.gpus:
        return "HBM: no GPU"
    return "HBM " + " ".join(
        f"gpu{g.gpu} {human_bytes(g.used_bytes)}/{human_bytes(g.total_bytes)}" for g in header.gpus
    )


def header_lines(header: Header, rows: list[Row], shown: int) -> list[Text]:
    stalled = sum(1 for row in rows if row.get("state") == StreamState.STALLED.value)
    parked = sum(1 for row in rows if row.get("parked"))
    paused = sum(1 for row in rows if row.get("paused") and not row.get("parked"))
    kv = header.stalled_kv_bytes
    cancels = header.cancels_per_minute
    points = " ".join(
        f"{POINT_ABBREVIATIONS.get(point, point)}={'none' if mode == 'unavailable' else mode}"
        for point, mode in header.attach_points.items()
    )
    lines = [
        Text.assemble(("kvwatch top", "bold"), f" · {header.source} · mode {header.mode}"),
        Text.assemble(
            f"streams {len(rows)} · ",
            (f"stalled {stalled}", "bold red" if stalled else ""),
            f" holding KV {'unknown' if kv is None else human_bytes(kv)} · paused {paused} · "
            f"parked {parked} · "
            f"shown {shown} · cancels/min {'-' if cancels is None else f'{cancels:.1f}'}",
        ),
        Text(_gpu_text(header)),
        Text(f"attach points {points or 'none (sock_diag polling)'}"),
    ]
    if header.error:
        lines.append(Text(header.error, style="bold red"))
    return lines


def render_frame(frame: Frame, view: RowFilter, width: int, footer: list[Text]) -> RenderableType:
    rows = view.apply(frame.rows)
    parts: list[RenderableType] = [
        *header_lines(frame.header, frame.rows, len(rows)),
        Text(view.describe(), style="dim"),
        stream_table(rows, width),
        *footer,
    ]
    return Group(*parts)

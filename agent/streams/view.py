"""How sockets are shown: the JSON contract of DESIGN.md and the table people read."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from kvwatch.sockets import Endpoint, SocketSample
from kvwatch.streams.states import StallJudgement, StatePolicy, StreamState, judge, state_of

STATE_STYLES = {
    StreamState.HEALTHY: "green",
    StreamState.SLOW: "yellow",
    StreamState.ZERO_WINDOW: "magenta",
    StreamState.STALLED: "bold red",
    StreamState.CANCELLED: "cyan",
    StreamState.CLOSED: "dim",
}


def socket_json(
    sample: SocketSample,
    now_ns: int,
    policy: StatePolicy,
    judgement: StallJudgement | None = None,
) -> dict[str, Any]:
    """One socket as the `kvwatch sockets --json` contract spells it (plus a few extras).
    `stalled_seconds` is how long every stall condition has held, `stall_required_seconds`
    how long they must hold before the socket is `stalled` (null when they do not hold), and
    `stall_evidence` what the judge based that on (docs/collector.md)."""
    verdict = judgement if judgement is not None else judge(sample, now_ns, policy)
    return {
        "local": str(sample.local),
        "remote": str(sample.remote),
        "pid": sample.pid,
        "comm": sample.comm,
        "state": state_of(sample, verdict, now_ns, policy).value,
        "wmem_queued": sample.wmem_queued,
        "sndbuf": sample.sndbuf,
        "notsent_bytes": sample.notsent_bytes,
        "unacked_bytes": sample.unacked_bytes,
        "peer_rwnd": sample.peer_rwnd,
        "srtt_us": sample.srtt_us,
        "retransmits": sample.retransmits,
        "zero_window": sample.zero_window,
        "zero_window_episodes": sample.zero_window_episodes,
        "zero_window_seconds": round(sample.zero_window_seconds(now_ns), 3),
        "sndbuf_full": sample.sndbuf_full,
        "no_progress_seconds": round(sample.no_progress_seconds(now_ns), 3),
        "stalled_seconds": round(verdict.stalled_seconds(now_ns), 3),
        "stall_required_seconds": (
            round(verdict.required_ns / 1e9, 3) if verdict.on_the_way else None
        ),
        "stall_evidence": verdict.evidence(policy),
        "source": sample.source,
        "snd_cwnd": sample.snd_cwnd,
        "zero_window_probes": sample.zero_window_probes,
        "zero_window_total_seconds": round(sample.zero_window_total_ns / 1e9, 3),
        "sndbuf_full_episodes": sample.sndbuf_full_episodes,
        "peer_rwnd_max": sample.peer_rwnd_max,
        "netns": sample.netns,
        "inode": sample.inode,
        "feeder": feeder_json(sample, now_ns),
    }


def feeder_json(sample: SocketSample, now_ns: int) -> dict[str, Any] | None:
    """The socket whose data this one relays (a proxy's upstream), or None."""
    feeder = sample.feeder
    if feeder is None:
        return None
    return {
        "local": str(feeder.local),
        "remote": str(feeder.remote),
        "feeds": feeder.feeds,
        "misses": feeder.misses,
        "fed_seconds_ago": round(sample.seconds_since(feeder.fed_ns, now_ns), 3),
    }


def human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "K", "M", "G"):
        if abs(value) < 1024 or unit == "G":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}G"


ESTIMATE_MARK = " (est.)"


def kv_text(row: dict[str, Any]) -> str:
    """A stream row's KV bytes for people: "-" when unknown, marked when an estimate."""
    kv_bytes = row.get("kv_bytes")
    if not isinstance(kv_bytes, int):
        return "-"
    return human_bytes(kv_bytes) + (ESTIMATE_MARK if row.get("kv_estimated") else "")


def sockets_table(rows: list[dict[str, Any]]) -> Table:
    """`socket_json` rows as a table that fits 80 columns: the local side shows only its port
    (the server's, usually); ZW is the current zero-window episode and STUCK the time
    without ACK progress, in seconds."""
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    for header, justify in (
        ("PID/COMM", "left"),
        ("CONNECTION", "left"),
        ("STATE", "left"),
        ("FILL", "right"),
        ("RWND", "right"),
        ("ZW", "right"),
        ("PEND", "right"),
        ("STUCK", "right"),
    ):
        table.add_column(header, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in sorted(rows, key=lambda r: -float(r["no_progress_seconds"])):
        state = StreamState(row["state"])
        owner = f"{row['pid']}/{row['comm']}" if row["pid"] else "-"
        rwnd = human_bytes(row["peer_rwnd"]) if row["peer_rwnd"] >= 0 else "?"
        fill = row["wmem_queued"] / row["sndbuf"] if row["sndbuf"] > 0 else 0.0
        table.add_row(
            owner[:12],
            f":{Endpoint.parse(row['local']).port} → {row['remote']}",
            Text(state.value, style=STATE_STYLES[state]),
            f"{fill:.0%}",
            rwnd,
            f"{row['zero_window_seconds']:.1f}",
            human_bytes(row["notsent_bytes"] + row["unacked_bytes"]),
            f"{row['no_progress_seconds']:.1f}",
        )
    return table

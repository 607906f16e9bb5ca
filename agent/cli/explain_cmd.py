"""`kvwatch explain REQUEST_ID|ADDRESS`: the evidence chain for one stream."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console

from kvwatch.tools.client import DEFAULT_AGENT_URL, get_json
from kvwatch.tools.tables import human_bytes

EVENT_TEXT = {
    "accepted": "connection accepted",
    "engine_announced": "engine announced the request",
    "first_byte_from_engine": "first byte from the engine (first write)",
    "first_byte_to_client": "first byte to the client (first data ACKed)",
    "zero_window_start": "client's window closed (zero window)",
    "zero_window_end": "client's window reopened",
    "zero_window_answer": "client answered a zero-window probe: window still shut",
    "sndbuf_full_start": "send buffer full",
    "sndbuf_full_end": "send buffer drained",
    "stall_conditions_began": "stall conditions began (data pending, no ACK progress)",
    "stalled": "stalled: the required time passed and the kernel showed the client did not move",
    "decision": "decision",
    "cancel_acknowledged": "engine acknowledged the cancel",
    "reset_done": "connection reset by the agent",
    "engine_closed_stream": "engine closed the stream",
    "closed": "connection closed",
}
EVIDENCE_KEYS = (
    "wmem_queued",
    "sndbuf",
    "peer_rwnd",
    "notsent_bytes",
    "unacked_bytes",
    "retransmits",
    "srtt_us",
    "zero_window_seconds",
    "no_progress_seconds",
    "stalled_seconds",
    "stall_required_seconds",
    "stall_evidence",
)


def describe(entry: dict[str, Any]) -> str:
    text = str(EVENT_TEXT.get(entry["event"], entry["event"]))
    if entry["event"] == "decision":
        text += f": {entry['verdict']} ({entry['reason']}) {', '.join(entry['actions'])}"
    if entry["event"] == "cancel_acknowledged":
        text += (
            f": {entry['status']}, freed {entry['freed_blocks']} blocks "
            f"({human_bytes(entry['freed_bytes'])})"
        )
    return text


@click.command("explain")
@click.argument("stream")
@click.option("--url", default=DEFAULT_AGENT_URL, show_default=True, help="The agent's HTTP API.")
@click.option("--json", "as_json", is_flag=True, help="Print the evidence chain as JSON.")
def command(stream: str, url: str, as_json: bool) -> None:
    """Show why a stream was (or was not) acted on: its timeline, socket evidence (with the
    stall's required time and what the verdict rests on), outcome.

    \b
    STREAM is the engine's request id (cmpl-3f2a…), or a socket address at either end of the
    connection ("10.0.0.7:50123", "[2001:db8::7]:50123") for streams no engine announced.
    Works for live streams and for recently finished ones (the agent keeps a bounded history).
    """
    chain = get_json(url, f"/api/v1/explain/{stream}")
    if as_json:
        click.echo(json.dumps(chain, indent=2))
        return
    console = Console()
    status = "live" if chain["live"] else "finished"
    console.print(
        f"[bold]{chain['request_id'] or 'no request id'}[/bold]  "
        f"{chain['local']} → {chain['remote']}  ({status})"
    )
    for entry in chain["timeline"]:
        console.print(f"  +{entry['offset_seconds']:8.3f}s  {describe(entry)}")
    decision = next((e for e in reversed(chain["timeline"]) if e["event"] == "decision"), None)
    evidence = decision["evidence"] if decision else (chain["stream"] or {})
    relay = evidence.get("relay")
    if relay:
        console.print(f"[bold]behind a proxy[/bold] {relay['chain']}  ({relay['detail']})")
    if evidence:
        console.print(
            "[bold]socket evidence[/bold] "
            + ", ".join(f"{key}={evidence[key]}" for key in EVIDENCE_KEYS if key in evidence)
        )
    joined = chain["stream"] or {}
    if joined.get("kv_bytes") is not None:
        console.print(
            f"[bold]KV held[/bold] {joined['kv_blocks']} blocks "
            f"({human_bytes(joined['kv_bytes'])}), GPU {joined.get('gpu') or '-'}"
        )

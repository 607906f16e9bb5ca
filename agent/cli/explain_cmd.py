"""`kvwatch explain REQUEST_ID`: the evidence chain for one stream."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console

from kvwatch.client import DEFAULT_AGENT_URL, get_json
from kvwatch.views import human_bytes

EVENT_TEXT = {
    "accepted": "connection accepted",
    "engine_announced": "engine announced the request",
    "first_byte_from_engine": "first byte from the engine (first write)",
    "first_byte_to_client": "first byte to the client (first data ACKed)",
    "zero_window_start": "client's window closed (zero window)",
    "zero_window_end": "client's window reopened",
    "sndbuf_full_start": "send buffer full",
    "sndbuf_full_end": "send buffer drained",
    "stall_conditions_began": "stall conditions began (data pending, no ACK progress)",
    "stalled": "stalled: threshold crossed",
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
@click.argument("request_id")
@click.option("--url", default=DEFAULT_AGENT_URL, show_default=True, help="The agent's HTTP API.")
@click.option("--json", "as_json", is_flag=True, help="Print the evidence chain as JSON.")
def command(request_id: str, url: str, as_json: bool) -> None:
    """Show why a stream was (or was not) acted on: its timeline, socket evidence, outcome.

    Works for live streams and for recently finished ones (the agent keeps a bounded
    history). REQUEST_ID is the engine's id, e.g. cmpl-3f2a….
    """
    chain = get_json(url, f"/api/v1/explain/{request_id}")
    if as_json:
        click.echo(json.dumps(chain, indent=2))
        return
    console = Console()
    status = "live" if chain["live"] else "finished"
    console.print(
        f"[bold]{chain['request_id']}[/bold]  {chain['local']} → {chain['remote']}  ({status})"
    )
    for entry in chain["timeline"]:
        console.print(f"  +{entry['offset_seconds']:8.3f}s  {describe(entry)}")
    decision = next((e for e in reversed(chain["timeline"]) if e["event"] == "decision"), None)
    evidence = decision["evidence"] if decision else (chain["stream"] or {})
    if evidence:
        console.print(
            "[bold]socket evidence[/bold] "
            + ", ".join(f"{key}={evidence[key]}" for key in EVIDENCE_KEYS if key in evidence)
        )
    stream = chain["stream"] or {}
    if stream.get("kv_bytes") is not None:
        console.print(
            f"[bold]KV held[/bold] {stream['kv_blocks']} blocks "
            f"({human_bytes(stream['kv_bytes'])}), GPU {stream.get('gpu') or '-'}"
        )

"""`kvwatch explain REQUEST_ID|ADDRESS`: the evidence chain for one stream."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.text import Text

from kvwatch.cli.options import agent_url_option
from kvwatch.tools.client import explain_path, get_json, reading_answer
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
    "paused": "engine paused the request: no decode steps for a reader that fell behind, "
    "its KV kept",
    "parked": "engine parked the request: its KV freed, the request and connection kept",
    "released": "the reader caught up: the engine was told to go on",
    "resumed": "the engine resumed the request: its KV back",
    "detached": "engine detached the stream: its output buffered on the host, its generation "
    "runs to its end",
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
    "backlog",
)


def describe(entry: dict[str, Any]) -> str:
    text = str(EVENT_TEXT.get(entry["event"], entry["event"]))
    if entry["event"] == "decision":
        text += f": {entry['verdict']} ({entry['reason']}) {', '.join(entry['actions'])}"
    if entry["event"] in ("paused", "released"):
        text += f": {entry['status']}"
    if entry["event"] in ("cancel_acknowledged", "parked"):
        text += (
            f": {entry['status']}, freed {entry['freed_blocks']} blocks "
            f"({human_bytes(entry['freed_bytes'])})"
        )
    return text


@click.command("explain")
@click.argument("stream")
@agent_url_option("The agent's HTTP API.")
@click.option("--json", "as_json", is_flag=True, help="Print the evidence chain as JSON.")
def command(stream: str, url: str, as_json: bool) -> None:
    """Show why a stream was (or was not) acted on: its timeline, socket evidence (with the
    stall's required time and what the verdict rests on), outcome.

    \b
    STREAM is the engine's request id (cmpl-3f2a…), or a socket address at either end of the
    connection ("10.0.0.7:50123", "[2001:db8::7]:50123") for streams no engine announced.
    Works for live streams and for recently finished ones (the agent keeps a bounded history).
    """
    chain = get_json(url, explain_path(stream), shape=dict)
    if as_json:
        click.echo(json.dumps(chain, indent=2))
        return
    with reading_answer(url):
        print_chain(chain)


def print_chain(chain: dict[str, Any]) -> None:
    """The evidence chain as people read it: header, timeline, evidence, KV held. What engines
    sent (request ids, evidence) is shown as plain text, never read as markup."""
    console = Console()
    status = "live" if chain["live"] else "finished"
    console.print(
        Text.assemble(
            (str(chain["request_id"] or "no request id"), "bold"),
            f"  {chain['local']} → {chain['remote']}  ({status})",
        )
    )
    for entry in chain["timeline"]:
        console.print(Text(f"  +{entry['offset_seconds']:8.3f}s  {describe(entry)}"))
    decision = next((e for e in reversed(chain["timeline"]) if e["event"] == "decision"), None)
    evidence = decision["evidence"] if decision else (chain["stream"] or {})
    relay = evidence.get("relay")
    if relay:
        console.print(_titled("behind a proxy", f"{relay['chain']}  ({relay['detail']})"))
    if evidence:
        shown = ", ".join(f"{key}={evidence[key]}" for key in EVIDENCE_KEYS if key in evidence)
        console.print(_titled("socket evidence", shown))
    joined = chain["stream"] or {}
    if joined.get("kv_bytes") is not None:
        console.print(
            _titled(
                "KV held",
                f"{joined['kv_blocks']} blocks ({human_bytes(joined['kv_bytes'])}), "
                f"GPU {joined.get('gpu') or '-'}",
            )
        )


def _titled(title: str, text: str) -> Text:
    return Text.assemble((title, "bold"), " ", text)

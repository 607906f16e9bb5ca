"""`kvwatch demo`: the collector on a built-in loopback scenario.

Until the daemon and the reference engine are joined (`kvwatch run`), the demo shows the
kernel side on its own: a stalled, a slow-draining, an idle and a healthy client streaming
from one loopback server, with the state each one gets over time.
"""

from __future__ import annotations

import json
import time

import click
from rich.console import Console

from kvwatch.bpf.loader import CollectorSettings
from kvwatch.collect import open_collector
from kvwatch.scenario import CLIENT_KINDS, Scenario
from kvwatch.states import StatePolicy, StreamState, classify
from kvwatch.views import sockets_table


@click.command("demo")
@click.option(
    "--seconds",
    type=click.FloatRange(min=1),
    default=8.0,
    show_default=True,
    help="How long to watch the clients.",
)
@click.option(
    "--stall-seconds",
    type=click.FloatRange(min=0.1),
    default=3.0,
    show_default=True,
    help="The stall threshold.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def command(seconds: float, stall_seconds: float, as_json: bool) -> None:
    """Show a stalled client found in the kernel, next to clients that must never be.

    Starts a loopback server and four clients (healthy, slow-draining, stalled, idle),
    watches them with the BPF collector, and prints each client's states over time.
    """
    console = Console(stderr=as_json)
    policy = StatePolicy(stall_seconds=stall_seconds)
    with Scenario() as scenario:
        opened = open_collector(CollectorSettings(ports=(scenario.port,)))
        console.print(f"[dim]{opened.note}[/dim]")
        kinds = {scenario.connect(kind).local_port: kind for kind in CLIENT_KINDS}
        seen: dict[str, list[str]] = {kind: [] for kind in CLIENT_KINDS}
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                time.sleep(0.25)
                now_ns = time.monotonic_ns()
                samples = [s for s in opened.collector.samples() if s.remote.port in kinds]
                for sample in samples:
                    state = classify(sample, now_ns, policy).value
                    history = seen[kinds[sample.remote.port]]
                    if not history or history[-1] != state:
                        history.append(state)
            console.print(sockets_table(samples, now_ns, policy))
        finally:
            opened.collector.close()
    outcome = {
        kind: {"states": states, "stalled": StreamState.STALLED.value in states}
        for kind, states in seen.items()
    }
    if as_json:
        click.echo(json.dumps(outcome, indent=2))
        return
    for kind in CLIENT_KINDS:
        verdict = "STALLED — would be acted on" if outcome[kind]["stalled"] else "never stalled"
        console.print(f"{kind:>8}: {' → '.join(seen[kind]) or '-'}   [bold]{verdict}[/bold]")

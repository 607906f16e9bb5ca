"""`kvwatch demo`: a stalled stream found in the kernel and its KV freed, before and after."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from kvwatch.cli.ranges import MAX_WAIT_SECONDS, NumberRange
from kvwatch.harness.demo import DemoSettings, run_demo, summary_rows

MAX_CLIENTS = 256


@click.command("demo")
@click.option(
    "--seconds",
    type=NumberRange(min=3, max=MAX_WAIT_SECONDS),
    default=12.0,
    show_default=True,
    help="Length of the observing phase.",
)
@click.option(
    "--enforce-seconds",
    type=NumberRange(min=3, max=MAX_WAIT_SECONDS),
    default=50.0,
    show_default=True,
    help="Length of the enforcing phase: long enough for the proof that cuts a stalled "
    "client with a default receive buffer (30-40 s at the demo's guarantee of 6 KB/s).",
)
@click.option(
    "--stalled",
    type=click.IntRange(1, MAX_CLIENTS),
    default=3,
    show_default=True,
    help="Clients that stop reading after the first token.",
)
@click.option(
    "--healthy",
    type=click.IntRange(1, MAX_CLIENTS),
    default=4,
    show_default=True,
    help="Clients that read as fast as they can.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def command(
    seconds: float, enforce_seconds: float, stalled: int, healthy: int, as_json: bool
) -> None:
    """Run the reference engine with healthy, slow and stalled clients, twice. The clients
    keep the kernel's default receive buffers; slow and stalled ones ask for long answers.

    \b
    1. The agent observes: it finds the backed-up streams and logs what it would do (park,
       then cut), while their requests keep their KV blocks and healthy requests queue
       behind them.
    2. The agent enforces: each stalled request is parked through the engine hook ~2 s
       after its back-pressure began (its KV blocks freed, nothing cut), and cut (cancelled,
       its client reset) only once the kernel proved its reader gone: 30-40 s here, with
       the demo's reader guarantee of 6 KB/s (its slow client reads 8 KB/s).
    The slow-but-draining client may be parked and resumed, never cut. Needs root (BPF).
    """
    console = Console(stderr=as_json)
    settings = DemoSettings(
        seconds=seconds,
        enforce_seconds=enforce_seconds,
        stalled=stalled,
        healthy=healthy,
    )
    results = run_demo(settings, lambda line: console.print(f"[dim]{line}[/dim]"))
    rows = summary_rows(results)
    if as_json:
        click.echo(
            json.dumps(
                {
                    name: dict(zip(("observe", "enforce"), values, strict=True))
                    for name, values in rows
                },
                indent=2,
            )
        )
        return
    table = Table(title="kvwatch demo: stalled clients vs. the KV cache", header_style="bold")
    table.add_column("")
    table.add_column("agent observing (off)", justify="right")
    table.add_column("agent enforcing (on)", justify="right")
    for name, values in rows:
        table.add_row(name, *values)
    console.print(table)

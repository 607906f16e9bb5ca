"""`kvwatch demo`: clients that stop reading, their KV and the tokens decoded for nobody,
with the agent observing and then enforcing."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvwatch.cli.ranges import MAX_WAIT_SECONDS, NumberRange
from kvwatch.lab.harness.demo import DemoSettings, run_demo, summary_rows

MAX_CLIENTS = 256


@click.command("demo")
@click.option(
    "--stopping",
    type=click.IntRange(1, MAX_CLIENTS),
    default=DemoSettings.stopping,
    show_default=True,
    help="Clients that stop reading after their first tokens (connection kept open).",
)
@click.option(
    "--returning",
    type=click.IntRange(0, MAX_CLIENTS),
    default=DemoSettings.returning,
    show_default=True,
    help="Of the stopping clients, how many come back for the rest of their answer.",
)
@click.option(
    "--healthy",
    type=click.IntRange(1, MAX_CLIENTS),
    default=DemoSettings.healthy,
    show_default=True,
    help="Clients that read as fast as they can.",
)
@click.option(
    "--away-seconds",
    type=NumberRange(min=1, max=MAX_WAIT_SECONDS),
    default=DemoSettings.away_seconds,
    show_default=True,
    help="How long a stopping client is away before it reads the rest of its answer.",
)
@click.option(
    "--max-seconds",
    type=NumberRange(min=10, max=MAX_WAIT_SECONDS),
    default=DemoSettings.max_seconds,
    show_default=True,
    help="The most a phase runs when its events take longer (a very slow machine).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def command(
    stopping: int,
    returning: int,
    healthy: int,
    away_seconds: float,
    max_seconds: float,
    as_json: bool,
) -> None:
    """Run the reference engine (its defaults) with healthy, slow and stopping clients
    (kernel-default buffers), twice, on the same load for the same time. Needs root (BPF).

    \b
    1. The agent observes: each stopping client's reader falls behind, and the engine
       decodes its answer for nobody, its KV held; the agent logs what it would do.
    2. The agent enforces: each stopping client's request is paused a few seconds after
       its reader stopped (no more decoding) and parked (its KV freed); a returning client
       is released when it reads again and gets its whole answer, unchanged. The slow
       reader is paced (paused while behind), never cut.
    The enforcing phase runs until every returning client got its answer (at most
    --max-seconds); the observing phase runs exactly as long.
    """
    console = Console(stderr=as_json)
    if returning > stopping:
        raise click.BadParameter(
            f"{returning} of {stopping} stopping clients cannot return", param_hint="--returning"
        )
    settings = DemoSettings(
        stopping=stopping,
        returning=returning,
        healthy=healthy,
        away_seconds=away_seconds,
        max_seconds=max_seconds,
    )
    results = run_demo(settings, lambda line: console.print(Text(line, style="dim")))
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
    table = Table(
        title="kvwatch demo: clients that stop reading, and the KV cache", header_style="bold"
    )
    table.add_column("")
    table.add_column("agent observing (off)", justify="right")
    table.add_column("agent enforcing (on)", justify="right")
    for name, values in rows:
        table.add_row(name, *values)
    console.print(table)
    if not all(result.events_happened for result in results):
        console.print(
            Text(
                "Not every returning client got its answer within the phase: "
                "this machine is slower than the demo expects; raise --max-seconds.",
                style="yellow",
            )
        )

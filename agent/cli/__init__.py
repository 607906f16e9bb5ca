"""The `kvwatch` command line: one click group, one module per command."""

from __future__ import annotations

import sys

import click

from kvwatch import __version__
from kvwatch.errors import KvwatchError


class KvwatchGroup(click.Group):
    """Turns kvwatch errors into a one-line message and the contract's exit code."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KvwatchError as exc:
            click.secho(f"kvwatch: {exc.message}", fg="red", err=True)
            if exc.hint:
                click.echo(f"  what to do: {exc.hint}", err=True)
            sys.exit(exc.exit_code)


@click.group(cls=KvwatchGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvwatch")
def main() -> None:
    """Find streaming clients that pin KV cache in GPU memory, and free it.

    \b
    Common tasks:
      kvwatch doctor            can this node run the agent? what is missing?
      kvwatch sockets --port 8000
                                per-socket send backpressure, live from the kernel
      kvwatch demo              a stalled, a slow and an idle client, side by side
      kvwatch engine --egress coupled --kv-blocks 64
                                the reference torch engine (OpenAI-compatible)
      kvwatch loadgen --healthy 8 --stalled 2
                                healthy, slow and stalled streaming clients

    Exit codes: 0 ok, 1 runtime error, 2 usage error, 3 missing privilege or kernel feature.
    """


def _register() -> None:
    from kvwatch.cli import (
        baseline_cmd,
        demo_cmd,
        doctor_cmd,
        engine_cmd,
        explain_cmd,
        loadgen_cmd,
        run_cmd,
        sockets_cmd,
        streams_cmd,
        top_cmd,
    )

    for module in (
        run_cmd,
        top_cmd,
        sockets_cmd,
        streams_cmd,
        explain_cmd,
        doctor_cmd,
        baseline_cmd,
        engine_cmd,
        loadgen_cmd,
        demo_cmd,
    ):
        main.add_command(module.command)


_register()

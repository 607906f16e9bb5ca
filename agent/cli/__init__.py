"""The `kvwatch` command line: one click group, one module per command, imported only when
its command runs (so `kvwatch run` does not carry the other commands' imports)."""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

import click

from kvwatch import __version__
from kvwatch.errors import ConfigError, KvwatchError, quoted

# command name -> module in kvwatch.cli exposing `command`, in the order --help lists them
COMMANDS = {
    "run": "run_cmd",
    "top": "top_cmd",
    "sockets": "sockets_cmd",
    "streams": "streams_cmd",
    "explain": "explain_cmd",
    "doctor": "doctor_cmd",
    "baseline": "baseline_cmd",
    "engine": "engine_cmd",
    "loadgen": "loadgen_cmd",
    "demo": "demo_cmd",
}


def exit_with(exc: KvwatchError) -> NoReturn:
    """The error as one line (and its hint on the next), then the contract's exit code."""
    click.secho(f"kvwatch: {exc.message}", fg="red", err=True)
    if exc.hint:
        click.echo(f"  what to do: {exc.hint}", err=True)
    sys.exit(exc.exit_code)


def check_arguments(args: list[str]) -> None:
    """ConfigError for an argument that is not UTF-8 (Python holds its bytes as surrogates,
    which no URL, id or message could carry)."""
    for position, arg in enumerate(args, start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(
                f"argument {position} ({quoted(arg)}) is not UTF-8 text",
                "kvwatch takes UTF-8 arguments only",
            ) from None


class KvwatchGroup(click.Group):
    """Loads commands lazily and turns kvwatch errors into a one-line message and the
    contract's exit code."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            check_arguments(args)
        except KvwatchError as exc:
            exit_with(exc)
        return super().parse_args(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = COMMANDS.get(cmd_name)
        if module is None:
            return None
        command: click.Command = importlib.import_module(f"kvwatch.cli.{module}").command
        return command

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KvwatchError as exc:
            exit_with(exc)


@click.group(cls=KvwatchGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvwatch")
def main() -> None:
    """Find streaming clients that pin KV cache in GPU memory, and free it.

    \b
    Common tasks:
      kvwatch doctor            can this node run the agent? what is missing?
      kvwatch run --port 8000   the agent (observe mode: decides and logs, touches nothing)
      kvwatch top               live view of every stream during an incident
      kvwatch explain ID        why the agent did (or did not) act on a request
      kvwatch sockets --port 8000
                                per-socket send backpressure, live from the kernel
      kvwatch demo              engine, healthy/slow/stalled clients and the agent, off then on
      kvwatch engine --egress coupled --kv-blocks 64
                                the reference torch engine (OpenAI-compatible)
      kvwatch loadgen --healthy 8 --stalled 2
                                healthy, slow and stalled streaming clients

    Exit codes: 0 ok, 1 runtime error, 2 usage error, 3 missing privilege or kernel feature.
    """

"""`kvwatch doctor`: what this node offers kvwatch, and what to do about what it lacks."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvwatch.cli.options import agent_url_option, setting_option
from kvwatch.errors import EXIT_PRIVILEGE
from kvwatch.tools.doctor import HOOK_SOCKET, checks_json, node_can_run_agent, run_checks

STATUS_STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red", "info": "dim"}


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@setting_option(
    "--path.procfs",
    "procfs_root",
    key="path.procfs",
    default="/proc",
    show_default=True,
    help="Where the host's /proc is mounted (sysctls are read under it too); a failed check "
    "when it is no procfs, as `kvwatch run` refuses it.",
)
@agent_url_option(
    "The agent's HTTP API, asked whether the daemon answers and which engines it has."
)
@setting_option(
    "--hook-socket",
    key="hook.socket",
    default=HOOK_SOCKET,
    show_default=True,
    help="The engine-hook socket to inspect (the agent's --hook-socket).",
)
def command(as_json: bool, procfs_root: str, url: str, hook_socket: str) -> None:
    """Check this node: privileges, BTF, tracefs, libbpf, which mode each BPF attach point gets,
    NVML and GPUs, the backpressure sysctls, the daemon and its socket table (full: what
    --max-sockets would fit), the engine-hook socket and the
    engines connected to it.

    Every send mode is tried for real (loaded, attached, detached). A failing or warning
    line says how to fix it. No GPU or no daemon is not a failure. Exit code 3 when the node
    cannot run the agent.
    """
    checks = run_checks(procfs_root, url, hook_socket)
    if as_json:
        click.echo(json.dumps(checks_json(checks), indent=2))
    else:
        table = Table(box=None, pad_edge=False, show_header=False)
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True)
        table.add_column()
        for check in checks:
            detail = check.detail + (
                f"\n→ {check.fix}" if check.fix and check.status in ("fail", "warn") else ""
            )
            table.add_row(
                Text(check.status.upper(), style=STATUS_STYLES[check.status]), check.name, detail
            )
        Console().print(table)
    if not node_can_run_agent(checks):
        sys.exit(EXIT_PRIVILEGE)

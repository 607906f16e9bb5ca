"""`kvwatch baseline save FILE` and `kvwatch baseline diff A B`: TCP tuning with a record."""

from __future__ import annotations

import json

import click

from kvwatch.tools.baseline import save_snapshot, take_snapshot
from kvwatch.tools.baseline_diff import diff_json, diff_lines, diff_snapshots, load_snapshot


@click.group("baseline")
def command() -> None:
    """Record the node's TCP buffer settings, TCP counters and engine memory; compare two
    records to see what a change did, and how to undo it.

    \b
    A careful tuning session:
      kvwatch baseline save before.json --process vllm
      (change one sysctl on a canary, let traffic run)
      kvwatch baseline save after.json --process vllm
      kvwatch baseline diff before.json after.json
    `diff` prints the `sysctl -w` lines that restore the first record's settings; it never
    runs them.
    """


@command.command("save")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option(
    "--pid",
    "pids",
    type=click.IntRange(min=1),
    multiple=True,
    help="Record this engine process's cgroup memory (repeatable).",
)
@click.option(
    "--process",
    "names",
    multiple=True,
    help="Record the cgroup memory of every process with this name: its comm, or the "
    "file name of one of its first arguments (repeatable).",
)
@click.option(
    "--path.procfs",
    "procfs_root",
    default="/proc",
    show_default=True,
    help="Where the host's /proc is mounted.",
)
@click.option(
    "--path.sysfs",
    "sysfs_root",
    default="/sys",
    show_default=True,
    help="Where the host's /sys is mounted (cgroup memory is read under it).",
)
def save(
    file: str, pids: tuple[int, ...], names: tuple[str, ...], procfs_root: str, sysfs_root: str
) -> None:
    """Save this node's baseline to FILE (JSON).

    It holds net.ipv4.tcp_{rmem,wmem,mem,moderate_rcvbuf,notsent_lowat},
    net.core.{r,w}mem_max, the TCP counters that show backpressure (retransmits, timeouts,
    TCPRcvQDrop, memory pressure, zero-window adverts, window probes), /proc/net/sockstat
    and the cgroup memory of the given engine processes."""
    snapshot, warnings = take_snapshot(procfs_root, sysfs_root, pids, names)
    for warning in warnings:
        click.secho(f"kvwatch: {warning}", fg="yellow", err=True)
    save_snapshot(snapshot, file)
    processes = len(snapshot.processes)
    click.echo(f"baseline saved to {file} ({snapshot.taken_at}, {processes} process(es))")


@command.command("diff")
@click.argument("a", type=click.Path(dir_okay=False))
@click.argument("b", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
def diff(a: str, b: str, as_json: bool) -> None:
    """Compare baseline A (older) with baseline B.

    Shows the sysctls that changed, counters as rates over the interval, sockstat, engine
    cgroup memory, and the sysctl lines that would restore A's settings (printed, never
    run). A damaged file exits with code 2."""
    result = diff_snapshots(load_snapshot(a), load_snapshot(b))
    if as_json:
        click.echo(json.dumps(diff_json(result, a, b), indent=2))
        return
    click.echo("\n".join(diff_lines(result, a, b)))

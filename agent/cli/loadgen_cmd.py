"""`kvwatch loadgen`: healthy, slow and stalled streaming clients against an OpenAI API."""

from __future__ import annotations

import asyncio
import json
import sys

import click

from kvwatch.cli.ranges import MAX_WAIT_SECONDS, NumberRange
from kvwatch.errors import KvwatchError
from kvwatch.lab.loadgen import LoadPlan, LoadReport, render_text, run_load
from kvwatch.lab.loadgen.report import progress_line

DAY_SECONDS = 86400.0
MAX_CLIENTS = 10_000
MAX_SOCKET_BUFFER = (1 << 31) - 1  # SO_RCVBUF is a C int


class _Progress:
    """Writes the progress line on stderr: rewritten in place on a terminal, else one per tick."""

    def __init__(self, duration_seconds: float) -> None:
        self._duration_seconds = duration_seconds
        self._in_place = sys.stderr.isatty()
        self._shown = False

    def __call__(self, report: LoadReport) -> None:
        line = progress_line(report, report.duration_seconds, self._duration_seconds)
        if self._in_place:
            click.echo(f"\r\x1b[2K{line}", nl=False, err=True)
        else:
            click.echo(line, err=True)
        self._shown = True

    def close(self) -> None:
        if self._in_place and self._shown:
            click.echo(err=True)


@click.command("loadgen")
@click.option(
    "--url",
    default="http://127.0.0.1:8000",
    show_default=True,
    help="Base URL of the OpenAI-compatible server (the API is under /v1).",
)
@click.option(
    "--duration",
    "duration_seconds",
    type=NumberRange(min=0, min_open=True, max=DAY_SECONDS),
    default=10.0,
    show_default=True,
    help="Seconds to run.",
)
@click.option(
    "--healthy",
    type=click.IntRange(0, MAX_CLIENTS),
    default=4,
    show_default=True,
    help="Clients that read as fast as they can.",
)
@click.option(
    "--slow",
    type=click.IntRange(0, MAX_CLIENTS),
    default=0,
    show_default=True,
    help="Clients that read --slow-bytes-per-second.",
)
@click.option(
    "--stalled",
    type=click.IntRange(0, MAX_CLIENTS),
    default=0,
    show_default=True,
    help="Clients that stop reading after --stall-after-tokens tokens, connection kept open.",
)
@click.option(
    "--stall-after-tokens",
    type=click.IntRange(1, 1 << 20),
    default=1,
    show_default=True,
    help="Tokens a stalled client reads before it stops reading.",
)
@click.option(
    "--resume-after",
    "resume_after_seconds",
    type=NumberRange(0, MAX_WAIT_SECONDS),
    default=None,
    metavar="SECONDS",
    help="A stalled client reads the rest of its answer this long after it stopped "
    "(someone who came back) [default: never].",
)
@click.option(
    "--slow-bytes-per-second",
    type=click.IntRange(1, MAX_SOCKET_BUFFER),
    default=2048,
    show_default=True,
    help="How fast slow clients read.",
)
@click.option(
    "--rcvbuf-bytes",
    type=click.IntRange(0, MAX_SOCKET_BUFFER),
    default=4096,
    show_default=True,
    help="SO_RCVBUF of slow and stalled clients, set before connect (0: default).",
)
@click.option("--max-tokens", type=click.IntRange(1, 1 << 20), default=128, show_default=True)
@click.option(
    "--long-max-tokens",
    type=click.IntRange(1, 1 << 20),
    default=None,
    help="max_tokens of slow and stalled clients [default: --max-tokens]. With the kernel's "
    "default receive buffers (--rcvbuf-bytes 0) only an answer that outgrows them (~1,500 "
    "tokens of SSE) holds the server: the answer a client that stops reading pins.",
)
@click.option("--prompt", default=LoadPlan.prompt, show_default=True)
@click.option(
    "--endpoint",
    type=click.Choice(["completions", "chat"]),
    default="completions",
    show_default=True,
    help="/v1/completions or /v1/chat/completions.",
)
@click.option("--model", default=None, help="Model name [default: the first at /v1/models].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress line on stderr [default: when stderr is a terminal].",
)
def command(
    *,
    url: str,
    duration_seconds: float,
    healthy: int,
    slow: int,
    stalled: int,
    stall_after_tokens: int,
    resume_after_seconds: float | None,
    slow_bytes_per_second: int,
    rcvbuf_bytes: int,
    max_tokens: int,
    long_max_tokens: int | None,
    prompt: str,
    endpoint: str,
    model: str | None,
    as_json: bool,
    progress: bool | None,
) -> None:
    """Run healthy, slow and stalled streaming clients and report each class.

    Per class: TTFT and inter-token latency p50/p99, tokens/s, and finished, cancelled (the
    server ended the stream early), reset (the connection was reset), error, stalled (held open
    to the end) and incomplete (cut by the end of the run) requests.

    \b
    Example:
      kvwatch loadgen --url http://127.0.0.1:8000 --healthy 8 --stalled 2 --duration 30
      kvwatch loadgen --stalled 2 --rcvbuf-bytes 0 --long-max-tokens 1500
      kvwatch loadgen --stalled 1 --stall-after-tokens 50 --resume-after 20
    """
    plan = LoadPlan(
        url=url,
        healthy=healthy,
        slow=slow,
        stalled=stalled,
        duration_seconds=duration_seconds,
        endpoint="chat" if endpoint == "chat" else "completions",
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        long_max_tokens=long_max_tokens,
        slow_bytes_per_second=slow_bytes_per_second,
        rcvbuf_bytes=rcvbuf_bytes,
        stall_after_tokens=stall_after_tokens,
        resume_after_seconds=resume_after_seconds,
    )
    show = sys.stderr.isatty() if progress is None else progress
    reporter = _Progress(duration_seconds) if show else None
    try:
        report = asyncio.run(run_load(plan, on_progress=reporter))
    finally:
        if reporter is not None:
            reporter.close()
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else render_text(report))
    if report.total_tokens == 0 and report.total_errors:
        first = next(row.errors[0] for row in report.classes.values() if row.errors)
        raise KvwatchError(
            f"no request received a token; first error: {first}",
            "check --url, --model and --endpoint against the server",
        )

"""`kvwatch loadgen` through click: JSON shape, progress, exit codes."""

from __future__ import annotations

import json
import socket

import click
from click.testing import CliRunner, Result

from kvwatch.cli import KvwatchGroup
from kvwatch.cli.loadgen_cmd import command
from tests.loadgen.sse_server import Behaviour, SseServer

CLASS_FIELDS = {
    "clients",
    "requests",
    "in_flight",
    "finished",
    "cancelled",
    "reset",
    "error",
    "stalled",
    "incomplete",
    "tokens",
    "tokens_per_second",
    "ttft_seconds",
    "ttft_censored",
    "itl_seconds",
    "reset_after_seconds",
    "errors",
}


def _invoke(*args: str) -> Result:
    @click.group(cls=KvwatchGroup)
    def cli() -> None:
        pass

    cli.add_command(command)
    return CliRunner().invoke(cli, ["loadgen", *args])


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_json_report_shape(sse_server: SseServer) -> None:
    sse_server.behaviour = Behaviour(tokens=5, token_delay_seconds=0.01)
    result = _invoke(
        "--url", sse_server.url, "--duration", "0.5", "--healthy", "1", "--stalled", "1", "--json"
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == {"url", "endpoint", "model", "duration_seconds", "classes"}
    assert set(report["classes"]) == {"healthy", "slow", "stalled"}
    for row in report["classes"].values():
        assert set(row) == CLASS_FIELDS
        assert set(row["ttft_seconds"]) == {"p50", "p99", "count"}
    assert report["classes"]["healthy"]["finished"] >= 1
    assert report["classes"]["slow"]["clients"] == 0
    assert result.stderr == ""  # no progress line unless asked for (stderr is not a terminal)


def test_text_report_and_progress_line(sse_server: SseServer) -> None:
    result = _invoke("--url", sse_server.url, "--duration", "1.2", "--healthy", "1", "--progress")
    assert result.exit_code == 0, result.output
    assert "healthy       1" in result.stdout
    assert "\nstalled" not in result.stdout  # classes without clients are left out
    assert "loadgen" in result.stderr
    assert "healthy:" in result.stderr


def test_unreachable_url_is_a_clear_runtime_error() -> None:
    port = _closed_port()
    result = _invoke("--url", f"http://127.0.0.1:{port}", "--duration", "1")
    assert result.exit_code == 1
    assert f"cannot reach http://127.0.0.1:{port}: Connection refused" in result.stderr
    assert "what to do: start the server" in result.stderr


def test_usage_errors_exit_2() -> None:
    assert _invoke("--healthy", "-1").exit_code == 2
    assert _invoke("--endpoint", "embeddings").exit_code == 2
    no_clients = _invoke("--healthy", "0")
    assert no_clients.exit_code == 2
    assert "no clients to run" in no_clients.stderr
    https = _invoke("--url", "https://example.com")
    assert https.exit_code == 2
    assert "https is not supported" in https.stderr


def test_a_server_that_only_errors_exits_1(sse_server: SseServer) -> None:
    sse_server.behaviour = Behaviour(status=503)
    result = _invoke("--url", sse_server.url, "--duration", "0.3", "--model", "m")
    assert result.exit_code == 1
    assert "no request received a token; first error: HTTP 503" in result.stderr

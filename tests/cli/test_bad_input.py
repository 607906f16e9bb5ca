"""Issue 25's bad input, case by case, as reported: each is one error line (and its hint), a
non-zero exit of the contract, never a traceback or a hang."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kvwatch.cli import main
from kvwatch.errors import EXIT_RUNTIME, EXIT_USAGE, QUOTE_CHARS
from tests.fuzz.servers import garbage_server, served_agent

MAX_ERROR_CHARS = 600  # an error line, its hint and the quote of a value


@pytest.fixture(autouse=True)
def no_agent_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `run` here must be refused; one that is not fails instead of running an agent."""

    def refuse(*_: object) -> None:
        raise AssertionError("the agent would have started")

    monkeypatch.setattr("kvwatch.cli.run_cmd.Daemon", refuse)


@pytest.fixture(scope="module")
def agent_url() -> Iterator[str]:
    with served_agent() as url:
        yield url


@pytest.fixture(scope="module")
def html_url() -> Iterator[str]:
    """A web server that is not a kvwatch agent: every path is an HTML page."""
    with garbage_server() as (url, answer):
        answer.content_type, answer.body = "text/html", b"<html><body>hello</body></html>"
        yield url


def kvwatch(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Result:
    """`kvwatch run` with a private hook socket, no audit file and a free port."""
    base = ["--hook-socket", str(tmp_path / "e.sock"), "--audit-log", "", "--listen", "127.0.0.1:0"]
    return kvwatch("run", *base, *args, env=env)


def one_line_error(result: Result, exit_code: int, *words: str) -> str:
    """The one `kvwatch: ...` line of a refused command, checked: the exit code, no traceback,
    a short message holding `words`."""
    assert result.exit_code == exit_code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvwatch: ")]
    assert len(errors) == 1, result.stderr
    assert len(result.stderr) < MAX_ERROR_CHARS, result.stderr
    for word in words:
        assert word in errors[0]
    return errors[0]


# explain, and every command that talks to the agent


def test_explain_a_100_kb_id_is_refused_quoting_a_prefix() -> None:
    line = one_line_error(kvwatch("explain", "a" * 100_000), EXIT_USAGE, "longer than 256")
    assert "a" * QUOTE_CHARS + "... (100000 characters)" in line


def test_explain_an_id_with_a_newline_is_refused() -> None:
    one_line_error(kvwatch("explain", "cmpl-1\ncmpl-2"), EXIT_USAGE, "cmpl-1\\ncmpl-2", "control")


@pytest.mark.parametrize("stream", ["..", "../../etc/passwd"])
def test_explain_dot_dot_ids_are_ids_the_agent_does_not_know(agent_url: str, stream: str) -> None:
    result = kvwatch("explain", "--url", agent_url, stream)
    one_line_error(result, EXIT_RUNTIME, f"no stream with request id '{stream}'")


def test_explain_finds_a_known_stream_through_the_same_path(agent_url: str) -> None:
    result = kvwatch("explain", "--url", agent_url, "cmpl-known", "--json")
    assert result.exit_code == 0, result.output
    assert '"request_id": "cmpl-known"' in result.stdout


def test_a_non_utf8_argument_is_refused() -> None:
    one_line_error(kvwatch("explain", "\udcff"), EXIT_USAGE, "argument 2 (\\udcff)", "UTF-8")


def test_a_non_utf8_argument_from_a_real_command_line_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvwatch.cli", "explain", b"cmpl-\xff"],
        capture_output=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert done.returncode == EXIT_USAGE
    assert b"Traceback" not in done.stderr
    assert b"is not UTF-8 text" in done.stderr.splitlines()[0]


AGENT_COMMANDS = [
    ("explain", "cmpl-1"),
    ("streams",),
    ("sockets",),
    ("top", "--once"),
]


@pytest.mark.parametrize("command", [*AGENT_COMMANDS, ("doctor",)])
@pytest.mark.parametrize("url", ["http://[::1", "ftp://127.0.0.1/", "http://x\n/", "h" * 5000])
def test_a_malformed_url_is_refused_before_anything_is_asked(
    command: tuple[str, ...], url: str
) -> None:
    one_line_error(kvwatch(*command, "--url", url), EXIT_USAGE, "--url")


def test_loadgen_refuses_a_malformed_engine_url() -> None:
    result = kvwatch("loadgen", "--url", "http://[::1", "--duration", "0.1")
    one_line_error(result, EXIT_USAGE, "not a URL: http://[::1")


@pytest.mark.parametrize("command", AGENT_COMMANDS)
def test_a_server_that_is_not_kvwatch_is_named_in_one_line(
    html_url: str, command: tuple[str, ...]
) -> None:
    one_line_error(kvwatch(*command, "--url", html_url), EXIT_RUNTIME, html_url, "not")


@pytest.mark.parametrize("command", AGENT_COMMANDS)
def test_a_json_answer_of_the_wrong_shape_is_named_in_one_line(command: tuple[str, ...]) -> None:
    with garbage_server() as (url, answer):
        answer.body = b'[{"state": "[/bold]", "local": 7}]'
        one_line_error(kvwatch(*command, "--url", url), EXIT_RUNTIME, url, "not")


# kvwatch run --config


@pytest.mark.timeout(20)
def test_a_fifo_without_a_writer_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    one_line_error(run(tmp_path, "--config", str(fifo)), EXIT_USAGE, "is a FIFO, not a regular")


@pytest.mark.parametrize(
    ("path", "kind"), [("/dev/zero", "a character device"), ("/dev/urandom", "a character device")]
)
def test_devices_are_refused_without_being_read(tmp_path: Path, path: str, kind: str) -> None:
    one_line_error(run(tmp_path, "--config", path), EXIT_USAGE, f"{path} is {kind}")


def test_a_directory_is_refused(tmp_path: Path) -> None:
    one_line_error(run(tmp_path, "--config", str(tmp_path)), EXIT_USAGE, "is a directory")


def test_50_mb_of_random_bytes_are_refused_by_size(tmp_path: Path) -> None:
    path = tmp_path / "random.toml"
    path.write_bytes(os.urandom(50 << 20))
    one_line_error(run(tmp_path, "--config", str(path)), EXIT_USAGE, "larger than 1048576 bytes")


def test_random_bytes_under_the_size_cap_are_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "random.toml"
    path.write_bytes(b"[policy]\nmode = \xff\xfe")
    one_line_error(run(tmp_path, "--config", str(path)), EXIT_USAGE, "not UTF-8", "offset 16")


def test_a_100k_deep_nested_array_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "deep.toml"
    path.write_text("[policy]\nallow_ports = " + "[" * 100_000 + "]" * 100_000 + "\n")
    one_line_error(run(tmp_path, "--config", str(path)), EXIT_USAGE, "nests", "too deeply")


def test_a_50_mb_value_is_refused_by_size(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_text('[policy]\nmode = "' + "x" * (50 << 20) + '"\n')
    one_line_error(run(tmp_path, "--config", str(path)), EXIT_USAGE, "larger than 1048576 bytes")


def test_a_large_value_is_quoted_by_a_short_prefix(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_text('[policy]\nmode = "' + "x" * 900_000 + '"\n')
    line = one_line_error(run(tmp_path, "--config", str(path)), EXIT_USAGE, "policy.mode")
    assert "... (900000 characters)" in line


def test_an_empty_config_path_is_an_error(tmp_path: Path) -> None:
    one_line_error(run(tmp_path, "--config", ""), EXIT_USAGE, "config file path is empty")


# numbers


def test_a_400_digit_budget_is_out_of_range(tmp_path: Path) -> None:
    result = run(tmp_path, "--max-cancels-per-minute", "9" * 400)
    one_line_error(result, EXIT_USAGE, "policy.max_cancels_per_minute must be 1..1000000")


@pytest.mark.parametrize("command", ["run", "sockets", "top"])
def test_a_pid_beyond_the_kernels_is_refused_by_every_command(tmp_path: Path, command: str) -> None:
    pid = ("--pid", "4294967296")
    result = run(tmp_path, *pid) if command == "run" else kvwatch(command, "--standalone", *pid)
    one_line_error(result, EXIT_USAGE, "collector.pid must be 0..4194304", "--pid")


def test_a_history_size_of_1e30_is_refused_from_the_file_and_the_environment(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kvwatch.toml"
    for value in ("1e30", "1000000000000000000000000000000"):
        path.write_text(f"[streams]\nhistory_size = {value}\n")
        one_line_error(run(tmp_path, "--config", str(path)), EXIT_USAGE, "streams.history_size")
        env = {"KVWATCH_STREAMS_HISTORY_SIZE": value}
        one_line_error(run(tmp_path, env=env), EXIT_USAGE, "$KVWATCH_STREAMS_HISTORY_SIZE")


def test_nan_and_huge_waits_are_refused() -> None:
    for value in ("nan", "1e300", "inf"):
        result = kvwatch("top", "--once", "--interval", value)
        assert result.exit_code == EXIT_USAGE, result.output
        assert "Traceback" not in result.output


# --path.procfs


def test_run_refuses_a_procfs_that_does_not_exist(tmp_path: Path) -> None:
    result = run(tmp_path, "--path.procfs", "/nonexistent")
    one_line_error(result, EXIT_USAGE, "path.procfs /nonexistent does not exist")


def test_run_refuses_a_directory_that_is_no_procfs(tmp_path: Path) -> None:
    result = run(tmp_path, "--path.procfs", str(tmp_path))
    one_line_error(result, EXIT_USAGE, "is not a procfs (it has no self/stat)")

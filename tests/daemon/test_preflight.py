"""`kvwatch run` refuses settings this node cannot honour before anything starts (issue #13,
finding 7): one message naming the setting, the contract's exit code, no traceback."""

from __future__ import annotations

import os
import resource
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvwatch.cli import main
from kvwatch.config.schema import MAX_SOCKETS_LIMIT
from kvwatch.daemon.preflight import bind_listen_address, raise_descriptor_limit, socket_map_bytes
from kvwatch.errors import EXIT_PRIVILEGE, EXIT_USAGE, KvwatchError

NOBODY_UID = 65534


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


def _run(tmp_path: Path, *args: str) -> tuple[int, str]:
    """`kvwatch run` with a private hook socket and no audit file, plus `args`."""
    base = ["run", "--hook-socket", str(tmp_path / "e.sock"), "--audit-log", ""]
    result = CliRunner().invoke(main, [*base, *args])
    return result.exit_code, result.output


def _refused(code: int, output: str, setting: str, exit_code: int = EXIT_USAGE) -> None:
    assert code == exit_code, output
    assert setting in output
    assert "what to do:" in output
    assert "Traceback" not in output


def test_a_busy_listen_address_is_refused(tmp_path: Path, busy_port: int) -> None:
    _refused(*_run(tmp_path, "--listen", f"127.0.0.1:{busy_port}"), "another process")


def test_an_address_of_another_host_is_refused(tmp_path: Path) -> None:
    _refused(*_run(tmp_path, "--listen", "192.0.2.1:9431"), "not an address of this node")
    _refused(*_run(tmp_path, "--listen", "no-such-host.invalid:9431"), "http.listen")


def test_an_audit_path_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    for path in ("/dev/full", str(tmp_path)):
        _refused(*_run(tmp_path, "--audit-log", path), f"audit.path {path} is not a regular")


def test_max_sockets_beyond_the_kernel_limit_is_refused(tmp_path: Path) -> None:
    code, output = _run(tmp_path, "--max-sockets", "100000000000")
    _refused(code, output, f"collector.max_sockets must be 1..{MAX_SOCKETS_LIMIT}")


def test_a_socket_map_that_does_not_fit_in_memory_is_refused(tmp_path: Path) -> None:
    procfs = tmp_path / "proc"
    procfs.mkdir()
    (procfs / "meminfo").write_text("MemTotal: 8000 kB\nMemAvailable: 4096 kB\n")
    code, output = _run(tmp_path, "--path.procfs", str(procfs), "--max-sockets", "65536")
    _refused(code, output, "collector.max_sockets = 65536 needs about")
    assert socket_map_bytes(65536) > 2 * 4096 * 1024


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_privileged_port_for_an_unprivileged_agent_is_a_privilege_error() -> None:
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:  # the child: drop to nobody, try the bind, report the error's class
        try:
            os.setgroups([])
            os.setgid(NOBODY_UID)
            os.setuid(NOBODY_UID)
            bind_listen_address("127.0.0.1:81")
            os.write(write_fd, b"bound")
        except KvwatchError as exc:
            os.write(write_fd, f"{exc.exit_code} {exc.message}".encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        report = pipe.read().decode()
    os.waitpid(child, 0)
    assert report.startswith(f"{EXIT_PRIVILEGE} http.listen 127.0.0.1:81: port 81 needs"), report


def test_the_descriptor_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        raised = raise_descriptor_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == raised
        assert hard in (raised, resource.RLIM_INFINITY)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

"""Suite-wide rules. BPF tests (marker `bpf`) need root, kernel BTF and the compiled object;
where they cannot run they skip — unless KVWATCH_REQUIRE_BPF=1 (CI), where they fail."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwatch.collect.bpf.loader import DEFAULT_OBJECT
from kvwatch.tools.doctor import parse_effective_capabilities
from tests.act.stalled import StalledConnections

REQUIRE_BPF_ENV = "KVWATCH_REQUIRE_BPF"


def bpf_unavailable_reason() -> str | None:
    status = Path("/proc/self/status").read_text()
    if not {"CAP_BPF", "CAP_SYS_ADMIN"} & parse_effective_capabilities(status):
        return "no CAP_BPF or CAP_SYS_ADMIN (run as root)"
    if not Path("/sys/kernel/btf/vmlinux").exists():
        return "the kernel exposes no BTF (/sys/kernel/btf/vmlinux)"
    if not DEFAULT_OBJECT.is_file():
        return f"the BPF object is not built ({DEFAULT_OBJECT}); run `make bpf`"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("bpf") is None:
        return
    reason = bpf_unavailable_reason()
    if reason is None:
        return
    if os.environ.get(REQUIRE_BPF_ENV) == "1":
        pytest.fail(f"BPF test cannot run: {reason} ({REQUIRE_BPF_ENV}=1 forbids skipping)")
    pytest.skip(reason)


@pytest.fixture
def socket_dir() -> Iterator[str]:
    """A short private directory (AF_UNIX paths are limited to 108 bytes), world-searchable
    so another uid can reach a socket in it."""
    directory = tempfile.mkdtemp(prefix="kvwd-", dir="/tmp")
    os.chmod(directory, 0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def socket_path(socket_dir: str) -> str:
    """A hook socket path of the test's own, never an agent's already on the machine."""
    return f"{socket_dir}/engine.sock"


@pytest.fixture
def stalled_connections() -> Iterator[StalledConnections]:
    """Real loopback connections whose reader never reads (tests/act/stalled.py)."""
    connections = StalledConnections()
    yield connections
    connections.close()

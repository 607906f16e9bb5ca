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


# `make test` runs the suite on pytest-xdist workers; the longest tests start first, so the
# rest fills in around them: the kernel matrix's VMs, then the other slow ones and those that
# run the engine, then the rest (a stable sort: each group keeps its order).
FIRST_TO_START = "tests/kernel/test_matrix.py"


def start_order(item: pytest.Item) -> int:
    if item.nodeid.startswith(FIRST_TO_START):
        return 0
    if item.get_closest_marker("slow") or item.get_closest_marker("engine"):
        return 1
    return 2


# Tests that time a real server's stream (the torch engine, llama-cpp-python) run one after
# another within their group (`--dist loadgroup`): beside each other on two cores their servers
# decoded 3-4 times slower than alone, and the pace is what those tests are about. The kernel
# matrix's VMs (software-emulated, a core each for 5-10 minutes) run one after the other too:
# two of them beside the rest left the timed tests half a core (CI stop 41: three of them late).
LLAMA_SERVER_FILES = ("tests/hook/test_asgi_detach", "tests/e2e/test_llama_cpp.py")


def serial_group(item: pytest.Item) -> str | None:
    if item.nodeid.startswith(FIRST_TO_START):
        return "kernel-vm"
    if item.get_closest_marker("engine"):
        return "engine"
    if item.nodeid.startswith(LLAMA_SERVER_FILES):
        return "llama-cpp"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=start_order)
    for item in items:
        group = serial_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


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

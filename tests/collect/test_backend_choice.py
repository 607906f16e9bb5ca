"""What `auto` picks, and why, on kernels with and without BTF and with or without BCC's
prerequisites. The kernel's BTF file is the one thing moved aside (this kernel has BTF);
BCC's own import and the header search run for real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kvwatch.collect.collectors
from kvwatch.collect.bpf.bcc import HEADERS_ENV, SYSTEM_PYTHON_DIRS, kernel_headers
from kvwatch.collect.collectors import auto_backend


def printed_by(probe: str) -> list[str]:
    """The lines a fresh interpreter prints running `probe` (BCC's import is process-wide)."""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout.strip().splitlines()


def header_tree(root: Path) -> Path:
    (root / "include" / "linux").mkdir(parents=True)
    (root / "include" / "linux" / "kconfig.h").write_text("/* headers */\n")
    return root


def test_with_btf_auto_keeps_core_and_says_bcc_is_not_needed() -> None:
    backend, why = auto_backend()
    assert backend == "core"
    assert "the kernel has BTF" in why and "BCC is only for kernels without BTF" in why


def test_without_btf_auto_picks_bcc_where_headers_are_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvwatch.collect.collectors, "BTF_PATH", tmp_path / "no-btf")
    monkeypatch.setenv(HEADERS_ENV, str(header_tree(tmp_path / "headers")))
    backend, why = auto_backend()
    assert backend == "bcc"
    assert "no BTF" in why and str(tmp_path / "headers") in why


def test_without_btf_or_headers_auto_falls_back_to_diag_and_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvwatch.collect.collectors, "BTF_PATH", tmp_path / "no-btf")
    monkeypatch.setenv(HEADERS_ENV, str(tmp_path / "empty"))
    if kernel_headers() is not None:
        pytest.fail(f"this machine has kernel headers ({kernel_headers()}): the test needs none")
    backend, why = auto_backend()
    assert backend == "diag"
    assert "no kernel headers" in why
    assert "apt install linux-headers-" in why and "dnf install kernel-devel-" in why


def test_bcc_is_imported_from_the_system_without_its_neighbours() -> None:
    """The virtualenv has no `bcc`; kvwatch loads the distribution's copy alone, so nothing
    else from the system's Python directory (here PyYAML's `yaml`) leaks onto the path."""
    probe = (
        "import importlib.util, sys\n"
        "from kvwatch.collect.bpf.bcc import import_bcc\n"
        "print(import_bcc().__file__)\n"
        "print(importlib.util.find_spec('yaml') is not None and "
        "importlib.util.find_spec('yaml').origin.startswith('/usr/lib/python3/'))\n"
    )
    module_file, leaked = printed_by(probe)
    assert module_file.startswith(SYSTEM_PYTHON_DIRS), module_file
    assert leaked == "False"


def test_a_machine_without_bcc_gets_an_error_that_says_what_to_install() -> None:
    probe = (
        "import sys\n"
        "sys.modules.pop('bcc', None)\n"
        "import kvwatch.collect.bpf.bcc as bcc_module\n"
        "bcc_module.SYSTEM_PYTHON_DIRS = ('/nonexistent',)\n"
        "from kvwatch.errors import BpfError\n"
        "try:\n"
        "    bcc_module.import_bcc()\n"
        "except BpfError as exc:\n"
        "    print(exc.message); print(exc.hint)\n"
        "status = bcc_module.bcc_status()\n"
        "print(status.usable)\n"
    )
    message, hint, usable = printed_by(probe)
    assert message.startswith("BCC is not installed")
    assert "apt install python3-bpfcc" in hint and "dnf install python3-bcc" in hint
    assert usable == "False"

"""`--backend` as users meet it: auto's choice and its reason, and BCC on a kernel whose
headers are not installed (this CI kernel: BTF, no headers)."""

from __future__ import annotations

import json

import pytest

from kvwatch.collect.bpf.bcc import HEADERS_ENV
from kvwatch.errors import EXIT_PRIVILEGE
from kvwatch.lab.harness.scenario import Scenario
from tests.cli.test_sockets_doctor import kvwatch

pytestmark = pytest.mark.bpf


def test_auto_says_it_chose_core_because_the_kernel_has_btf() -> None:
    with Scenario() as scenario:
        result = kvwatch("sockets", "--json", "--port", str(scenario.port), "--settle", "0.2")
    assert result.returncode == 0, result.stderr
    assert "auto chose CO-RE: the kernel has BTF" in result.stderr


def test_bcc_without_headers_exits_3_and_says_what_to_install() -> None:
    result = kvwatch("sockets", "--backend", "bcc", env={HEADERS_ENV: ""})
    assert result.returncode == EXIT_PRIVILEGE, result.stderr
    assert "the BCC backend cannot run: no kernel headers for" in result.stderr
    assert "apt install linux-headers-" in result.stderr
    assert "dnf install kernel-devel-" in result.stderr


def test_bcc_refuses_modes_that_need_btf() -> None:
    result = kvwatch("sockets", "--backend", "bcc", "--send-mode", "fentry")
    assert result.returncode == 2, result.stderr
    assert "the BCC backend has no fentry send mode (it needs BTF)" in result.stderr


def test_the_old_send_hook_flag_still_sets_the_send_mode_and_says_its_new_name() -> None:
    result = kvwatch("sockets", "--backend", "bcc", "--send-hook", "fentry")
    assert result.returncode == 2, result.stderr
    assert "--send-hook is now --send-mode" in result.stderr
    assert "the BCC backend has no fentry send mode (it needs BTF)" in result.stderr


def test_doctor_reports_bcc_as_not_needed_here() -> None:
    result = kvwatch("doctor", "--json")
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["BCC"]["status"] == "info"
    assert "not needed: the kernel has BTF" in checks["BCC"]["detail"]

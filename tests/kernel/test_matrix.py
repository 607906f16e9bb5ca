"""The kernel matrix under `make test`: each row (this kernel directly, each Debian kernel in a
VM) must pass every mode pair it offers. Where qemu, virtme-ng or a kernel package is missing
the row skips — unless KVWATCH_REQUIRE_BPF=1 (CI), where it fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts.kernel_matrix.kernels import MatrixError
from scripts.kernel_matrix.matrix import ROWS, VM_TIMEOUT_SECONDS, run_row
from tests.conftest import REQUIRE_BPF_ENV

pytestmark = [pytest.mark.bpf, pytest.mark.slow, pytest.mark.timeout(VM_TIMEOUT_SECONDS + 120)]

# Send modes each Debian kernel must offer (issue 7): both attach tcp_sendmsg with fentry and
# kprobe; 6.1 predates the sock:sock_send_length tracepoint (6.3).
OFFERED_SEND_MODES = {
    "debian-6.1": {"fentry", "kprobe"},
    "debian-6.12": {"fentry", "kprobe", "tp_btf", "raw_tp"},
}
# guest_bcc.py: the row with headers compares BCC with CO-RE; the others see BCC refuse.
BCC_COMPARED = {
    "test_bcc_attaches_without_btf_only_modes",
    "test_stalled_slow_and_idle_clients_agree_field_by_field",
    "test_reopening_the_window_ends_the_episode_in_both",
    "test_close_removes_both_records_with_the_same_close_event",
}
BCC_REFUSED = {"test_bcc_refuses_without_headers_and_says_what_to_install"}
ROWS_WITH_HEADERS = {"debian-6.1"}


@pytest.mark.parametrize("row", ROWS)
def test_kernel_row_passes_every_mode_it_offers(row: str, tmp_path: Path) -> None:
    try:
        result = run_row(row, tmp_path)
    except MatrixError as exc:
        if os.environ.get(REQUIRE_BPF_ENV) == "1":
            pytest.fail(
                f"kernel row {row} cannot run: {exc} ({REQUIRE_BPF_ENV}=1 forbids skipping)"
            )
        pytest.skip(f"kernel row {row} cannot run: {exc}")
    assert result.results is not None, result.error
    assert not result.failures(), "\n".join(result.failures())
    offered = {mode for mode, why in result.results["offers"]["send"].items() if why is None}
    assert offered == OFFERED_SEND_MODES.get(row, offered), result.results["offers"]["send"]
    passed = {t["name"] for t in result.results["tests"] if t["outcome"] == "passed"}
    assert "test_auto_keeps_core_where_the_kernel_has_btf" in passed
    assert (BCC_COMPARED if row in ROWS_WITH_HEADERS else BCC_REFUSED) <= passed

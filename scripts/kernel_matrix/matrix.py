"""One matrix row: a kernel, the test module run on it, and what came back.

Rows are the kernel this machine runs (tests run directly, no VM) and each Debian kernel of
`DEBIAN_KERNELS` (booted in a VM). A row that cannot start (a tool or package is missing)
raises `MatrixError`; one that starts but brings no results back (boot failure, timeout)
is returned with `error` set, so the table can say so.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from scripts.kernel_matrix.kernels import DEBIAN_KERNELS, MatrixError, cache_dir, fetch
from scripts.kernel_matrix.vm import Run, accelerator, missing_tools, run_in_vm, run_on_host

HOST_ROW = "host"
ROWS = (HOST_ROW, *(spec.name for spec in DEBIAN_KERNELS))
HOST_TIMEOUT_SECONDS = 120.0
# One guest CPU, emulated: 6.1 ~320 s and 6.12 ~170 s side by side; more beside make test's rest.
VM_TIMEOUT_SECONDS = 1200.0
OUTPUT_TAIL_CHARS = 3000
# A VM run that ends this fast without results never reached the guest's tests (virtme-ng or
# qemu failed to start: once in CI, exit 255 after 6 s, no output). It is tried once more.
BOOT_FAILURE_SECONDS = 30.0


@dataclass(frozen=True)
class RowResult:
    """What one kernel row produced. `results` is the guest's results file (conftest's
    MatrixResults), None when the run brought none back, and then `error` says why."""

    name: str
    title: str
    release: str
    how: str
    run: Run
    results: dict[str, Any] | None
    error: str

    def failures(self) -> list[str]:
        """One entry per failed test (or the row's error); empty when the row passed."""
        if self.results is None:
            return [f"{self.name}: {self.error}"]
        return [
            f"{self.name}: {test['name']}[{test['combo'] or 'auto'}]\n{test['message']}"
            for test in self.results["tests"]
            if test["outcome"] == "failed"
        ]


def run_row(name: str, workdir: Path) -> RowResult:
    """Runs one row, writing its results file under `workdir` (which must exist)."""
    results_file = workdir / f"{name}.json"
    if name == HOST_ROW:
        release = platform.release()
        title, how = "CI kernel (this machine)", "directly, no VM"
        run = run_on_host(results_file, HOST_TIMEOUT_SECONDS)
    else:
        spec = next((s for s in DEBIAN_KERNELS if s.name == name), None)
        if spec is None:
            raise MatrixError(f"unknown kernel row {name!r}: use one of {', '.join(ROWS)}")
        missing = missing_tools()
        if missing:
            raise MatrixError(f"missing host tools: {', '.join(missing)}: run scripts/setup.sh")
        tree = fetch(spec, cache_dir())
        title, release = spec.title, tree.release
        how = "VM, KVM" if accelerator() == "kvm" else "VM, emulated CPU (TCG)"
        run = run_in_vm(tree, results_file, VM_TIMEOUT_SECONDS)
        if _never_booted(run, results_file):
            first = _why_no_results(run)
            run = run_in_vm(tree, results_file, VM_TIMEOUT_SECONDS)
            run = replace(run, output=f"(first boot failed: {first})\n{run.output}")
    results = json.loads(results_file.read_text()) if results_file.is_file() else None
    error = "" if results else _why_no_results(run)
    return RowResult(name, title, release, how, run, results, error)


def _never_booted(run: Run, results_file: Path) -> bool:
    return (
        not results_file.is_file()
        and run.returncode != 0
        and not run.timed_out
        and run.seconds < BOOT_FAILURE_SECONDS
    )


def _why_no_results(run: Run) -> str:
    what = f"timed out after {run.seconds:.0f} s" if run.timed_out else f"exit {run.returncode}"
    return f"no results came back ({what}); output ends: {run.output[-OUTPUT_TAIL_CHARS:]}"

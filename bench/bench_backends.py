"""What each BPF backend costs a node: start-up time, memory, and what must be installed.

CO-RE loads the prebuilt object; BCC compiles the same C text at start-up with its own
clang/LLVM against the kernel's headers. Every start is a fresh Python process (imports
included, as `kvwatch run` pays them) that builds a `BpfCollector` and reports its time and
memory; the backends alternate, REPEATS starts each.

This kernel has BTF but no headers of its own, so BCC compiles against the Debian 6.1 headers
the kernel matrix fetches (BCC_KERNEL_SOURCE): compile time depends on the headers, not on
the running kernel. The programs then load and attach here (raw_tp), but with 6.1's field
offsets, so no record is read: whether BCC's records are right is tested in the kernel
matrix (tests/kernel/guest_bcc.py), on the kernel those headers belong to.

Disk: dpkg's Installed-Size of the run-time packages each backend needs beyond Python, and
the header tree BCC compiles against.

Run as root: `python -m bench.bench_backends` (or `make bench`). Writes
bench/results/backends.json and backends.png.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_result
from kvwatch.collect.bpf.bcc import HEADERS_ENV

REPEATS = 3
MB = 1_000_000
CORE_PACKAGES = ("libbpf1",)
# python3-bpfcc and what libbpfcc pulls in that CO-RE does not need (libbpf1 and libelf1 are
# shared).
BCC_PACKAGES = ("python3-bpfcc", "libbpfcc", "libllvm14", "libclang-cpp14")


def child(backend: str) -> None:
    """One start: import, build the collector, report, close. Prints one JSON line."""
    started = time.monotonic()
    from kvwatch.collect.bpf.collector import BpfCollector
    from kvwatch.collect.bpf.loader import CollectorSettings

    imported = time.monotonic()
    collector = BpfCollector(CollectorSettings(ports=(9,)), backend)  # type: ignore[arg-type]
    attached = time.monotonic()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    collector.close()
    print(
        json.dumps(
            {
                "import_seconds": imported - started,
                "start_seconds": attached - imported,
                "rss_mb": int(status["VmRSS"].split()[0]) * 1024 / MB,
                "peak_rss_mb": int(status["VmHWM"].split()[0]) * 1024 / MB,
                "attach_points": collector.report.describe(),
            }
        )
    )


def one_start(backend: str, headers: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_backends", "--child", backend],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, HEADERS_ENV: str(headers)},
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{backend} start failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def installed_mb(packages: tuple[str, ...]) -> dict[str, float]:
    sizes = {}
    for package in packages:
        kib = subprocess.run(
            ["dpkg-query", "-W", "-f=${Installed-Size}", package],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        sizes[package] = int(kib) * 1024 / MB
    return sizes


def tree_mb(root: Path) -> float:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink()) / MB


def summarise(starts: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("import_seconds", "start_seconds", "rss_mb", "peak_rss_mb")
    return {
        **{f"median_{key}": statistics.median(s[key] for s in starts) for key in keys},
        "attach_points": starts[-1]["attach_points"],
        "starts": starts,
    }


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["CO-RE", "BCC"]
    rows = [result["core"], result["bcc"]]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(12, 4))
    left.bar(names, [r["median_start_seconds"] for r in rows], color=["tab:blue", "tab:orange"])
    left.set_title("start-up: collector to attached (s)")
    middle.bar(names, [r["median_peak_rss_mb"] for r in rows], color=["tab:blue", "tab:orange"])
    middle.set_title("peak RSS of the process (MB)")
    right.bar(
        names,
        [result["disk_mb"]["core_total"], result["disk_mb"]["bcc_total"]],
        color=["tab:blue", "tab:orange"],
    )
    right.set_title("installed on the node (MB)")
    fig.suptitle(f"BPF backends, median of {REPEATS} starts each (kernel {result['kernel']})")
    fig.tight_layout()
    fig.savefig(RESULTS / "backends.png", dpi=110)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    from scripts.kernel_matrix.kernels import DEBIAN_KERNELS, cache_dir, fetch

    tree = fetch(next(s for s in DEBIAN_KERNELS if s.headers), cache_dir())
    assert tree.headers is not None
    starts: dict[str, list[dict[str, Any]]] = {"core": [], "bcc": []}
    for round_index in range(REPEATS):
        for backend, done in starts.items():
            done.append(one_start(backend, tree.headers))
            print(f"round {round_index + 1}: {backend} {done[-1]}", file=sys.stderr)
    core_disk = installed_mb(CORE_PACKAGES)
    core_disk["kvwatch.bpf.o"] = Path("agent/collect/bpf/kvwatch.bpf.o").stat().st_size / MB
    bcc_disk = installed_mb(BCC_PACKAGES)
    bcc_disk[f"headers ({tree.release})"] = tree_mb(tree.headers)
    result = {
        "headers": str(tree.headers),
        "core": summarise(starts["core"]),
        "bcc": summarise(starts["bcc"]),
        "disk_mb": {
            "core": core_disk,
            "bcc": bcc_disk,
            "core_total": sum(core_disk.values()),
            "bcc_total": sum(bcc_disk.values()),
        },
    }
    path = write_result("backends", result)
    plot({**result, "kernel": os.uname().release})
    print(json.dumps({k: v for k, v in result.items() if k != "headers"}, indent=1)[:3000])
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Reads the GPUs through kvwatch's GpuInventory (the real NVML) and prints what it saw as JSON.

    .venv/bin/python scripts/gpu_check.py [--pid PID ...]

Exit status 0 when NVML answered, 3 when it is unavailable (the reason is in the JSON). With
--pid, also prints the GPUs each of those processes uses (e.g. the reference engine on CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from kvwatch.collect.gpu import GpuInventory
from kvwatch.errors import EXIT_OK, EXIT_PRIVILEGE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pid", type=int, action="append", default=[], help="a process to look up")
    args = parser.parse_args(argv)
    started_ns = time.monotonic_ns()
    inventory = GpuInventory()
    init_ms = (time.monotonic_ns() - started_ns) / 1e6
    try:
        before_ns = time.monotonic_ns()
        snapshot = inventory.snapshot()
        snapshot_ms = (time.monotonic_ns() - before_ns) / 1e6
        report = {
            "available": inventory.available,
            "init_ms": round(init_ms, 3),
            "snapshot_ms": round(snapshot_ms, 3),
            "snapshot": dataclasses.asdict(snapshot),
            "pids": {
                str(pid): [use._asdict() for use in snapshot.process_gpu(pid)] for pid in args.pid
            },
        }
    finally:
        inventory.close()
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return EXIT_OK if report["available"] else EXIT_PRIVILEGE


if __name__ == "__main__":
    sys.exit(main())

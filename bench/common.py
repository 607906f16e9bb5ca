"""Shared bits of the benchmarks: where results go and how they are written."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("results")


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"kernel": platform.release(), "machine": platform.machine(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path

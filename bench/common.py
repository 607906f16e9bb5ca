"""Shared bits of the benchmarks: where results go, how they are written, and how a figure's
spread over runs is said."""

from __future__ import annotations

import json
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("results")


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"kernel": platform.release(), "machine": platform.machine(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def spread(values: Sequence[float], digits: int = 3) -> dict[str, float | None]:
    """A figure over runs (or samples): its median and its range; None where there are none."""
    if not values:
        return {"median": None, "min": None, "max": None}
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }

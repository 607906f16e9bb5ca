"""The real thing, end to end: the reference engine and the agent as processes, clients from
the load generator, everything on loopback (kvwatch.lab.harness.cut_stack)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwatch.lab.harness.cut_stack import CutStack


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[CutStack]:
    running = CutStack(tmp_path)
    try:
        yield running
    finally:
        running.close()

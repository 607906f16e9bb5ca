"""Kernel-matrix fixtures: what this kernel offers, the forced mode pairs, and a results file.

`guest_modes.py` runs inside each matrix VM (and directly on the CI kernel); with
`--matrix-results PATH` every test's outcome is written to PATH as JSON at the end of the
session, for `scripts/kernel_matrix` to turn into the compatibility table.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.kernel_offers import kernel_offers
from tests.kernel.plan import Combo, Offers, plan_combos

RESULTS_OPTION = "--matrix-results"
MESSAGE_CHARS = 6000


@functools.cache
def offers_here() -> Offers:
    return kernel_offers()


@pytest.fixture(scope="session")
def offers() -> Offers:
    return offers_here()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        RESULTS_OPTION, default=None, help="write each kernel-matrix test's outcome here (JSON)"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "exercises(*points): the attach points whose behaviour a matrix test checks (default all)",
    )
    path = config.getoption(RESULTS_OPTION)
    if path:
        config.pluginmanager.register(MatrixResults(Path(path)), "kvwatch-matrix-results")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "combo" in metafunc.fixturenames:
        combos = plan_combos(offers_here())
        metafunc.parametrize("combo", combos, ids=[c.id for c in combos], scope="module")


@contextmanager
def libbpf_log() -> Iterator[list[str]]:
    """Collects libbpf's own lines (verifier logs included) while the block runs."""
    lines: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("kvwatch.libbpf")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


class MatrixResults:
    """Pytest plugin: gathers each test's outcome and writes the results file at the end.
    Owns only its own list; the file is written once, in pytest_sessionfinish."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.combos: dict[str, Combo] = {}
        self.points: dict[str, list[str] | None] = {}
        self.tests: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            callspec = getattr(item, "callspec", None)
            combo = callspec.params.get("combo") if callspec else None
            if isinstance(combo, Combo):
                self.combos[item.nodeid] = combo
            marker = item.get_closest_marker("exercises")
            self.points[item.nodeid] = list(marker.args) if marker else None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        combo = self.combos.get(report.nodeid)
        entry = self.tests.setdefault(
            report.nodeid,
            {
                "module": report.nodeid.split("::")[0],
                "name": report.nodeid.split("::")[-1].split("[")[0],
                "combo": combo.id if combo else None,
                "points": self.points.get(report.nodeid),
                "outcome": "passed",
                "message": "",
                "duration_seconds": 0.0,
                "properties": {},
            },
        )
        entry["duration_seconds"] += report.duration
        entry["properties"].update(dict(report.user_properties))
        if report.failed or (report.skipped and entry["outcome"] == "passed"):
            entry["outcome"] = "failed" if report.failed else "skipped"
            entry["message"] = _message(report)

    def pytest_sessionfinish(self) -> None:
        offers = offers_here()
        combos = {combo.id: combo for combo in self.combos.values()}
        document = {
            "kernel": platform.release(),
            "session_seconds": time.monotonic() - self.started,
            "offers": offers,
            "combos": [
                {**asdict(combo), "id": combo.id, "points": combo.point_modes(offers)}
                for combo in combos.values()
            ],
            "tests": list(self.tests.values()),
        }
        self.path.write_text(json.dumps(document, indent=1) + "\n")


def _message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return report.longreprtext[-MESSAGE_CHARS:]

"""Fixtures for the verdict tests: network labs with a token server or the reference engine in
each, readers, and agents watching the server port (kvwatch.lab.labs). Everything is torn
down after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvwatch.lab.labs import Agent, EngineLab, Lab, start_token_lab
from kvwatch.lab.netlab import Link


@pytest.fixture
def labs(tmp_path: Path) -> Iterator[Callable[[Link], Lab]]:
    made: list[Lab] = []

    def make(link: Link) -> Lab:
        lab = start_token_lab(tmp_path, link)
        made.append(lab)
        return lab

    yield make
    for lab in made:
        lab.close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    running = Agent(tmp_path)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def engine_lab(tmp_path: Path) -> Iterator[Any]:
    made: list[EngineLab] = []

    def make(link: Link, *engine_args: str) -> EngineLab:
        lab = EngineLab(tmp_path, link, *engine_args)
        made.append(lab)
        return lab

    yield make
    for lab in made:
        lab.close()

"""The mutation fuzzer (tests/fuzz/mutate.py) at CI size: its properties hold, and the memory
of the process running the server does not grow once warm."""

from __future__ import annotations

import os
import random

from tests.fuzz.conftest import CASES_ENV, CI_CASES
from tests.fuzz.mutate import run

# The mutation fuzzer is cheap per case: it runs several times the hypothesis tests' cases.
MUTATION_FACTOR = 4
RSS_SLACK_MB = 8


def test_mutated_lines_through_codec_and_live_server() -> None:
    cases = int(os.environ.get(CASES_ENV, CI_CASES)) * MUTATION_FACTOR
    seed = random.randrange(2**32)
    report = run(cases, seed)  # the seed is in the report an assertion failure prints
    assert report["cases"] == cases
    assert isinstance(report["rss_end_mb"], float)
    assert isinstance(report["rss_peak_after_warmup_mb"], float)
    assert report["rss_end_mb"] <= report["rss_peak_after_warmup_mb"] + RSS_SLACK_MB, report

"""What the server sees of a reader that stops (issue 37; docs/collector.md, "What the server
sees of a reader that stops"; the lab is bench/visibility_lab.py, the whole grid
bench/bench_visibility.py).

The agent's backlog estimate, from the server's socket alone: (largest window the peer
advertised - its window now) + unacknowledged + not yet sent bytes. It shows a reader that
stopped only when the client's window shrinks as unread bytes pile up, and that depends on
how the server writes: Linux never shrinks the window it offered and rounds what is left up
to its window-scale unit (1 << the client's window scale), so writes smaller than that unit
leave the window where it was. With this machine's tcp_rmem (32 MB at most: window scale 10,
1 KB units) a token stream written one ~214-byte event at a time hides a stopped reader; the
same stream written in chunks of 1 KB or more shows it within seconds; a client with a stock
tcp_rmem (6 MB: scale 7, 128-byte units) shows it either way. Readers that keep up never
look backlogged.

Clients in their own network namespace over veth (MTU 1500, MSS 1448), its tcp_rmem set per
namespace, so the window scale is the test's, not the machine's. ~15 s.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from bench.bench_visibility import LARGE_RMEM_MAX, STOCK_TCP_RMEM, namespace_link
from bench.visibility_lab import (
    Case,
    ReaderSpec,
    WriterSpec,
    describe,
    estimate_reached,
    healthy_case,
    run_cases,
    stop_case,
)
from kvwatch.lab.netlab import Link

pytestmark = pytest.mark.slow

TOKENS_PER_SECOND = 35  # a busy engine's decode rate per request
PER_TOKEN = WriterSpec(TOKENS_PER_SECOND)  # one 214-byte SSE event per write
COALESCED = WriterSpec(TOKENS_PER_SECOND, coalesce_bytes=1024)  # 5 events, 1,070 bytes
READ_SECONDS = 1.0
# Measured on the CI kernel (bench/results/visibility.json): 1 KB chunks pass 2 s of the
# stream 3.6-3.7 s after the stop; per-token writes under scale 10 stay below 0.1 s of the stream
# for the whole 20 s watched; per-token writes under scale 7 pass 2 s after ~3.5 s; healthy
# readers' estimate stays below 0.3 s of the stream.
VISIBLE_WITHIN_SECONDS = 8.0
HIDDEN_FOR_SECONDS = 10.0
HEALTHY_SECONDS = 10.0
HEALTHY_BOUND_STREAM_SECONDS = 1.0
LARGE_TCP_RMEM = f"4096 131072 {LARGE_RMEM_MAX}"
LARGE_SCALE, STOCK_SCALE = 10, 7


def _until_two_seconds(writer: WriterSpec) -> Case:
    return stop_case(writer, READ_SECONDS, VISIBLE_WITHIN_SECONDS + 4, until=estimate_reached(2.0))


LARGE_SCALE_CASES = {
    "coalesced stops": _until_two_seconds(COALESCED),
    "per-token stops": stop_case(PER_TOKEN, READ_SECONDS, HIDDEN_FOR_SECONDS),
    "per-token reads": healthy_case(PER_TOKEN, ReaderSpec("continuous"), HEALTHY_SECONDS),
    "coalesced reads": healthy_case(COALESCED, ReaderSpec("continuous"), HEALTHY_SECONDS),
    "per-token 8 KB/s": healthy_case(PER_TOKEN, ReaderSpec("paced", rate=8192), HEALTHY_SECONDS),
}
STOCK_SCALE_CASES = {"per-token stops": _until_two_seconds(PER_TOKEN)}


def _run(cases: dict[str, Case], tcp_rmem: str) -> dict[str, dict[str, Any]]:
    with namespace_link(Link(), tcp_rmem) as connect:
        finished = run_cases(list(cases.values()), connect)
    by_case = {id(case): describe(case, running) for case, running in finished}
    return {name: by_case[id(case)] for name, case in cases.items()}


@pytest.fixture(scope="module")
def seen() -> Iterator[dict[str, dict[str, dict[str, Any]]]]:
    """Both namespaces' cases, side by side: what the server saw of each."""
    with ThreadPoolExecutor(2) as pool:
        large = pool.submit(_run, LARGE_SCALE_CASES, LARGE_TCP_RMEM)
        stock = pool.submit(_run, STOCK_SCALE_CASES, STOCK_TCP_RMEM)
        yield {"large": large.result(), "stock": stock.result()}


def test_the_clients_offer_the_window_scales_their_tcp_rmem_implies(
    seen: dict[str, dict[str, dict[str, Any]]],
) -> None:
    assert {row["peer_wscale"] for row in seen["large"].values()} == {LARGE_SCALE}
    assert {row["peer_wscale"] for row in seen["stock"].values()} == {STOCK_SCALE}


def test_coalesced_writes_show_a_reader_that_stops_within_seconds(
    seen: dict[str, dict[str, dict[str, Any]]],
) -> None:
    result = seen["large"]["coalesced stops"]["result"]
    crossed = result["estimate_2s"]["after_stop_s"]
    assert crossed is not None and crossed <= VISIBLE_WITHIN_SECONDS, result
    # The estimate trails the truth (the window shrinks by about half of what arrives), never
    # runs ahead of it.
    assert result["estimate_2s"]["true_backlog_s"] >= 2.0


def test_per_token_writes_hide_a_reader_that_stops_behind_a_coarse_window_scale(
    seen: dict[str, dict[str, dict[str, Any]]],
) -> None:
    result = seen["large"]["per-token stops"]["result"]
    assert result["watched_after_stop_s"] >= HIDDEN_FOR_SECONDS - 0.5
    assert result["estimate_1s"]["after_stop_s"] is None, result
    assert result["true_backlog_at_end_s"] >= HIDDEN_FOR_SECONDS - 1  # it did pile up
    # The client kept its window where it was: the right edge moved on with every token.
    assert result["window_at_end"] >= result["window_at_stop"] - 2048


def test_per_token_writes_show_it_when_the_window_scale_is_finer_than_a_token(
    seen: dict[str, dict[str, dict[str, Any]]],
) -> None:
    result = seen["stock"]["per-token stops"]["result"]
    crossed = result["estimate_2s"]["after_stop_s"]
    assert crossed is not None and crossed <= VISIBLE_WITHIN_SECONDS, result


@pytest.mark.parametrize("name", ["per-token reads", "coalesced reads", "per-token 8 KB/s"])
def test_readers_that_keep_up_never_look_backlogged(
    seen: dict[str, dict[str, dict[str, Any]]], name: str
) -> None:
    result = seen["large"][name]["result"]
    assert result["estimate_max_s"] < HEALTHY_BOUND_STREAM_SECONDS, result
    assert result["pauses"]["1s"] == 0

"""Reader-paced generation as users run it (issue 37's targets): what a reader that stops
costs, and what pacing does to readers that keep reading, with the agent off, cutting only,
parking only, and pacing (its defaults), directly and behind nginx and haproxy, on an idle and
a busy engine.

The engine is `kvwatch engine` with its defaults (the small model, coupled egress, a 64 KiB
SO_SNDBUF, events coalesced into ~1 KB / 500 ms writes); clients keep the kernel's default
receive buffers (autotuned; this machine's tcp_rmem allows 32 MB, so a window scale of 10);
everything on loopback. nginx runs as it comes (`proxy_buffering on`, its default) and, as a
variant, as SSE guides set it (`proxy_buffering off`: the lab's config); haproxy as it comes.
The agent is `kvwatch run` with its defaults but for the switches of bench/paced_lab.py's
AGENTS: off (observe), cut (--pause off --park off), park (--pause off: parks a request whose
reader has been behind park_seconds) and paced (pause, park, release: the defaults). An idle
engine runs one stream at a time; a busy one BUSY_STREAMS healthy streams beside it.

Per engine (and proxy) and agent configuration, one after another (bench/paced_lab.py):
1. a reader that keeps up gets a LIVE_TOKENS answer: the unpaced reference (first
   configuration only; it runs with no pause);
2. a reader that stops after its first 50 tokens, then one that stops after 10 s of reading,
   each on a LONG_TOKENS answer and alone on an idle engine: measured at its request's event
   (parked or ended, or its count still for STEADY_SECONDS where nothing parks it), bounded
   by EVENT_BOUND_SECONDS after the stop (then a lower bound, "censored"): the tokens the
   engine decoded after the stop (tokens_generated from GET /v1/requests less what the reader
   had read) in seconds of that stream's own pace (the reader's tokens over its reading
   time); the time from the stop to the agent's first decision about it (the evidence); and
   from the pause decision to the park's outcome (the engine's answer once the KV is freed);
3. four live readers together on LIVE_TOKENS answers (4 KB/s, 8 KB/s, one away for 10 s
   after its first second, one that reads everything once a second): whether each got the
   reference byte for byte (text, token for token, and its end), was cut, was held; their
   [DONE] (the end of the stream) against the same reader with the agent off;
4. holds decided for readers that keep up (the busy engine's healthy clients, the reference).

The grid is sized for a 2-core shared machine: the core rows (off and paced; direct, nginx,
haproxy; idle and busy) REPEATS times; cut and park once per core setup (the first
repetition: they differ from off and paced only in what the stopped reader costs, which
their one run shows); the variants once: nginx with proxy_buffering off, per-token writes
(coalescing off: the time to evidence, against cut-only, which is today's agent for such an
engine) and the 8 KiB engine / 4 KB client buffers. Every wait is for an event, bounded.

Run as root: `python -m bench.bench_paced` (or `make bench`; `--quick`: one repetition of
each core setup, no variants; `--topology haproxy`: that topology's setups only;
`--from-repetition 2`: the rest of a full run after a quick one; `--rows A B`: sum up the
rows of earlier runs together). Writes bench/results/paced.json and paced.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.common import RESULTS, write_result
from bench.paced_lab import (
    BUSY_STREAMS,
    LIVE_TOKENS,
    LONG_TOKENS,
    STOP_KINDS,
    AgentName,
    Background,
    Bed,
    Load,
    Setup,
    Topology,
    bed,
    healthy_holds,
    measure_live,
    measure_stop,
    reference,
)
from bench.paced_report import (
    TARGET_DECODED_SECONDS,
    TARGET_DONE_RATIO,
    TARGET_PAUSE_TO_KV_FREED_SECONDS,
    live_table,
    plot,
    stop_table,
    summarise,
    targets_met,
)
from kvwatch.errors import KvwatchError
from kvwatch.lab.labs import Stream

Row = dict[str, Any]

REPEATS = 3
TOPOLOGIES: tuple[Topology, ...] = ("direct", "nginx", "haproxy")
LOADS: tuple[Load, ...] = ("idle", "busy")
CORE = tuple(Setup(topology, load) for topology in TOPOLOGIES for load in LOADS)
CORE_AGENTS: tuple[AgentName, ...] = ("off", "paced")
ONCE_AGENTS: tuple[AgentName, ...] = ("cut", "park")
VARIANTS: tuple[tuple[Setup, tuple[AgentName, ...]], ...] = (
    (Setup("nginx-sse", "idle"), ("off", "paced")),
    (Setup("nginx-sse", "busy"), ("off", "paced")),
    (Setup("direct", "idle", coalesce=False), ("cut", "paced")),
    (Setup("direct", "busy", coalesce=False), ("cut", "paced")),
    (Setup("direct", "idle", small_buffers=True), ("off", "paced")),
    (Setup("direct", "idle"), ("off", "paced_1.5s")),
    (Setup("direct", "busy"), ("off", "paced_1.5s")),
)
WARMUP_SECONDS = 3.0


def run_agent(
    running: Bed, setup: Setup, agent: AgentName, expected: Stream | None
) -> tuple[dict[str, Any], Stream]:
    """One agent configuration on a running engine (and proxy): the reference (when not
    known yet), the stopping readers, the live readers, the healthy readers' holds."""
    started = time.monotonic()
    running.start_agent(agent)
    with Background(running.url, setup.load == "busy"):
        if setup.load == "busy":
            time.sleep(WARMUP_SECONDS)  # the healthy streams admitted and decoding
        if expected is None:
            assert agent in ("off", "cut"), "the reference is read with nothing paused"
            expected = reference(running, setup.buffer)
        stops = [dataclasses.asdict(measure_stop(running, agent, kind)) for kind in STOP_KINDS]
        live = measure_live(running, agent, expected)
        holds = healthy_holds(running)
    row = {
        "agent": agent,
        "stops": stops,
        "live": live,
        "healthy_holds": holds,
        "seconds": round(time.monotonic() - started, 1),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print(f"  {agent}: {summary_line(row)}", flush=True)
    return row, expected


def summary_line(row: dict[str, Any]) -> str:
    stops = ", ".join(
        f"{s['reader']} {s['decoded_after_stop_seconds']} s{'+' if s['censored'] else ''}"
        f" ({s['evidence']} after {s['stop_to_evidence_seconds']} s)"
        for s in row["stops"]
    )
    live = ", ".join(
        f"{r['reader']} {r['done_seconds']} s{'' if r['identical'] else ' DIFFERENT'}"
        f"{' CUT' if r['reset'] or r['cut_decisions'] else ''}"
        for r in row["live"]
    )
    return f"decoded after stop: {stops}; live [DONE]: {live}; healthy holds {row['healthy_holds']}"


def run_setup(
    setup: Setup, agents: Sequence[AgentName], repetition: int, engine: str
) -> list[dict[str, Any]]:
    """The agent configurations `agents`, one after another, on one engine (and proxy),
    named `engine` in each row (a live reader's [DONE] is compared on the same engine)."""
    print(f"{setup.label}, repetition {repetition}, {', '.join(agents)}", flush=True)
    rows, expected = [], None
    with bed(setup) as running:
        for agent in agents:
            row, expected = run_agent(running, setup, agent, expected)
            rows.append({**dataclasses.asdict(setup), "label": setup.label,
                         "repetition": repetition, "bed": engine, **row})  # fmt: skip
    return rows


def plan(
    quick: bool, topologies: Sequence[Topology], first_repetition: int = 1
) -> list[tuple[Setup, tuple[AgentName, ...], int]]:
    """The core setups of `topologies` (REPEATS times from `first_repetition`, or once where
    `quick`), then the variants (none where `quick`)."""
    core = [setup for setup in CORE if setup.topology in topologies]
    if quick:
        return [(setup, (*CORE_AGENTS, *ONCE_AGENTS), 1) for setup in core]
    runs = [
        (setup, CORE_AGENTS + (ONCE_AGENTS if repetition == 1 else ()), repetition)
        for repetition in range(first_repetition, REPEATS + 1)
        for setup in core
    ]
    return runs + [(setup, agents, 1) for setup, agents in VARIANTS]


def run(
    quick: bool, topologies: Sequence[Topology], first_repetition: int, rows_file: Path
) -> tuple[list[Row], list[str]]:
    """Every setup of the plan; each row is also appended to `rows_file` as it comes (JSON
    lines), so a run cut short keeps what it measured. A setup that failed is said, not
    fatal: the others still run. Engines are named by this run's start and their place in
    it, so rows of several runs summed up together never share one."""
    rows: list[Row] = []
    failures: list[str] = []
    run_name = time.strftime("%Y%m%dT%H%M%S")
    for index, (setup, agents, repetition) in enumerate(plan(quick, topologies, first_repetition)):
        try:
            found = run_setup(setup, agents, repetition, f"{run_name}-engine-{index}")
        except (AssertionError, KvwatchError, OSError, httpx.HTTPError) as exc:
            failures.append(f"{setup.label}, repetition {repetition}: {exc}")
            print(f"  failed: {exc}", flush=True)
            continue
        with rows_file.open("a") as out:
            out.writelines(json.dumps(row) + "\n" for row in found)
        rows += found
    return rows, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="each core setup once, no variants")
    parser.add_argument(
        "--topology",
        action="append",
        choices=TOPOLOGIES,
        help="only this one (repeat for more; default: direct, nginx and haproxy)",
    )
    parser.add_argument(
        "--from-repetition",
        type=int,
        choices=range(1, REPEATS + 1),
        default=1,
        metavar="K",
        help=f"go on from the core setups' repetition K (of {REPEATS}; cut and park run in the "
        "first only): with --rows of a --quick run, the rest of a full run",
    )
    parser.add_argument(
        "--rows",
        type=Path,
        nargs="+",
        help="sum up these rows (JSON lines of earlier runs, e.g. a --quick run's and a "
        "--from-repetition 2 run's) instead of running",
    )
    args = parser.parse_args()
    if args.quick and args.from_repetition != 1:
        parser.error("--quick runs one repetition; --from-repetition goes with a full run")
    started = time.monotonic()
    # A partial run (quick, or some topologies) is written beside the full one, not over it.
    name = "-".join(
        [
            "paced",
            *(["quick"] if args.quick else []),
            *(args.topology or []),
            *([f"from-{args.from_repetition}"] if args.from_repetition > 1 else []),
        ]
    )
    if args.rows:
        rows = [
            json.loads(line) for path in args.rows for line in path.read_text().splitlines() if line
        ]
        failures: list[str] = []
    else:
        rows_file = RESULTS / f"{name}-rows.jsonl"
        rows_file.unlink(missing_ok=True)
        rows, failures = run(
            args.quick, args.topology or TOPOLOGIES, args.from_repetition, rows_file
        )
    summary = summarise(rows)
    result = {
        "cpu_count": os.cpu_count(),
        "engine": "kvwatch engine, its defaults (the small model, 64 KiB SO_SNDBUF, 1 KB / "
        "500 ms writes)",
        "clients": "kernel-default receive buffers (tcp_rmem 4096 131072 33554432)",
        "long_tokens": LONG_TOKENS,
        "live_tokens": LIVE_TOKENS,
        "busy_streams": BUSY_STREAMS,
        "repeats": len({row["repetition"] for row in rows}),
        "seconds": round(time.monotonic() - started),
        "failures": failures,
        "summary": summary,
        "targets": {
            "decoded_after_stop_p99_seconds": TARGET_DECODED_SECONDS,
            "pause_to_kv_freed_p99_seconds": TARGET_PAUSE_TO_KV_FREED_SECONDS,
            "live_done_vs_off_max": TARGET_DONE_RATIO,
        },
        "met": targets_met(summary),
        "runs": rows,
    }
    path = write_result(name, result)
    if name == "paced":
        plot(rows)
    print("\n".join(stop_table(summary)))
    print()
    print("\n".join(live_table(summary)))
    print(f"{result['seconds']} s; written to {path}")


if __name__ == "__main__":
    main()

"""The CPU a token costs with the collector attached and without, for bench_collector.

Two measurements, each of many short phases with the collector's programs attached and
detached in turn (ABBA: off/on, then on/off), the programs loaded once so a phase can be short:
- `pump_pairs`: the TokenPump's watched and control sets. The send and ACK programs drop
  the control set's sockets at their first instructions, so the ratio of the two sets' cost
  per token, on against off, is what tracking a socket adds (ns per token, beyond what every
  socket pays: the dispatch, and the read attach point, which has no port filter); the machine's own
  drift cancels in it.
- `sse_pairs`: the TokenLoad (an SSE server and its reader, in a cgroup). Its CPU per token
  with the programs detached is the price a token has without kvwatch (the denominator of the
  overhead); its on/off ratio is the direct, noisier view of the same overhead, and the
  agent's table read, once per BPF_SCAN_SECONDS, is timed in its "on" phases.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from bench.token_load import TokenLoad, TokenPump
from kvwatch.collect.bpf.collector import BpfCollector
from kvwatch.collect.bpf.loader import BpfPrograms, CollectorSettings
from kvwatch.daemon.daemon import BPF_SCAN_SECONDS

PUMP_PAIRS = 120
PUMP_PHASE_SECONDS = 0.25
SSE_PAIRS = 40
SSE_PHASE_SECONDS = 0.5
BOOTSTRAP_RESAMPLES = 2000
P = TypeVar("P")


def median_ci(values: Sequence[float], seed: int = 16) -> dict[str, float]:
    """The median and a percentile-bootstrap 95% interval for it."""
    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP_RESAMPLES)
    )
    low, high = medians[int(0.025 * len(medians))], medians[int(0.975 * len(medians)) - 1]
    return {"median": statistics.median(values), "ci95_low": low, "ci95_high": high}


def rounded(summary: dict[str, float], scale: float = 1.0, digits: int = 1) -> dict[str, float]:
    return {name: round(value * scale, digits) for name, value in summary.items()}


def alternate(collector: BpfCollector, pairs: int, phase: Callable[[bool], P]) -> list[tuple[P, P]]:
    """`pairs` (off, on) phases in ABBA order, the collector's programs detached for "off"."""
    programs = collector.programs
    assert isinstance(programs, BpfPrograms)
    measured: list[tuple[P, P]] = []
    for index in range(pairs):
        phases: dict[bool, P] = {}
        for on in (False, True) if index % 2 == 0 else (True, False):
            if on:
                programs.resume()
            else:
                programs.pause()
            phases[on] = phase(on)
        measured.append((phases[False], phases[True]))
    return measured


@dataclass(frozen=True)
class PumpPhase:
    watched_ns_per_token: float
    control_ns_per_token: float

    @property
    def ratio(self) -> float:
        return self.watched_ns_per_token / self.control_ns_per_token


def pump_pairs(pump: TokenPump) -> list[tuple[PumpPhase, PumpPhase]]:
    def phase(_on: bool) -> PumpPhase:
        start = pump.read()
        time.sleep(PUMP_PHASE_SECONDS)
        end = pump.read()
        return PumpPhase(
            (end.watched_ns - start.watched_ns) / (end.watched_tokens - start.watched_tokens),
            (end.control_ns - start.control_ns) / (end.control_tokens - start.control_tokens),
        )

    collector = BpfCollector(CollectorSettings(ports=(pump.port,)))
    try:
        return alternate(collector, PUMP_PAIRS, phase)
    finally:
        collector.close()


def tracked_extra_ns(pairs: Sequence[tuple[PumpPhase, PumpPhase]]) -> list[float]:
    """Per pair: the ns a watched token costs beyond a control token, attached against detached."""
    return [(on.ratio / off.ratio - 1) * on.control_ns_per_token for off, on in pairs]


def summarize_pump(pairs: Sequence[tuple[PumpPhase, PumpPhase]]) -> dict[str, Any]:
    relative = [on.ratio / off.ratio - 1 for off, on in pairs]
    return {
        "pairs": len(pairs),
        "phase_seconds": PUMP_PHASE_SECONDS,
        "ns_per_token_off": round(statistics.median(off.watched_ns_per_token for off, _ in pairs)),
        "ns_per_token_off_spread": round(
            statistics.pstdev(off.watched_ns_per_token for off, _ in pairs)
            / statistics.mean(off.watched_ns_per_token for off, _ in pairs),
            3,
        ),
        "tracked_extra_percent_of_pump_token": rounded(median_ci(relative), 100, 3),
        "tracked_extra_ns_per_token": rounded(median_ci(tracked_extra_ns(pairs))),
    }


@dataclass(frozen=True)
class SsePhase:
    """One phase of the SSE load: tokens, the cgroup's CPU, wall time, the agent's reads."""

    tokens: int
    cpu_ns: int
    wall_ns: int
    agent_cpu_ns: float

    @property
    def cpu_per_token_ns(self) -> float:
        return self.cpu_ns / self.tokens


def sse_pairs(load: TokenLoad) -> list[tuple[SsePhase, SsePhase]]:
    collector = BpfCollector(CollectorSettings(ports=(load.port,)))

    def phase(on: bool) -> SsePhase:
        """With the programs attached, the table is read once mid-phase, and that read's CPU is
        scaled to the agent's rate of one read every BPF_SCAN_SECONDS."""
        start = load.read()
        agent_ns = 0.0
        time.sleep(SSE_PHASE_SECONDS / 2)
        if on:
            before = time.thread_time_ns()
            collector.samples()
            agent_ns = (time.thread_time_ns() - before) * SSE_PHASE_SECONDS / BPF_SCAN_SECONDS
        time.sleep(SSE_PHASE_SECONDS / 2)
        end = load.read()
        return SsePhase(
            end.tokens - start.tokens, end.cpu_ns - start.cpu_ns, end.at_ns - start.at_ns, agent_ns
        )

    try:
        collector.samples()  # the agent's first read converts everything: not steady state
        return alternate(collector, SSE_PAIRS, phase)
    finally:
        collector.close()


def summarize_sse(pairs: Sequence[tuple[SsePhase, SsePhase]]) -> dict[str, Any]:
    direct = [on.cpu_per_token_ns / off.cpu_per_token_ns - 1 for off, on in pairs]
    throughput = [(on.tokens / on.wall_ns) / (off.tokens / off.wall_ns) for off, on in pairs]
    offs = [off for off, _ in pairs]
    return {
        "pairs": len(pairs),
        "phase_seconds": SSE_PHASE_SECONDS,
        "cpu_per_token_ns_off": rounded(median_ci([p.cpu_per_token_ns for p in offs])),
        "cpu_per_token_ns_off_spread": round(
            statistics.pstdev(p.cpu_per_token_ns for p in offs)
            / statistics.mean(p.cpu_per_token_ns for p in offs),
            3,
        ),
        "tokens_per_second_off": round(statistics.median(p.tokens / p.wall_ns * 1e9 for p in offs)),
        "agent_read_ns_per_token": round(statistics.median(agent_read_ns(pairs)), 1),
        "direct_overhead_percent": rounded(median_ci(direct), 100, 3),
        "throughput_ratio": round(statistics.median(throughput), 4),
        "throughput_ratio_spread": round(statistics.pstdev(throughput), 4),
    }


def agent_read_ns(sse: Sequence[tuple[SsePhase, SsePhase]]) -> list[float]:
    """The collector's table read per token, in each "on" phase of the SSE load."""
    return [on.agent_cpu_ns / on.tokens for _, on in sse]


def overhead_percent(
    pump: Sequence[tuple[PumpPhase, PumpPhase]],
    sse: Sequence[tuple[SsePhase, SsePhase]],
    floor_ns_per_token: float,
    agent: Sequence[float],
) -> dict[str, float]:
    """What kvwatch adds to an SSE token's CPU, in percent: the pump's tracked extra, the
    dispatch floor every socket pays, and the agent's ns per token (`agent`: the table read's
    per phase, or the whole agent process's per window), over the SSE token's CPU with the
    programs detached. Median of the point estimates; the interval resamples each part."""
    extra = tracked_extra_ns(pump)
    prices = [off.cpu_per_token_ns for off, _ in sse]

    def estimate(extra_ns: float, price_ns: float, agent_ns: float) -> float:
        return 100 * (extra_ns + floor_ns_per_token + agent_ns) / price_ns

    point = estimate(statistics.median(extra), statistics.median(prices), statistics.median(agent))
    rng = random.Random(16)
    resampled = sorted(
        estimate(
            statistics.median(rng.choices(extra, k=len(extra))),
            statistics.median(rng.choices(prices, k=len(prices))),
            statistics.median(rng.choices(agent, k=len(agent))),
        )
        for _ in range(BOOTSTRAP_RESAMPLES)
    )
    return {
        "median": round(point, 3),
        "ci95_low": round(resampled[int(0.025 * len(resampled))], 3),
        "ci95_high": round(resampled[int(0.975 * len(resampled)) - 1], 3),
    }

"""Soak: a real agent enforcing (reset action) for minutes under connection churn, live slow
readers and a trickle of stalled clients; its memory and descriptors must stay flat, every
stall must be cut and no live reader ever.

The workload is bench/soak_lab.py; the lab is kvwatch.lab's (a server and a client network
namespace joined by veth, the token server in the server namespace at 16 KB/s per stream, on
SOAK_PORT); the agent is
started by kvwatch.lab.harness.stack with the verdict tests' settings (`kvwatch run --mode
enforce --action reset --grace-seconds 0`, its own hook socket, API port and audit log),
watching that port. For the whole run:
  churn     a child process in the client namespace opens CHURN_PER_SECOND connections a
            second, one at a time: half ask for a stream and read its first event, half send
            nothing; half end with a reset (SO_LINGER 0), half with an orderly close;
  live      LIVE_READERS readers at 4-8 KB/s (the agent's --min-reader-rate is 4 KB/s and
            the server writes 16 KB/s, so their windows touch zero all the time), with 64 KB
            and the kernel's default receive buffers, for the whole run: none may be cut;
  stalled   every STALL_EVERY_SECONDS a new reader that stops reading (at once, or after a
            few seconds at 16 KB/s; 4 KB and 64 KB buffers); the agent should reset it. One
            not cut within STALL_WAIT_SECONDS is closed and counted as missed; at most
            MAX_STALLED_OPEN are open at once;
  announced an engine hook keeps ANNOUNCED_STREAMS requests announced on the port (on
            addresses no socket has) and replaces a tenth of them every second, so the
            agent's registry and timelines churn too.
Every SAMPLE_SECONDS: the agent's RSS (VmRSS in /proc/PID/status), open descriptors
(/proc/PID/fd), threads and CPU share, its log's size, its socket table (/healthz), stream,
decision and action counts (/metrics), and the live readers cut so far.

Run as root: `python -m bench.bench_soak` (10 minutes; `--minutes N`; `--short` is a one-minute
smoke run whose results go to a temporary directory unless `--output` says where). Writes
soak.json (settings, the samples, the summary: RSS start/end/max and its slope in MB an hour
after warm-up, descriptors, stalls acted on, live readers cut, churn achieved) and soak.png.
MB are 10^6 bytes. Ctrl-C stops everything it started and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import signal
import statistics
import subprocess
import tempfile
import time
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import httpx

from bench.common import RESULTS, spread, write_result
from bench.soak_lab import (
    AGENT_ARGS,
    ANNOUNCED_STREAMS,
    CHURN_PER_SECOND,
    DEFAULT_MINUTES,
    GUARANTEE,
    LIVE_BUFFERS,
    LIVE_PER_SHAPE,
    LIVE_RATES,
    LIVE_READERS,
    MAX_STALLED_OPEN,
    REPLACED_PER_SECOND,
    SAMPLE_SECONDS,
    SHORT_MINUTES,
    SOAK_PORT,
    STALL_EVERY_SECONDS,
    STALL_WAIT_SECONDS,
    STALLED_RATE,
    STALLED_SHAPES,
    WARMUP_SECONDS,
    Announced,
    AuditTail,
    Run,
    Stalled,
    TerminatedError,
    Trickle,
    churn,
    drive,
    no_request,
    on_sigterm,
    start_lab,
)
from kvwatch.hook import EngineHook, EngineInfo
from kvwatch.lab.harness.stack import Stack
from kvwatch.lab.labs import SERVER_BYTES_PER_SECOND
from kvwatch.lab.readers import Reader


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares line through (seconds, value): (slope per second, value at 0)."""
    if len(points) < 3:
        return None
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / spread
    return slope, mean_v - slope * mean_t


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    fit = linear_fit(points)
    return None if fit is None else 3600 * fit[0]


def stalled_client(stalled: Stalled, acts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One stalled client: its shape, whether it was acted on, and when."""
    reader, act = stalled.reader, acts.get(stalled.reader.local)
    row: dict[str, Any] = {
        "name": reader.name,
        "buffer": reader.buffer,
        "reads_for_s": reader.read_seconds,
        "acted": act is not None,
        "client_reset": bool(reader.reset_ns),
        "outcome": stalled.outcome or "open at the end",
    }
    if act is not None:
        evidence = act["evidence"]
        row["required_s"] = evidence["stall_required_seconds"]
        row["stalled_s"] = evidence["stalled_seconds"]
        if reader.stopped_ns:
            row["decision_after_last_read_s"] = round(
                (act["monotonic_ns"] - reader.stopped_ns) / 1e9, 2
            )
    return row


def stalled_summary(run: Run, end_ns: int) -> dict[str, Any]:
    acts = run.audit.acts
    stalled = run.trickle.all()
    clients = [stalled_client(s, acts) for s in stalled]
    after_stop = [
        c["decision_after_last_read_s"] for c in clients if "decision_after_last_read_s" in c
    ]
    required = [c["required_s"] for c in clients if "required_s" in c]
    pending = [s for s in stalled if not s.outcome and s.reader.local not in acts]
    by_shape = {
        f"{buffer}, reads {reads_for:g} s": {
            "decision_after_last_read_s": spread(
                [
                    c["decision_after_last_read_s"]
                    for c in clients
                    if c["buffer"] == buffer
                    and c["reads_for_s"] == reads_for
                    and "decision_after_last_read_s" in c
                ]
            ),
            "required_s": spread(
                [
                    c["required_s"]
                    for c in clients
                    if c["buffer"] == buffer and c["reads_for_s"] == reads_for and "required_s" in c
                ]
            ),
        }
        for buffer, reads_for in STALLED_SHAPES
    }
    return {
        "started": run.trickle.started,
        "acted_on": sum(s.reader.local in acts for s in stalled),
        "reset_seen_by_client": sum(bool(s.reader.reset_ns) for s in stalled),
        "missed": [s.reader.name for s in stalled if s.outcome == "missed"],
        "pending_at_end": [
            {"name": s.reader.name, "age_s": round(end_ns / 1e9 - s.started, 1)} for s in pending
        ],
        "decision_after_last_read_s": spread(after_stop),
        "required_s": spread(required),
        "by_shape": by_shape,
        "clients": clients,
    }


def live_summary(run: Run, seconds: float) -> dict[str, Any]:
    short = [
        {"name": r.name, "bytes_read": r.bytes_read, "expected": int(r.rate * seconds)}
        for r in run.live
        if r.bytes_read < 0.9 * r.rate * (seconds - 5)
    ]
    return {
        "readers": len(run.live),
        "cut": run.live_cut(),
        "read_less_than_90_percent_of_their_rate": short,
        "bytes_read": {r.name: r.bytes_read for r in run.live},
    }


def summarize(run: Run, seconds: float, agent_exit: int | None) -> dict[str, Any]:
    rows = run.samples
    warmup = min(WARMUP_SECONDS, seconds / 5)
    warm = [r for r in rows if r["t"] >= warmup] or rows
    elapsed = rows[-1]["t"]
    rss = [r["rss_mb"] for r in rows]
    fds = [r["fds"] for r in rows]
    slope = slope_per_hour([(r["t"], r["rss_mb"]) for r in warm])
    half = [r for r in rows if r["t"] >= elapsed / 2]
    half_slope = slope_per_hour([(r["t"], r["rss_mb"]) for r in half])
    anon_slope = slope_per_hour([(r["t"], r["rss_anon_mb"]) for r in warm])
    fd_slope = slope_per_hour([(r["t"], r["fds"]) for r in warm])
    cpu = [r["cpu_percent_of_core"] for r in rows[1:]]
    unexplained = sorted(
        set(run.audit.acts)
        - {s.reader.local for s in run.trickle.all()}
        - {r.local for r in run.live}
    )
    return {
        "elapsed_s": elapsed,
        "agent_exit_status": agent_exit,
        "rss_mb": {
            "start": rss[0],
            "after_warmup": warm[0]["rss_mb"],
            "end": rss[-1],
            "max": max(rss),
            "slope_mb_per_hour_after_warmup": round(slope, 2) if slope is not None else None,
            "slope_mb_per_hour_second_half": (
                round(half_slope, 2) if half_slope is not None else None
            ),
            "anon_slope_mb_per_hour_after_warmup": (
                round(anon_slope, 2) if anon_slope is not None else None
            ),
            "warmup_s": warmup,
        },
        "fds": {
            "start": fds[0],
            "end": fds[-1],
            "max": max(fds),
            "slope_per_hour_after_warmup": round(fd_slope, 2) if fd_slope is not None else None,
        },
        "threads_max": max(r["threads"] for r in rows),
        "cpu_percent_of_core": {
            "mean": round(statistics.fmean(cpu), 1) if cpu else None,
            "max": max(cpu, default=None),
        },
        "log_bytes_end": rows[-1]["log_bytes"],
        "churn": {
            "target_per_second": CHURN_PER_SECOND,
            "connections_made": run.made.value,
            "failed": run.failed.value,
            "achieved_per_second": round(run.made.value / elapsed) if elapsed else 0,
        },
        "stalled": stalled_summary(run, time.monotonic_ns()),
        "live": live_summary(run, elapsed),
        "acts_on_other_connections": unexplained,
        "audit_outcomes": run.audit.outcomes,
        "failed_scrapes": run.failed_scrapes,
    }


def provenance() -> dict[str, Any]:
    """Which code ran: the checkout the kvwatch package comes from, its commit and any
    uncommitted change under the agent's sources there."""
    import kvwatch

    source = Path(kvwatch.__file__).resolve().parent
    root = source.parent

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=False
        )
        return done.stdout.strip()

    return {
        "kvwatch_from": str(source),
        "commit": git("rev-parse", "HEAD"),
        "uncommitted": git("status", "--porcelain", "--", "agent", "exporters", "bpf").splitlines(),
    }


# ------------------------------------------------------------------------------- run


def run_soak(seconds: float) -> dict[str, Any]:
    context = multiprocessing.get_context("fork")
    made: Synchronized[int] = context.Value("q", 0)
    failed: Synchronized[int] = context.Value("q", 0)
    with tempfile.TemporaryDirectory(prefix="kvwatch-soak-") as tmp:
        workdir = Path(tmp)
        lab = start_lab(workdir)
        agent = Stack(workdir)
        hook: EngineHook | None = None
        churner = context.Process(
            target=churn,
            args=(lab.net.client_ns, lab.net.server_ip, seconds, made, failed),
            daemon=True,
        )
        trickle = Trickle(lab)
        try:
            service = agent.start_agent(*AGENT_ARGS, port=SOAK_PORT)
            health = httpx.get(f"{agent.agent_url}/healthz", timeout=5).json()
            hook = EngineHook(
                EngineInfo("soak", "m", 1, 16, "cpu", 1 << 20), no_request, str(agent.hook_socket)
            )
            hook.start()
            churner.start()
            for rate in LIVE_RATES:
                for buffer in LIVE_BUFFERS:
                    for i in range(LIVE_PER_SHAPE):
                        reader = Reader(f"live-{buffer}-{rate}-{i}", buffer, rate)
                        lab.readers.append(reader)
                        reader.connect(lab.net.client_socket(), lab.net.server_ip, SOAK_PORT)
            live = list(lab.readers)
            run = Run(agent, service.pid, lab, live, trickle, AuditTail(agent.audit), made, failed)
            agent_exit = drive(run, seconds, Announced(hook, lab.net.server_ip))
            log_tail = service.log.read_text(errors="replace")[-4000:]
        finally:
            if churner.pid is not None:
                churner.terminate()
                churner.join(5)
            if hook is not None:
                hook.stop()
            trickle.close()
            agent.close()
            lab.close()
    result = {
        "settings": settings(seconds, health),
        "provenance": provenance(),
        "summary": summarize(run, seconds, agent_exit),
        "samples": run.samples,
    }
    if agent_exit is not None:
        result["agent_log_tail"] = log_tail
    return result


def settings(seconds: float, health: dict[str, Any]) -> dict[str, Any]:
    return {
        "seconds": seconds,
        "sample_seconds": SAMPLE_SECONDS,
        "agent": " ".join(["kvwatch run --port", str(SOAK_PORT), *AGENT_ARGS]),
        "backend": health["backend"],
        "server_bytes_per_second": SERVER_BYTES_PER_SECOND,
        "min_reader_bytes_per_second": GUARANTEE,
        "churn_per_second": CHURN_PER_SECOND,
        "live_readers": {
            "count": LIVE_READERS,
            "rates": list(LIVE_RATES),
            "buffers": list(LIVE_BUFFERS),
        },
        "stalled": {
            "every_s": STALL_EVERY_SECONDS,
            "shapes": [{"buffer": b, "reads_for_s": s} for b, s in STALLED_SHAPES],
            "rate_before_stopping": STALLED_RATE,
            "wait_s": STALL_WAIT_SECONDS,
            "max_open": MAX_STALLED_OPEN,
        },
        "announced_streams": ANNOUNCED_STREAMS,
        "replaced_per_second": REPLACED_PER_SECOND,
    }


def plot(result: dict[str, Any], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, summary = result["samples"], result["summary"]
    minutes = [r["t"] / 60 for r in rows]
    fig, (memory, fds, work) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    memory.plot(minutes, [r["rss_mb"] for r in rows], color="tab:green", label="RSS")
    end = rows[-1]["t"]
    for name, since, style in (
        ("after warm-up", summary["rss_mb"]["warmup_s"], ":"),
        ("second half", end / 2, "--"),
    ):
        fit = linear_fit([(r["t"], r["rss_mb"]) for r in rows if r["t"] >= since])
        if fit is None:
            continue
        memory.plot(
            [since / 60, end / 60],
            [fit[1] + fit[0] * since, fit[1] + fit[0] * end],
            color="black",
            linestyle=style,
            linewidth=0.8,
            label=f"fit {name}: {3600 * fit[0]:+.2f} MB/h",
        )
    memory.set_ylabel("agent RSS (MB)")
    memory.legend(loc="lower right")
    churn_stats, stalled, live = summary["churn"], summary["stalled"], summary["live"]
    memory.set_title(
        f"soak, {summary['elapsed_s'] / 60:.0f} min: {churn_stats['achieved_per_second']} "
        f"connections/s, {live['readers']} live readers ({len(live['cut'])} cut),\n"
        f"{stalled['started']} stalled clients: {stalled['acted_on']} cut, "
        f"{len(stalled['missed'])} missed, {len(stalled['pending_at_end'])} still open at the end"
    )
    fds.plot(minutes, [r["fds"] for r in rows], color="tab:blue", label="open descriptors")
    fds.plot(minutes, [r["threads"] for r in rows], color="tab:grey", label="threads")
    fds.set_ylabel("agent descriptors, threads")
    fds.set_ylim(bottom=0)
    fds.legend(loc="lower right")
    work.plot(
        minutes,
        [r.get("table_tracked") for r in rows],
        color="tab:purple",
        label="socket table (tracked)",
    )
    work.plot(minutes, [r["acts"] for r in rows], color="tab:red", label="stalls acted on")
    work.plot(minutes, [r["live_readers_cut"] for r in rows], color="black", label="live cut")
    work.set_xlabel("minutes")
    work.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(output / "soak.png", dpi=100)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_soak",
        description=(
            "Soak a real kvwatch agent (enforce mode, reset action) for minutes under "
            f"connection churn ({CHURN_PER_SECOND}/s), {LIVE_READERS} live readers at 4-8 KB/s "
            f"and a stalled client every {STALL_EVERY_SECONDS:g} s, in a network-namespace "
            f"lab. Measures, every {SAMPLE_SECONDS:g} s, the agent's RSS, open descriptors, "
            "threads and CPU, its socket table and decision/action counts, and the live "
            "readers cut (must be 0). Writes soak.json and soak.png. Root only."
        ),
    )
    parser.add_argument("--minutes", type=float, default=None, help="default 10")
    parser.add_argument(
        "--short",
        action="store_true",
        help=f"a {SHORT_MINUTES:g}-minute smoke run; results to a temporary directory",
    )
    parser.add_argument("--output", type=Path, default=None, help="where soak.json and soak.png go")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    minutes = args.minutes or (SHORT_MINUTES if args.short else DEFAULT_MINUTES)
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = run_soak(60 * minutes)
    except (KeyboardInterrupt, TerminatedError):
        print("interrupted: everything started was stopped; nothing written")
        raise SystemExit(130) from None
    output: Path = args.output or (
        Path(tempfile.mkdtemp(prefix="kvwatch-soak-results-")) if args.short else RESULTS
    )
    if output.resolve() == RESULTS.resolve():
        path = write_result("soak", result)
    else:
        output.mkdir(parents=True, exist_ok=True)
        path = output / "soak.json"
        payload = {"kernel": platform.release(), "machine": platform.machine(), **result}
        path.write_text(json.dumps(payload, indent=2) + "\n")
    plot(result, output)
    summary = result["summary"]
    shown = summary | {
        "live": {k: v for k, v in summary["live"].items() if k != "bytes_read"},
        "stalled": {k: v for k, v in summary["stalled"].items() if k != "clients"},
    }
    print(json.dumps(shown, indent=2))
    print(f"written to {path} and {output / 'soak.png'}")


if __name__ == "__main__":
    main()

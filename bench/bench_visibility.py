"""What the server sees of a reader that stops (issue 37, item 1).

An LLM server streams tokens; a client that stops reading but keeps its connection open
still has the engine decode for it. The agent can only see that from the server's side of
the TCP connection: the peer's window, the largest it advertised, unacknowledged and unsent
bytes. This bench measures, per case, how long after the reader's last read the server's
view shows it, and how much the reader holds meanwhile (bench/visibility_lab.py runs the
cases; its docstring says what is sampled and how the estimate is made):

- writers: SSE events of 214 bytes (and vLLM-like 300) at 35 tokens/s (a busy engine) and
  100 tokens/s (an idle one), one write per token (TCP_NODELAY) or coalesced into chunks of
  S bytes (512 ... 4096), flushed after 250 ms at the latest (and other intervals);
- readers: the kernel's default receive buffer (autotuned), reading what arrives for 1, 10
  or 30 s and then never again; a 4 KB SO_RCVBUF variant; healthy readers (reading what
  arrives, 4 and 8 KB/s, draining once a second) for the estimate's false alarms;
- topologies: loopback; two network namespaces over veth (MTU 1500, RTT ~0) and over the
  TUN delay line with RTT 50 ms (agent/lab/netlab.py);
- kernels as the receiver: this one, and Debian's 6.1 and 6.12 booted in virtme-ng VMs
  (scripts/kernel_matrix), where writer and reader both run in the guest over loopback
  (a smaller grid: bench/visibility_lab.py `vm_grid`).

Run (root): `python -m bench.bench_visibility` (~17 min: ~2.5 min a topology, ~3 min a
VM; `--quick` for loopback and a smaller grid, printed only; `--no-vm` to skip the VMs;
`--keep --topologies ""` to reprint and replot what is there). Writes
bench/results/visibility.json and visibility.png, and prints the tables docs/collector.md
quotes ("What the server sees of a reader that stops").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_result
from bench.visibility_lab import (
    VLLM_EVENT_BYTES,
    Case,
    Connect,
    Connection,
    ReaderSpec,
    WriterSpec,
    healthy_case,
    kernel_settings,
    loopback_connect,
    run_and_describe,
    stop_case,
)

COALESCE_SIZES = (512, 768, 1024, 1500, 2048, 4096)
TOKEN_RATES = (35, 100)
READ_SECONDS = (1.0, 10.0, 30.0)
WATCH_SECONDS = 20.0
HEALTHY_SECONDS = 20.0
# Honest: the estimate passes 2 s of the stream at most this long after the reader stopped.
HONEST_WITHIN_SECONDS = 6.0
VM_TIMEOUT_SECONDS = 900.0
TOPOLOGIES = ("loopback", "veth", "veth-rmem6m", "delay50")
# The client namespace's tcp_rmem as a stock kernel has it (this machine's is 32 MB at most):
# the largest buffer decides the window scale the client offers (6 MB: 7, 32 MB: 10).
STOCK_TCP_RMEM = "4096 131072 6291456"
LARGE_RMEM_MAX = 33554432


def writers(rate: float) -> list[WriterSpec]:
    return [WriterSpec(rate)] + [WriterSpec(rate, coalesce_bytes=s) for s in COALESCE_SIZES]


def stop_grid(quick: bool) -> list[Case]:
    """Every writer at both rates against readers that stop; the extra variants."""
    reads = (1.0, 10.0) if quick else READ_SECONDS
    cases = [
        stop_case(w, r, WATCH_SECONDS) for rate in TOKEN_RATES for w in writers(rate) for r in reads
    ]
    vllm = [WriterSpec(35, VLLM_EVENT_BYTES), WriterSpec(35, VLLM_EVENT_BYTES, 1024)]
    cases += [stop_case(w, r, WATCH_SECONDS) for w in vllm for r in (1.0, 10.0)]
    small = (WriterSpec(35), WriterSpec(35, coalesce_bytes=1024))
    cases += [stop_case(w, 1.0, WATCH_SECONDS, rcvbuf=4096) for w in small]
    intervals = [WriterSpec(35, coalesce_bytes=1024, flush_seconds=f) for f in (0.1, 0.5)]
    intervals += [WriterSpec(35, coalesce_bytes=4096, flush_seconds=f) for f in (0.5, 1.0)]
    cases += [stop_case(w, 1.0, WATCH_SECONDS) for w in intervals]
    return cases


def healthy_grid(quick: bool) -> list[Case]:
    readers = [
        ReaderSpec("continuous"),
        ReaderSpec("paced", rate=4096),
        ReaderSpec("paced", rate=8192),
        ReaderSpec("bursty", burst_seconds=1.0),
    ]
    chosen = [WriterSpec(35), WriterSpec(35, coalesce_bytes=1024), WriterSpec(100)]
    if not quick:
        chosen += [WriterSpec(100, coalesce_bytes=1024), WriterSpec(35, coalesce_bytes=4096)]
    cases = [healthy_case(w, r, HEALTHY_SECONDS) for w in chosen for r in readers]
    small = ReaderSpec("continuous", rcvbuf=4096)
    return [*cases, healthy_case(WriterSpec(35, coalesce_bytes=1024), small, HEALTHY_SECONDS)]


@contextlib.contextmanager
def namespace_link(link: Any, client_tcp_rmem: str | None = None) -> Iterator[Connect]:
    """Connections from a client namespace to a server namespace over `link` (a
    kvwatch.lab.netlab.Link); the client namespace's tcp_rmem set when given."""
    from kvwatch.lab.netlab import NetLab

    lab = NetLab(link)
    try:
        if client_tcp_rmem is not None:
            sysctl = ["sysctl", "-qw", f"net.ipv4.tcp_rmem={client_tcp_rmem}"]
            subprocess.run(["ip", "netns", "exec", lab.client_ns, *sysctl], check=True)
        listener = lab.run_in(lab.server_ns, lambda: socket.create_server((lab.server_ip, 0)))

        def connect(rcvbuf: int | None) -> Connection:
            client = lab.client_socket()
            if rcvbuf is not None:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            client.connect(listener.getsockname())
            server, _ = listener.accept()
            return Connection(server, client)

        yield connect
        listener.close()
    finally:
        lab.close()


@contextlib.contextmanager
def topology(name: str) -> Iterator[Connect]:
    """A way to make connections whose client end is the receiver under test."""
    if name == "loopback":
        yield loopback_connect
        return
    from kvwatch.lab.netlab import Link

    link = Link(delay_ms=25) if name == "delay50" else Link()
    rmem = STOCK_TCP_RMEM if name == "veth-rmem6m" else None
    with namespace_link(link, rmem) as connect:
        yield connect


def run_topology(name: str, quick: bool, parallel: int) -> dict[str, Any]:
    started = time.monotonic()
    with topology(name) as connect:
        rows = run_and_describe(stop_grid(quick) + healthy_grid(quick), connect, parallel)
    print(f"{name}: {len(rows)} cases in {time.monotonic() - started:.0f} s", flush=True)
    settings = kernel_settings()
    return {
        "kernel": settings,
        "topology": name,
        "client_tcp_rmem": STOCK_TCP_RMEM if name == "veth-rmem6m" else settings["tcp_rmem"],
        "seconds": round(time.monotonic() - started, 1),
        "cases": rows,
    }


def run_vm(kernel: str, watch_seconds: float) -> dict[str, dict[str, Any]]:
    """bench/visibility_lab.py's VM grid inside a virtme-ng guest running `kernel`: with the
    kernel's own tcp_rmem, then with this machine's largest buffer (32 MB: window scale 10)."""
    from scripts.kernel_matrix import vm
    from scripts.kernel_matrix.kernels import DEBIAN_KERNELS, cache_dir, fetch

    spec = next(s for s in DEBIAN_KERNELS if s.name == kernel)
    tree = fetch(replace(spec, headers=False), cache_dir())
    out_dir = Path("/tmp") / f"kvwatch-visibility-{kernel}"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / "visibility.json"
    out.unlink(missing_ok=True)
    guest = [
        sys.executable, "-m", "bench.visibility_lab", "--watch", str(watch_seconds),
        "--rmem-max", str(LARGE_RMEM_MAX), "--out", str(out),
    ]  # fmt: skip
    run = vm.run(vm.vng_command(tree, out_dir, guest), VM_TIMEOUT_SECONDS, {})
    if not out.is_file():
        raise RuntimeError(f"{kernel}: the guest wrote no results:\n{run.output[-3000:]}")
    print(f"{kernel}: VM run {run.seconds:.0f} s", flush=True)
    found: dict[str, dict[str, Any]] = {}
    for guest_run in json.loads(out.read_text())["runs"]:
        largest = int(guest_run["client_tcp_rmem"].split()[-1])
        name = kernel if largest != LARGE_RMEM_MAX else f"{kernel}, tcp_rmem max 32 MB"
        guest_run.update(
            topology=f"loopback in a VM ({vm.accelerator()})", package=tree.package,
            vm_wall_seconds=round(run.seconds, 1),
        )  # fmt: skip
        found[name] = guest_run
    return found


# --- Tables and the recommendation ---------------------------------------------------------


def _fmt(value: float | None, unit: str = "") -> str:
    return "—" if value is None else f"{value:g}{unit}"


def stop_rows(run: dict[str, Any]) -> list[str]:
    """One markdown row per stop case: when the estimate and the edge show it, and the error."""
    rows = []
    for case in run["cases"]:
        if case["reader"]["kind"] != "stop":
            continue
        r = case["result"]
        one, two = r["estimate_1s"], r["estimate_2s"]
        rcvbuf = r["client_rcvbuf"]
        rows.append(
            f"| {case['writer']['label']} | {case['writer']['tokens_per_second']:g} "
            f"| {case['writer']['event_bytes']} | {case['reader']['label']} "
            f"| {_fmt(one['after_stop_s'])} | {_fmt(two['after_stop_s'])} "
            f"| {_fmt(two.get('true_backlog_s'))} | {_fmt(r['estimate_s_at']['+10s'])} "
            f"| {r['true_backlog_at_end_s']:g} | {_fmt(r['edge_still_2s_after_stop_s'])} "
            f"| {r['window_at_stop']}→{r['window_at_end']} "
            f"| {rcvbuf['stop'] // 1024}→{rcvbuf['end'] // 1024} K |"
        )
    return rows


STOP_HEADER = (
    "| writes | tok/s | event B | reader | est ≥ 1 s at (s after stop) | est ≥ 2 s at "
    "| truth then (s of stream) | est at +10 s (s) | truth at end (s) | edge still 2 s at "
    "| window stop→end | client rcvbuf stop→end |\n|" + "---|" * 12
)


def healthy_rows(run: dict[str, Any]) -> list[str]:
    rows = []
    for case in run["cases"]:
        if case["reader"]["kind"] == "stop":
            continue
        r, w = case["result"], case["writes"]
        rows.append(
            f"| {case['writer']['label']} | {case['writer']['tokens_per_second']:g} "
            f"| {case['reader']['label']} | {r['estimate_max_s']:g} | {r['true_backlog_max_s']:g} "
            f"| {r['pauses']['2s']} | {r['false_pauses']['2s']} | {r['false_pauses']['1s']} "
            f"| {r['right_edge_still_max_s']:g} | {w['token_wait_ms']['p50']:g} / "
            f"{w['token_wait_ms']['max']:g} |"
        )
    return rows


HEALTHY_HEADER = (
    "| writes | tok/s | reader | est max (s) | truth max (s) | est ≥ 2 s | false ≥ 2 s "
    "| false ≥ 1 s | edge still max (s) | token wait p50 / max (ms) |\n|" + "---|" * 10
)


def honest_sizes(run: dict[str, Any]) -> dict[str, Any]:
    """Per token rate, the smallest write size whose stopped readers (every read time) all
    pass 2 s of the stream within HONEST_WITHIN_SECONDS of the stop, 214-byte events,
    default buffer, 250 ms interval."""
    verdicts: dict[tuple[float, int], bool] = {}
    for case in run["cases"]:
        w, reader = case["writer"], case["reader"]
        if reader["kind"] != "stop" or reader["rcvbuf"] is not None:
            continue
        if w["event_bytes"] != 214 or w["flush_seconds"] != 0.25:
            continue
        after = case["result"]["estimate_2s"]["after_stop_s"]
        honest = after is not None and after <= HONEST_WITHIN_SECONDS
        key = (w["tokens_per_second"], w["coalesce_bytes"] or 0)
        verdicts[key] = verdicts.get(key, True) and honest
    found: dict[str, Any] = {}
    for rate in sorted({k[0] for k in verdicts}):
        sizes = sorted(size for (r, size), ok in verdicts.items() if r == rate and ok)
        found[f"{rate:g} tok/s"] = {
            "smallest_honest_bytes": sizes[0] if sizes else None,
            "honest": {str(size): ok for (r, size), ok in sorted(verdicts.items()) if r == rate},
        }
    return found


DOC_WRITERS = (None, 512, 768, 1024, 4096)


def _doc_cell(case: dict[str, Any] | None) -> str:
    """`3.6` (s from the stop until the estimate passed 2 s of the stream), or `— 0.1` (not
    within the run; the estimate at its end, s of the stream)."""
    if case is None:
        return ""
    result = case["result"]
    crossed = result["estimate_2s"]["after_stop_s"]
    return f"{crossed:g}" if crossed is not None else f"— {result['estimate_at_end_s']:g}"


def doc_table(runs: dict[str, dict[str, Any]]) -> str:
    """docs/collector.md's table: per receiver and write size, 214-byte events, default
    buffer, 250 ms interval; one column per token rate and read time."""
    columns = [(rate, read) for rate in TOKEN_RATES for read in READ_SECONDS]
    head = " | ".join(f"{rate} tok/s, read {read:g} s" for rate, read in columns)
    lines = [f"| receiver (window scale) | writes | {head} |", "|---|---|" + "---|" * len(columns)]
    for name, run in runs.items():
        for size in DOC_WRITERS:
            found = {
                (c["writer"]["tokens_per_second"], c["reader"]["read_seconds"]): c
                for c in run["cases"]
                if c["reader"]["kind"] == "stop" and not c["reader"]["rcvbuf"]
                and c["writer"]["coalesce_bytes"] == size and c["writer"]["event_bytes"] == 214
                and c["writer"]["flush_seconds"] == 0.25
            }  # fmt: skip
            if not found:
                continue
            scale = next(iter(found.values())).get("peer_wscale", "?")
            label = "per-token" if size is None else f"{size} B"
            cells = " | ".join(_doc_cell(found.get(key)) for key in columns)
            lines.append(f"| {name} ({scale}) | {label} | {cells} |")
    return "\n".join(lines)


def _k(value: int) -> str:
    return f"{value / 1024:.0f} K" if value < 1 << 20 else f"{value / (1 << 20):.1f} M"


def doc_details(runs: dict[str, dict[str, Any]]) -> str:
    """Per receiver, per-token and 1 KB at 35 tokens/s, reader stopped after 1 and 10 s:
    the estimate against the truth 10 s after the stop, the window and the client's buffer."""
    lines = [
        "| receiver | writes | read (s) | estimate / truth at +10 s (s of stream) "
        "| window at stop → end | client buffer at stop → end | buffer per unread byte |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        for case in run["cases"]:
            w, reader, r = case["writer"], case["reader"], case["result"]
            if reader["kind"] != "stop" or reader["rcvbuf"] or reader["read_seconds"] == 30:
                continue
            if w["tokens_per_second"] != 35 or w["event_bytes"] != 214:
                continue
            if w["coalesce_bytes"] not in (None, 1024) or w["flush_seconds"] != 0.25:
                continue
            at10 = r["estimate_s_at"]["+10s"]
            label = "per-token" if w["coalesce_bytes"] is None else "1 KB"
            buffer = r["client_rcvbuf"]
            lines.append(
                f"| {name} | {label} | {reader['read_seconds']:g} | {_fmt(at10)} / ~10 "
                f"| {_k(r['window_at_stop'])} → {_k(r['window_at_end'])} "
                f"| {_k(buffer['stop'])} → {_k(buffer['end'])} "
                f"| {r['client_truesize_per_byte_end']:g} |"
            )
    return "\n".join(lines)


def print_tables(runs: dict[str, dict[str, Any]]) -> None:
    for name, run in runs.items():
        print(f"\n### {name} (kernel {run['kernel']['release']}, {run['topology']})")
        print(STOP_HEADER)
        print("\n".join(stop_rows(run)))
        print()
        print(HEALTHY_HEADER)
        print("\n".join(healthy_rows(run)))
        print("honest sizes:", json.dumps(honest_sizes(run)))


def plot(runs: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    _plot_series(axes[0], runs)
    _plot_crossings(axes[1], runs)
    fig.suptitle("What the server sees of a reader that stops (214-byte token events, 35 tok/s)")
    fig.tight_layout()
    fig.savefig(RESULTS / "visibility.png", dpi=100)


def _plot_series(axis: Any, runs: dict[str, dict[str, Any]]) -> None:
    run = runs.get(PLOTTED_RUN) or next(iter(runs.values()))
    wanted = PLOTTED_WRITERS
    for case in run["cases"]:
        w = case["writer"]
        if not _plotted(case) or w["coalesce_bytes"] not in wanted or "series" not in case:
            continue
        series, colour = case["series"], wanted[w["coalesce_bytes"]]
        axis.plot(series["t"], series["estimate_s"], color=colour, label=f"estimate, {w['label']}")
        axis.plot(series["t"], series["truth_s"], color=colour, linestyle=":")
    axis.axvline(10.0, color="grey", linewidth=0.8)
    axis.set_xlabel(f"seconds ({run['topology']}, kernel {run['kernel']['release']}); "
                    "reader stops at 10 s; dotted: the truth")  # fmt: skip
    axis.set_ylabel("backlog, seconds of the stream")
    axis.legend(fontsize=8)


def _plot_crossings(axis: Any, runs: dict[str, dict[str, Any]]) -> None:
    for name, run in runs.items():
        points: dict[int, list[float]] = {}
        sizes_written: dict[int, list[int]] = {}
        for case in run["cases"]:
            w, reader = case["writer"], case["reader"]
            if reader["kind"] != "stop" or reader["rcvbuf"] or w["tokens_per_second"] != 35:
                continue
            if w["event_bytes"] != 214 or w["flush_seconds"] != 0.25:
                continue
            after = case["result"]["estimate_2s"]["after_stop_s"]
            watched = case["result"]["watched_after_stop_s"]
            size = w["coalesce_bytes"] or 0
            points.setdefault(size, []).append(watched if after is None else after)
            sizes_written.setdefault(size, []).append(case["writes"]["mean_write_bytes"])
        sizes = sorted(points)
        written = [statistics.median(sizes_written[s]) for s in sizes]
        axis.plot(written, [max(points[s]) for s in sizes], marker="o", label=name)
    axis.axhline(HONEST_WITHIN_SECONDS, color="grey", linestyle="--", label="honest bound")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("bytes per write, median (214: one write per token)")
    axis.set_ylabel("s from the stop to estimate ≥ 2 s of stream\n(worst read time; 20: not seen)")
    axis.legend(fontsize=8)


def _plotted(case: dict[str, Any]) -> bool:
    w, reader = case["writer"], case["reader"]
    return (
        reader["kind"] == "stop"
        and reader["read_seconds"] == 10.0
        and not reader["rcvbuf"]
        and w["tokens_per_second"] == 35
        and w["event_bytes"] == 214
        and w["flush_seconds"] == 0.25
    )


PLOTTED_RUN = "loopback"
PLOTTED_WRITERS = {None: "tab:red", 512: "tab:orange", 1024: "tab:green", 4096: "tab:blue"}


def _keep_plotted_series(runs: dict[str, dict[str, Any]]) -> None:
    """Time series only for the cases the plot draws: the JSON stays small."""
    for name, run in runs.items():
        for case in run["cases"]:
            drawn = _plotted(case) and case["writer"]["coalesce_bytes"] in PLOTTED_WRITERS
            if name != PLOTTED_RUN or not drawn:
                case.pop("series", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="loopback only, fewer cases; prints, writes nothing"
    )
    parser.add_argument("--no-vm", action="store_true", help="skip the Debian kernels' VMs")
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES))
    parser.add_argument("--kernels", default="debian-6.1,debian-6.12")
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument(
        "--keep", action="store_true",
        help="keep the runs already in visibility.json that this invocation does not redo",
    )  # fmt: skip
    args = parser.parse_args()
    started = time.monotonic()
    names = ["loopback"] if args.quick else [t for t in args.topologies.split(",") if t]
    runs: dict[str, dict[str, Any]] = {}
    if args.keep and (RESULTS / "visibility.json").is_file():
        runs = json.loads((RESULTS / "visibility.json").read_text())["runs"]
    runs.update({name: run_topology(name, args.quick, args.parallel) for name in names})
    if not args.no_vm and not args.quick:
        for kernel in args.kernels.split(","):
            runs.update(run_vm(kernel, WATCH_SECONDS))
    print_tables(runs)
    print("\n" + doc_table(runs))
    print("\n" + doc_details(runs))
    if args.quick:
        return  # a look, not a result: bench/results keeps the whole grid's
    _keep_plotted_series(runs)
    summary = {name: honest_sizes(run) for name, run in runs.items()}
    path = write_result(
        "visibility",
        {"seconds": round(time.monotonic() - started), "honest_sizes": summary, "runs": runs},
    )
    plot(runs)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()

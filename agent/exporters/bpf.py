"""The kernel side: events, drops, evictions, tracked sockets and the mode each attach point got."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from kvwatch.api.state import AgentState
from kvwatch.collect.bpf.runstats import program_run_stats
from kvwatch.collect.collectors import needed_sockets


def bpf_metrics(state: AgentState) -> Iterator[Metric]:
    backend = state.opened.backend if state.opened is not None else "none"
    info = InfoMetricFamily("kvwatch_collector", "The socket collector in use.")
    info.add_metric([], {"backend": backend})
    yield info
    bpf = state.bpf
    if bpf is None:
        return
    attach = GaugeMetricFamily(
        "kvwatch_bpf_attached",
        "1 for the mode each BPF attach point attached with.",
        labels=["point", "mode"],
    )
    for point, mode in bpf.report.points.items():
        attach.add_metric([point, mode], 1.0)
    yield attach
    stats = bpf.stats(tracked=len(state.samples()))
    for name, help_text in (
        ("events_sent", "Edge events sent over the ring buffer."),
        ("events_dropped", "Edge events lost: the ring buffer was full."),
        ("records_created", "Socket records created."),
        ("records_deleted", "Socket records removed at close."),
        ("records_failed", "Socket records that could not be created."),
        ("evictions", "Socket records the LRU map dropped to make room."),
    ):
        yield CounterMetricFamily(f"kvwatch_bpf_{name}", help_text, value=stats[name])
    yield GaugeMetricFamily(
        "kvwatch_bpf_sockets_tracked", "Sockets with a kernel record.", value=stats["tracked"]
    )
    table = state.table
    if table is not None:
        yield GaugeMetricFamily(
            "kvwatch_bpf_socket_table_full",
            "1 while the kernel socket table evicts records (sock_diag then sweeps for stalls).",
            value=1.0 if table.full else 0.0,
        )
        yield GaugeMetricFamily(
            "kvwatch_bpf_socket_table_needed_sockets",
            "A --max-sockets that would fit every watched socket, in sockets.",
            value=needed_sockets(table),
        )
    runs = CounterMetricFamily(
        "kvwatch_bpf_program_runs",
        "Runs of each BPF program (counted while kernel.bpf_stats_enabled=1).",
        labels=["point"],
    )
    run_time = CounterMetricFamily(
        "kvwatch_bpf_program_run_seconds",
        "Time spent in each BPF program, in seconds (counted while kernel.bpf_stats_enabled=1).",
        labels=["point"],
    )
    for point, fd in bpf.programs.program_fds().items():
        program = program_run_stats(fd)
        runs.add_metric([point], program.run_count)
        run_time.add_metric([point], program.run_time_ns / 1e9)
    yield runs
    yield run_time

"""The dashboards against live data: a real Prometheus scrapes a real agent (BPF collector) that
watches two stalled streams of the reference engine, one cancelled and one left stalled by the
policy's budget; then every dashboard query runs through Prometheus's HTTP API."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.lab.harness.cut_stack import CutStack
from tests.packaging.conftest import (
    NVML_PREFIX,
    Prometheus,
    dashboard_targets,
    label_values_as_promql,
    require_tool,
    substitute,
    variable_queries,
)

pytestmark = [pytest.mark.bpf, pytest.mark.engine, pytest.mark.slow]

WATCHDOG_USEC = 1_000_000  # the agent should ping every 0.5 s
RATE_INTERVAL = "15s"
SCRAPES_WANTED = 2
LATE_SERIES_SECONDS = 5.0


@dataclass
class Live:
    """What the module's one run left to look at."""

    stack: CutStack
    prometheus: Prometheus
    agent_metrics: str
    notify: socket.socket
    received: list[str]

    def notifications(self) -> list[str]:
        """Every sd_notify message the agent sent so far."""
        while True:
            try:
                self.received.append(self.notify.recv(4096).decode())
            except BlockingIOError:
                return self.received

    @property
    def variables(self) -> dict[str, str]:
        gpu_or_any = ".*"
        return {
            "node": f"127.0.0.1:{self.stack.agent_port}",
            "engine": f"127.0.0.1:{self.stack.engine_port}",
            "gpu": gpu_or_any,
            "hostname": gpu_or_any,
            "__rate_interval": RATE_INTERVAL,
            "__interval": "5s",
            "__range": "5m",
        }

    @property
    def nvml_available(self) -> bool:
        for family in text_string_to_metric_families(self.agent_metrics):
            if family.name == "kvwatch_gpu_nvml_available":
                return any(sample.value == 1 for sample in family.samples)
        return False


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    workdir = tmp_path_factory.mktemp("live")
    stack = CutStack(workdir)
    prometheus = Prometheus(
        workdir,
        {
            "kvwatch": f"127.0.0.1:{stack.agent_port}",
            "engine": f"127.0.0.1:{stack.engine_port}",
        },
    )
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(workdir / "notify.sock"))
    notify.setblocking(False)
    clients: list[socket.socket] = []
    try:
        stack.start_engine()
        env = {"NOTIFY_SOCKET": str(workdir / "notify.sock"), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
        stack.start_agent("--mode", "enforce", "--max-cancels-per-minute", "1", env=env)
        prometheus.wait_ready()
        clients = [stack.spawn_stalled_client(f"held-{n}") for n in range(2)]
        # One stall is cancelled, the other stays (budget); the actions series shows up.
        prometheus.wait_for('kvwatch_actions_total{result="cancelled"}', timeout_seconds=30)
        prometheus.wait_for(
            f"count_over_time(kvwatch_actions_total[1m]) >= {SCRAPES_WANTED}", timeout_seconds=10
        )
        prometheus.wait_for('kvwatch_streams{state="stalled"} >= 1', timeout_seconds=10)
        metrics = httpx.get(f"{stack.agent_url}/metrics").text
        yield Live(stack, prometheus, metrics, notify, [])
    finally:
        for client in clients:
            client.close()
        prometheus.stop()
        stack.close()
        notify.close()


def test_agent_metrics_pass_promtool(live: Live) -> None:
    promtool = require_tool("promtool", "prometheus")
    checked = subprocess.run(
        [promtool, "check", "metrics"],
        check=False,
        input=live.agent_metrics,
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "kvwatch_actions_total" in live.agent_metrics


def test_every_kvwatch_query_returns_data(live: Live) -> None:
    """Each query parses; each over kvwatch's series returns data. A series born in the last
    scrape (the engine counts the abort a moment after the agent counts the cancel) has no
    rate() yet, so empty queries are asked again for a few scrapes before they fail."""
    pending = {}
    for target in dashboard_targets():
        expr = substitute(target.expr, live.variables)
        result = live.prometheus.result(expr)  # fails on a query Prometheus rejects
        external = target.sources() - ({"NVML"} if live.nvml_available else set())
        if not external and not result:
            pending[expr] = target.name
    deadline = time.monotonic() + LATE_SERIES_SECONDS
    while pending and time.monotonic() < deadline:
        time.sleep(0.5)
        pending = {e: name for e, name in pending.items() if not live.prometheus.result(e)}
    assert not pending, "queries without data:\n" + "\n".join(
        f"{name}: {expr}" for expr, name in pending.items()
    )


def test_every_kvwatch_metric_a_dashboard_names_is_exported(live: Live) -> None:
    scraped = live.prometheus.metric_names()
    named = {
        word
        for target in dashboard_targets()
        for word in _metric_like_words(target.expr)
        if word.startswith("kvwatch_") and not word.startswith(NVML_PREFIX)
    }
    assert named and named <= scraped, sorted(named - scraped)


def _metric_like_words(expr: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))


def test_dashboard_variables_find_the_node_and_the_engine(live: Live) -> None:
    expected = {"node": live.variables["node"], "engine": live.variables["engine"]}
    for dashboard, name, query in variable_queries():
        promql, label = label_values_as_promql(substitute(query, live.variables))
        values = {series["metric"].get(label) for series in live.prometheus.result(promql)}
        if name in expected:
            assert expected[name] in values, (dashboard, name, promql, values)
        elif live.nvml_available:
            assert values, (dashboard, name, promql)


def test_agent_tells_systemd_it_is_ready_and_pings_the_watchdog(live: Live) -> None:
    messages = live.notifications()  # the fixture ran for many watchdog intervals
    fields = [line for message in messages for line in message.splitlines()]
    assert "READY=1" in fields, messages
    assert any(line.startswith("STATUS=") for line in fields), messages
    assert fields.count("WATCHDOG=1") >= 2, messages

"""Packaging tests: the shipped files (dashboards, systemd unit, Kubernetes manifests,
Dockerfile) read as data, and a real Prometheus server for the live dashboard checks."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvwatch.lab.harness.stack import free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))
PACKAGING = REPO / "packaging"
SETUP_HINT = "install the Debian package {package} (scripts/setup.sh installs it)"

# Series that exist only where another exporter runs, by metric-name prefix, and the word a
# panel's description must name ("Needs: ...") when one of its queries uses them.
EXTERNAL_SOURCES = {"vllm:": "vLLM", "DCGM_": "DCGM"}
# kvwatch's own GPU series exist only where NVML answers (kvwatch_gpu_nvml_available 1).
NVML_PREFIX = "kvwatch_gpu_memory_"
# The capabilities the agent runs with, in the systemd unit and the DaemonSet alike; each is
# explained in docs/deploy.md ("Capabilities").
AGENT_CAPABILITIES = {
    "CAP_BPF",
    "CAP_PERFMON",
    "CAP_NET_ADMIN",
    "CAP_SYS_PTRACE",
    "CAP_DAC_READ_SEARCH",
    "CAP_SYS_ADMIN",
}


def require_tool(name: str, package: str) -> str:
    """The path of a command-line tool the packaging tests cannot do without."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: " + SETUP_HINT.format(package=package))
    return path


@dataclass(frozen=True)
class Target:
    """One query of one panel of one dashboard."""

    dashboard: str
    panel: dict[str, Any]
    target: dict[str, Any]

    @property
    def expr(self) -> str:
        return str(self.target["expr"])

    @property
    def name(self) -> str:
        return f"{self.dashboard}: {self.panel['title']} [{self.target['refId']}]"

    def sources(self) -> set[str]:
        """The external sources this query reads ("vLLM", "DCGM", "NVML")."""
        found = {word for prefix, word in EXTERNAL_SOURCES.items() if prefix in self.expr}
        if NVML_PREFIX in self.expr:
            found.add("NVML")
        return found


def load_dashboard(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
    return document


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_targets() -> list[Target]:
    return [
        Target(path.name, panel, target)
        for path in DASHBOARDS
        for panel in panels(load_dashboard(path))
        for target in panel.get("targets", [])
    ]


def variable_queries() -> list[tuple[str, str, str]]:
    """(dashboard, variable name, query) of every query variable."""
    return [
        (path.name, variable["name"], variable["query"])
        for path in DASHBOARDS
        for variable in load_dashboard(path)["templating"]["list"]
        if variable["type"] == "query"
    ]


_LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+),\s*(?P<label>\w+)\)")


def label_values_as_promql(query: str) -> tuple[str, str]:
    """Grafana's `label_values(selector, label)` as a PromQL query over the same series."""
    match = _LABEL_VALUES.fullmatch(query)
    assert match, f"not a label_values() query: {query}"
    label = match["label"]
    return f"group by ({label}) ({match['selector']})", label


def substitute(expr: str, values: dict[str, str]) -> str:
    """`expr` with Grafana's variables ($name, ${name}) replaced; every one must be known."""

    def replace(match: re.Match[str]) -> str:
        name = match["braced"] or match["plain"]
        assert name in values, f"unknown dashboard variable ${name} in {expr}"
        return values[name]

    return re.sub(r"\$(?:\{(?P<braced>\w+)\}|(?P<plain>\w+))", replace, expr)


class Prometheus:
    """A real Prometheus server on a free loopback port, scraping the given targets every
    second; its data lives in `workdir`. Stopped (and waited for) by `stop()`."""

    def __init__(self, workdir: Path, targets: dict[str, str]) -> None:
        binary = require_tool("prometheus", "prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "prometheus.yml"
        jobs = [
            {"job_name": job, "static_configs": [{"targets": [address]}]}
            for job, address in targets.items()
        ]
        settings = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
        self.config.write_text(json.dumps({"global": settings, "scrape_configs": jobs}))
        self.log = workdir / "prometheus.log"
        self.http = httpx.Client(base_url=self.url, timeout=10)
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout_seconds: float = 30) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                if self.http.get("/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"Prometheus did not become ready: {self.log.read_text()}")

    def query(self, expr: str) -> httpx.Response:
        return self.http.get("/api/v1/query", params={"query": expr})

    def result(self, expr: str) -> list[dict[str, Any]]:
        """The instant-query result of `expr`; fails the test on any error."""
        response = self.query(expr)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def metric_names(self) -> set[str]:
        response = self.http.get("/api/v1/label/__name__/values")
        return set(response.json()["data"])

    def wait_for(self, expr: str, timeout_seconds: float) -> None:
        """Until `expr` returns data."""
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.result(expr):
                return
            time.sleep(0.25)
        raise AssertionError(f"no data for {expr} within {timeout_seconds} s")

    def stop(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

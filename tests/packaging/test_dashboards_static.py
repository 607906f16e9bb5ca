"""The Grafana dashboards as data: layout, variables, data source, and the series the issue
asks for; what their queries return is tests/packaging/test_dashboards_live.py's job."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.packaging.conftest import (
    DASHBOARDS,
    EXTERNAL_SOURCES,
    dashboard_targets,
    load_dashboard,
    panels,
)

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
REQUIRED_VARIABLES = {"datasource", "node", "gpu", "engine"}
# What the issue asks the dashboards to chart, by file.
REQUIRED_SERIES = {
    "kvwatch-node.json": [
        "kvwatch_gpu_memory_used_bytes",
        "DCGM_FI_DEV_FB_USED",
        "kvwatch_streams_stalled_kv_held_bytes",
        "kvwatch_stream_stall_duration_seconds",
        "kvwatch_actions_total",
        "kvwatch_stream_zero_window_duration_seconds_bucket",
        "kvwatch_bpf_events_dropped_total",
        "kvwatch_bpf_evictions_total",
        "kvwatch_exporter_scrape_success",
        "vllm:kv_cache_usage_perc",
        "kvwatch_engine:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        "kvwatch_engine:num_requests_waiting",
    ],
    "kvwatch-incident.json": [
        'kvwatch_streams{instance=~"$node", state="stalled"}',
        "kvwatch_streams_stalled_kv_held_bytes",
        "kvwatch_actions_total",
        "kvwatch_policy_decisions_total",
        "vllm:time_to_first_token_seconds",
        "kvwatch_engine:time_to_first_token_seconds",
        "vllm:kv_cache_usage_perc",
        "by (instance)",
    ],
}


@pytest.fixture(params=DASHBOARDS, ids=[path.name for path in DASHBOARDS])
def dashboard(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_dashboard(request.param)


def test_both_dashboards_exist_with_distinct_uids() -> None:
    assert [path.name for path in DASHBOARDS] == ["kvwatch-incident.json", "kvwatch-node.json"]
    uids = [load_dashboard(path)["uid"] for path in DASHBOARDS]
    assert len(set(uids)) == len(uids)


def test_variables_and_data_source(dashboard: dict[str, Any]) -> None:
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert set(variables) >= REQUIRED_VARIABLES
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE
            assert variable["includeAll"] and variable["allValue"] == ".*"
    for panel in panels(dashboard):
        if panel.get("targets"):
            assert panel["datasource"] == DATASOURCE, panel["title"]
            assert all(target["datasource"] == DATASOURCE for target in panel["targets"])


def test_every_variable_a_query_uses_is_defined(dashboard: dict[str, Any]) -> None:
    defined = {variable["name"] for variable in dashboard["templating"]["list"]}
    queries = [target["expr"] for panel in panels(dashboard) for target in panel.get("targets", [])]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for query in queries for name in re.findall(r"\$\{?(\w+)", query)}
    assert used - GRAFANA_BUILTINS <= defined


def test_layout_has_unique_ids_and_no_overlaps(dashboard: dict[str, Any]) -> None:
    all_panels = list(panels(dashboard))
    ids = [panel["id"] for panel in all_panels]
    assert len(set(ids)) == len(ids)
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["w"] > 0 and grid["h"] > 0, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
        refs = [target["refId"] for target in panel.get("targets", [])]
        assert len(set(refs)) == len(refs), panel["title"]


def test_panels_name_the_exporters_their_series_need() -> None:
    """A panel reading vLLM's or DCGM's series (or NVML-backed kvwatch series) says so in its
    description, so an empty graph explains itself; the live test only parses those queries."""
    for target in dashboard_targets():
        needs = target.sources()
        if needs:
            description = target.panel.get("description", "")
            assert "Needs:" in description, target.name
            assert all(word in description for word in needs), (target.name, needs)


def test_no_query_hides_a_missing_series() -> None:
    for target in dashboard_targets():
        assert "vector(" not in target.expr and "absent(" not in target.expr, target.name
        assert target.expr.strip(), target.name


def test_the_series_the_issue_asks_for_are_charted() -> None:
    for name, wanted in REQUIRED_SERIES.items():
        exprs = "\n".join(t.expr for t in dashboard_targets() if t.dashboard == name)
        missing = [series for series in wanted if series not in exprs]
        assert not missing, (name, missing)


def test_external_prefixes_are_vllm_and_dcgm() -> None:
    exprs = "\n".join(target.expr for target in dashboard_targets())
    for prefix in EXTERNAL_SOURCES:
        assert prefix in exprs

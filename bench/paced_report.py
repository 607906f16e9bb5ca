"""Summing up bench/bench_paced.py's runs: per setup and agent configuration, the readers that
stopped and the live readers as figures over runs (median, range, p99), issue 37's targets on
the paced rows, the tables for docs/agent.md and the figure."""

from __future__ import annotations

import math
from typing import Any

from bench.common import RESULTS, spread
from bench.paced_lab import LIVE_READERS, PARK_SECONDS, STOP_KINDS
from kvwatch.lab.loadgen.report import percentile

Row = dict[str, Any]
# Targets (issue 37), on the paced agent.
TARGET_DECODED_SECONDS = {"after_50_tokens": 8.0, "after_10_s": 3.0}
TARGET_PAUSE_TO_KV_FREED_SECONDS = PARK_SECONDS
TARGET_DONE_RATIO = 1.1
STOP_FIGURES = (
    "decoded_after_stop_seconds",
    "rate_tokens_per_second",
    "stop_to_evidence_seconds",
    "backlog_estimate_seconds",
    "pause_to_kv_freed_seconds",
    "pause_round_trip_seconds",
    "park_decided_after_paused_seconds",
    "park_round_trip_seconds",
    "stop_to_kv_freed_seconds",
)
LIVE_FIGURES = ("done_seconds", "held_seconds", "waited_seconds", "waited_while_held_seconds")
AGENT_ORDER = ("off", "cut", "park", "paced", "paced_1.5s")
PACED = ("paced", "paced_1.5s")


def items(rows: list[Row], part: str, reader: str) -> list[Row]:
    """The stops (`part` "stops") or live readers ("live") of kind `reader` in `rows`."""
    return [item for row in rows for item in row[part] if item["reader"] == reader]


def numbers(found: list[Row], key: str) -> list[float]:
    values = [item[key] for item in found]
    return [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def figure(values: list[float], digits: int = 3) -> dict[str, float | None]:
    """Median, range and p99 of a figure over runs (or samples)."""
    p99 = percentile(values, 0.99)
    return {**spread(values, digits), "p99": None if p99 is None else round(p99, digits)}


def summarise_stops(rows: list[Row]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in STOP_KINDS:
        found = items(rows, "stops", kind)
        out[kind] = {
            "stops": len(found),
            "censored": sum(bool(s["censored"]) for s in found),
            "evidence": sorted({str(s["evidence"]) for s in found}),
            **{key: figure(numbers(found, key)) for key in STOP_FIGURES},
        }
    return out


def same_engine(one: Row, other: Row) -> bool:
    """Whether two rows ran on the same engine (one run of bench_paced.run_setup)."""
    return bool(one.get("bed", one["repetition"]) == other.get("bed", other["repetition"]))


def done_ratios(rows: list[Row], agent: str, reader: str) -> list[float]:
    """Per repetition: the reader's [DONE] with `agent` over the same reader's with the agent
    off, on the same engine."""
    ratios = []
    for row in (r for r in rows if r["agent"] == agent):
        off = [r for r in rows if r["agent"] == "off" and same_engine(r, row)]
        mine, base = (
            numbers(items([row], "live", reader), "done_seconds"),
            numbers(items(off, "live", reader), "done_seconds"),
        )
        if mine and base:
            ratios.append(round(mine[0] / base[0], 3))
    return ratios


def summarise_live(rows: list[Row], agent: str) -> dict[str, Any]:
    """`rows`: one setup's; the live readers of `agent`'s rows, [DONE] against off's."""
    mine = [r for r in rows if r["agent"] == agent]
    out: dict[str, Any] = {}
    for reader in LIVE_READERS:
        found = items(mine, "live", reader)
        out[reader] = {
            "runs": len(found),
            "identical": sum(bool(i["identical"]) for i in found),
            "cut": sum(bool(i["reset"] or i["cut_decisions"]) for i in found),
            "pauses": sum(i["pauses"] for i in found),
            "parks": sum(i["parks"] for i in found),
            "done_vs_off": figure(done_ratios(rows, agent, reader)),
            **{key: figure(numbers(found, key), 2) for key in LIVE_FIGURES},
        }
    return out


def summarise(rows: list[Row]) -> dict[str, Any]:
    """Per setup and agent configuration: the stops, the live readers, the healthy holds."""
    summary: dict[str, Any] = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        setup_rows = [r for r in rows if r["label"] == label]
        for agent in (a for a in AGENT_ORDER if any(r["agent"] == a for r in setup_rows)):
            mine = [r for r in setup_rows if r["agent"] == agent]
            summary[f"{label} | {agent}"] = {
                "runs": len(mine),
                "stops": summarise_stops(mine),
                "live": summarise_live(setup_rows, agent),
                "healthy_holds": sum(r["healthy_holds"] for r in mine),
                "load_average_1min": spread([r["load_average_1min"] for r in mine], 2),
            }
    return summary


def stop_checks(entry: dict[str, Any]) -> dict[str, bool | None]:
    checks: dict[str, bool | None] = {}
    for kind, bound in TARGET_DECODED_SECONDS.items():
        stop = entry["stops"][kind]
        decoded = stop["decoded_after_stop_seconds"]["p99"]
        met = decoded is not None and decoded <= bound and not stop["censored"]
        checks[f"{kind}_decoded_p99"] = None if decoded is None else met
        freed = stop["pause_to_kv_freed_seconds"]["p99"]
        checks[f"{kind}_kv_freed_p99"] = (
            None if freed is None else freed <= TARGET_PAUSE_TO_KV_FREED_SECONDS
        )
    return checks


def live_checks(entry: dict[str, Any]) -> dict[str, bool | None]:
    live = entry["live"].values()
    ratios = [r["done_vs_off"]["max"] for r in live if r["done_vs_off"]["max"] is not None]
    return {
        "live_identical_never_cut": all(r["identical"] == r["runs"] and not r["cut"] for r in live),
        "live_done_vs_off_max": (max(ratios) <= TARGET_DONE_RATIO) if ratios else None,
        "healthy_no_holds": entry["healthy_holds"] == 0,
    }


def targets_met(summary: dict[str, Any]) -> dict[str, dict[str, bool | None]]:
    """Issue 37's targets, on each setup's paced rows (the defaults, and the earlier pause)."""
    return {
        name: {**stop_checks(entry), **live_checks(entry)}
        for name, entry in summary.items()
        if name.split(" | ")[1] in PACED
    }


# -- tables ------------------------------------------------------------------------------------


def fmt(found: dict[str, Any], digits: int = 1, unit: str = "") -> str:
    """median (min-max) of a figure; '-' where there is none."""
    if found.get("median") is None:
        return "-"
    low, mid, high = (round(found[k], digits) for k in ("min", "median", "max"))
    return f"{mid}{unit} ({low}-{high})" if low != high else f"{mid}{unit}"


def stop_cell(stop: dict[str, Any]) -> str:
    decoded = stop["decoded_after_stop_seconds"]
    text = f"{fmt(decoded)}; p99 {decoded['p99']}"
    if stop["censored"]:
        text += f" (≥: {stop['censored']} of {stop['stops']} still decoding at the bound)"
    return text


def evidence_cell(stop: dict[str, Any]) -> str:
    kinds = "/".join(e for e in stop["evidence"] if e != "None") or "none"
    return f"{kinds} {fmt(stop['stop_to_evidence_seconds'])}"


def stop_table(summary: dict[str, Any]) -> list[str]:
    """Readers that stopped: tokens decoded after the stop in seconds of the stream, the
    agent's first decision after the stop, the pause to the KV freed."""
    lines = [
        "| setup | agent | stopped after 50 tokens: decoded after, s of stream | first "
        "decision, s after the stop | stopped after 10 s: decoded after | first decision "
        "| pause -> KV freed, s (p99) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, entry in summary.items():
        label, agent = name.split(" | ")
        stops = [entry["stops"][kind] for kind in STOP_KINDS]
        freed = [s["pause_to_kv_freed_seconds"] for s in stops]
        freed_text = " / ".join(
            "-" if f["median"] is None else f"{fmt(f, 2)} ({f['p99']})" for f in freed
        )
        cells = [cell for s in stops for cell in (stop_cell(s), evidence_cell(s))]
        lines.append(f"| {label} | {agent} | {' | '.join(cells)} | {freed_text} |")
    return lines


def live_table(summary: dict[str, Any]) -> list[str]:
    lines = [
        "| setup | agent | reader | identical | cut | pauses / parks | held s | waited while "
        "held s | [DONE] s | [DONE] vs off |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in summary.items():
        label, agent = name.split(" | ")
        for reader, live in entry["live"].items():
            lines.append(
                f"| {label} | {agent} | {reader} | {live['identical']} of {live['runs']} | "
                f"{live['cut']} | {live['pauses']} / {live['parks']} | "
                f"{fmt(live['held_seconds'])} | {fmt(live['waited_while_held_seconds'])} | "
                f"{fmt(live['done_seconds'])} | {fmt(live['done_vs_off'], 2)} |"
            )
    return lines


# -- the figure --------------------------------------------------------------------------------


COLOURS = {
    "off": "tab:red",
    "cut": "tab:olive",
    "park": "tab:blue",
    "paced": "tab:green",
    "paced_1.5s": "tab:cyan",
}


def plot(rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(18, 6))
    for axis, kind in zip(axes[:2], STOP_KINDS, strict=True):
        stop_axis(axis, rows, labels, kind)
    live_axis(axes[2], rows, labels)
    fig.suptitle("Reader-paced generation: the engine's defaults, kernel-default client buffers")
    fig.tight_layout()
    fig.savefig(RESULTS / "paced.png", dpi=100)


def stop_axis(axis: Any, rows: list[Row], labels: list[str], kind: str) -> None:
    width = 0.8 / len(AGENT_ORDER)
    for group, label in enumerate(labels):
        for offset, agent in enumerate(AGENT_ORDER):
            mine = [r for r in rows if r["label"] == label and r["agent"] == agent]
            found = numbers(items(mine, "stops", kind), "decoded_after_stop_seconds")
            if not found:
                continue
            x = group + (offset - (len(AGENT_ORDER) - 1) / 2) * width
            name = agent if agent not in axis.get_legend_handles_labels()[1] else None
            axis.bar(x, spread(found)["median"], width=width, color=COLOURS[agent], label=name)
            axis.plot([x] * len(found), found, "k.", markersize=4)
    axis.axhline(TARGET_DECODED_SECONDS[kind], color="black", linestyle="--", label="target")
    axis.set_yscale("log")
    axis.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
    axis.set_ylabel("tokens decoded after the stop, in seconds of the stream")
    axis.set_title(f"a reader that stops {kind.replace('_', ' ')} (bars: median, dots: runs)")
    axis.legend(fontsize=7)


def live_axis(axis: Any, rows: list[Row], labels: list[str]) -> None:
    for group, label in enumerate(labels):
        setup_rows = [r for r in rows if r["label"] == label]
        for offset, reader in enumerate(LIVE_READERS):
            found = [v for agent in PACED for v in done_ratios(setup_rows, agent, reader)]
            x = [group + (offset - 1.5) * 0.2] * len(found)
            axis.plot(
                x, found, "o", markersize=4, color=f"C{offset}", label=reader if not group else None
            )
    axis.axhline(TARGET_DONE_RATIO, color="black", linestyle="--", label="target 1.1x")
    axis.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
    axis.set_ylabel("[DONE], paced / off (same engine, same repetition)")
    axis.set_title("live readers (dots: runs)")
    axis.legend(fontsize=7)

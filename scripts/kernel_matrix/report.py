"""The compatibility table (docs/kernel-matrix.md): kernel x attach point x mode -> pass, FAIL
or unavailable.

A cell is `unavailable` when the kernel refuses a minimal program in that mode on that attach
point's target (tests/kernel/kernel_offers.py) — its reason is listed under the table; `pass` when
every test that checks the attach point (its `exercises` marker) passed in every mode pair that
attached it in that mode; `FAIL` when one failed, naming the pairs when others passed;
`not run` when the kernel offers the mode but no pair used it (or the row never ran).
"""

from __future__ import annotations

import datetime
from typing import Any

from scripts.kernel_matrix.matrix import RowResult

MODES = ("fentry", "kprobe", "tp_btf", "raw_tp")
POINTS = {
    "send": "send (`tcp_sendmsg` / `sock:sock_send_length`)",
    "ack": "ACK (`tcp:tcp_probe`)",
    "lifecycle": "lifecycle (`sock:inet_sock_set_state`)",
    "retransmit": "retransmit (`tcp:tcp_retransmit_skb`)",
    "zero_window_probe": "zero-window probe (`tcp_send_probe0`)",
}
SCENARIOS = (
    "- the forced modes attach as asked, and the records live where those modes put them:",
    "  socket-local storage when every attach point is BTF-typed (fentry or tp_btf send,",
    "  tp_btf tracepoints), else the LRU hash;",
    "- a stalled client is found while a slow-but-draining reader and an idle connection never",
    "  are; the writer's pid is recorded (send attach point), zero-window probes are counted",
    "  where their attach point attaches, and the peer window equals the kernel's own (tcp_info);",
    "- reading again ends the zero-window episode (window reopening);",
    "- close removes the record with a close event;",
    "- segments dropped at the receiver (a socket filter) are counted as retransmissions;",
    "- an IPv6 stalled client is tracked;",
    "- and, once per kernel, `auto` picks the best mode offered (fentry > kprobe > tp_btf >",
    "  raw_tp for the send path, tp_btf > raw_tp for tracepoints).",
)

HOW_IT_RUNS = (
    "## How it runs",
    "",
    "- `make kernel-matrix` runs every row and rewrites this file; `make test` runs the same rows",
    "  (`tests/kernel/test_matrix.py`) without touching it. One row: `.venv/bin/python -m",
    "  scripts.kernel_matrix --kernel debian-6.1 --doc /tmp/matrix.md`.",
    "- Kernel packages: the newest `linux-image-6.1.0-*-amd64` and",
    "  `linux-image-6.12.*+deb12-amd64` the apt sources offer, fetched with `apt-get download`",
    "  and unpacked (not installed) into `/var/cache/kvwatch-kernels` (`KVWATCH_KERNEL_CACHE`),",
    "  reused between runs. The 6.1 row also gets its `linux-headers-*` packages, merged into",
    "  one tree and shared read-only into the guest for BCC (`BCC_KERNEL_SOURCE`).",
    "- Host tools: `qemu-system-x86`, `udev`, `busybox-static`, `kmod` (Debian) and `virtme-ng`",
    "  (pip). KVM is used where the CPU has vmx/svm and /dev/kvm is usable, software emulation",
    "  otherwise; `KVWATCH_MATRIX_ACCEL=kvm|tcg` forces one. `KVWATCH_BPF_OBJECT` is forwarded",
    "  into the guests, to run the matrix over another build of the object.",
    "- A mode is `unavailable` only where the kernel refuses a minimal `r0 = 0` program in that",
    "  mode on the same function or tracepoint (`tests/kernel/kernel_offers.py`); kvwatch's loader",
    "  must then refuse it too. A mode the kernel accepts but kvwatch cannot load is a `FAIL`,",
    "  with libbpf's verifier log under Failures.",
)


def cell(results: dict[str, Any], point: str, mode: str) -> str:
    offered = results["offers"][point]
    if mode not in offered:
        return "\u2014"
    if offered[mode]:
        return "unavailable"
    pairs = [
        c["id"] for c in results["combos"] if c["points"][point] == mode and not c["unavailable"]
    ]
    outcomes = {pair: _outcomes(results, pair, point) for pair in pairs}
    failing = [pair for pair in pairs if "failed" in outcomes[pair]]
    passing = [pair for pair in pairs if outcomes[pair] == {"passed"}]
    if failing:
        return "**FAIL**" + (f" (with {', '.join(failing)} only)" if passing else "")
    return "pass" if passing else "not run"


def _outcomes(results: dict[str, Any], pair: str, point: str) -> set[str]:
    """Outcomes of the pair's tests that check `point` (unmarked tests check every attach point)."""
    return {
        test["outcome"]
        for test in results["tests"]
        if test["combo"] == pair and (test["points"] is None or point in test["points"])
    }


def _row_name(row: RowResult) -> str:
    return f"{row.title}, `{row.release}`"


def table(rows: list[RowResult]) -> list[str]:
    lines = [f"| kernel | attach point | {' | '.join(MODES)} |", "|---|---|" + "---|" * len(MODES)]
    for row in rows:
        for index, (point, label) in enumerate(POINTS.items()):
            cells = (
                [cell(row.results, point, mode) for mode in MODES]
                if row.results
                else ["not run"] * len(MODES)
            )
            kernel = _row_name(row) if index == 0 else ""
            lines.append(f"| {kernel} | {label} | {' | '.join(cells)} |")
    return lines


def reasons(rows: list[RowResult]) -> list[str]:
    lines = ["## What `auto` chose, and why a mode is unavailable", ""]
    for row in rows:
        if not row.results:
            lines.append(f"- {_row_name(row)}: did not run: {row.error.splitlines()[0]}")
            continue
        seen = {why for modes in row.results["offers"].values() for why in modes.values() if why}
        auto = next(
            (t["properties"].get("auto", "") for t in row.results["tests"] if not t["combo"]), ""
        )
        lines.append(f"- {_row_name(row)} — `auto`: {auto or 'not recorded'}")
        lines.extend(f"  - {why}" for why in sorted(seen))
    return lines


BCC_TESTS = "tests/kernel/guest_bcc.py"


def bcc(rows: list[RowResult]) -> list[str]:
    """The BCC backend per row: compared with CO-RE where the row has the kernel's headers,
    else why it refused; and what `auto` said about it."""
    lines = [
        "## The BCC backend",
        "",
        f"`{BCC_TESTS}`: where a row supplies the kernel's headers, BCC and CO-RE (forced into",
        "BCC's attach modes) are attached at once to the same sockets (stalled,",
        "slow-but-draining, idle, reopening, closing); every record field, the edge events and",
        "the stream states must agree.",
        "Elsewhere BCC must refuse and say what to install. Every kernel here has BTF, so `auto`",
        "must keep CO-RE.",
        "",
    ]
    for row in rows:
        if not row.results:
            continue
        tests = {t["name"]: t for t in row.results["tests"] if t.get("module") == BCC_TESTS}
        ran = [t for t in tests.values() if t["outcome"] != "skipped"]
        verdict = "pass" if ran and all(t["outcome"] == "passed" for t in ran) else "**FAIL**"
        properties: dict[str, Any] = {}
        for test in tests.values():
            properties.update(test["properties"])
        detail = (
            f"compared with CO-RE: {properties['bcc_points']}; BCC's start (compile, load, "
            f"attach) took {properties['bcc_start_seconds']} s here"
            if "bcc_points" in properties
            else f"BCC refused as it should: {properties.get('bcc', 'not recorded')}"
        )
        lines.append(f"- {_row_name(row)}: {verdict} ({len(ran)} tests) — {detail}")
    return lines


def timings(rows: list[RowResult]) -> list[str]:
    lines = [
        "## Runs",
        "",
        "Wall time covers booting the kernel (VM rows), starting Python and the tests; `tests`",
        "is the pytest session alone, measured inside the kernel.",
        "",
        "| kernel | how | wall time | tests | passed | failed | skipped |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        outcomes = [t["outcome"] for t in row.results["tests"]] if row.results else []
        counts = [str(outcomes.count(kind)) for kind in ("passed", "failed", "skipped")]
        session = f"{row.results['session_seconds']:.0f} s" if row.results else "\u2014"
        lines.append(
            f"| {_row_name(row)} | {row.how} | {row.run.seconds:.0f} s | {session} | "
            f"{' | '.join(counts)} |"
        )
    return lines


def failures(rows: list[RowResult]) -> list[str]:
    found = [line for row in rows for line in row.failures()]
    if not found:
        return []
    lines = ["## Failures", ""]
    for failure in found:
        lines.extend(["```", *assertion_lines(failure), "```", ""])
    return lines


def assertion_lines(failure: str) -> list[str]:
    """The first line and pytest's `E` lines (assertion, message, verifier log) of a failure."""
    first, *rest = failure.strip().splitlines()
    explained = [line.removeprefix("E").strip() for line in rest if line.startswith("E ")]
    return [first, *(explained or rest[-20:])]


def render(rows: list[RowResult]) -> str:
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    lines = [
        "# Kernel matrix",
        "",
        f"Generated by `make kernel-matrix` on {today}. Each kernel runs",
        f"`tests/kernel/guest_modes.py` and `{BCC_TESTS}`: the CI kernel directly, the",
        "Debian kernels in a virtme-ng VM booted over this machine's root filesystem",
        "(`scripts/kernel_matrix`). Every pair of attach modes the kernel offers is forced in",
        "turn (`tests/kernel/plan.py`) and must pass:",
        "",
        *SCENARIOS,
        "",
        *table(rows),
        "",
        *HOW_IT_RUNS,
        "",
        *reasons(rows),
        "",
        *bcc(rows),
        "",
        *timings(rows),
        "",
        *failures(rows),
    ]
    return "\n".join(lines).rstrip() + "\n"

"""The audit log on real files: lines, fields, directories, failures and threads."""

from __future__ import annotations

import datetime
import io
import json
import threading
from pathlib import Path

import pytest

from kvwatch.act.audit import AuditLog
from kvwatch.errors import ConfigError
from kvwatch.policy.rules import Decision
from kvwatch.sockets import Endpoint
from kvwatch.streams.states import StreamState

WOULD_CANCEL = Decision("would_act", ("cancel",), "stalled", "stalled 3.20 s, 12.0 MiB KV; cancel")


def evidence() -> dict[str, object]:
    return {
        "local": Endpoint("10.0.0.1", 8000),
        "state": StreamState.STALLED,
        "no_progress_seconds": 3.2,
        "kv_bytes": 12 << 20,
        "gpu": [{"index": 0, "used_bytes": None}],
    }


def read_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_decision_is_one_json_line_in_the_file_and_on_the_echo(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "audit.jsonl"  # parents are created
    echo = io.StringIO()
    with AuditLog(str(path), echo=echo) as audit:
        entry = audit.record(
            WOULD_CANCEL, evidence(), {"request_id": "req-1", "decision_id": "d-1"}
        )
        assert read_lines(path) == [entry]  # flushed per line, before close
    assert echo.getvalue() == path.read_text()
    assert entry["kind"] == "decision"
    assert entry["verdict"] == "would_act"
    assert entry["actions"] == ["cancel"]
    assert (entry["reason"], entry["request_id"]) == ("stalled", "req-1")
    assert entry["evidence"]["local"] == "10.0.0.1:8000"
    assert entry["evidence"]["state"] == "stalled"
    assert isinstance(entry["monotonic_ns"], int)
    ts = entry["ts"]
    assert isinstance(ts, str) and ts.endswith("Z")
    when = datetime.datetime.fromisoformat(ts.replace("Z", "+00:00"))
    assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 60


def test_entries_are_appended_across_reopenings(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    for request_id in ("a", "b"):
        with AuditLog(str(path), echo=None) as audit:
            audit.record(WOULD_CANCEL, {}, {"request_id": request_id})
    assert [line["request_id"] for line in read_lines(path)] == ["a", "b"]


def test_an_outcome_records_what_the_action_did(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with AuditLog(str(path), echo=None) as audit:
        entry = audit.record_outcome(
            {"request_id": "req-1", "decision_id": "d-1", "local": "10.0.0.1:8000"},
            "cancel",
            {"acknowledged": True, "freed_blocks": 12, "freed_bytes": 786432},
        )
    assert read_lines(path) == [entry]
    assert (entry["kind"], entry["action"]) == ("outcome", "cancel")
    assert entry["result"]["freed_blocks"] == 12
    assert (entry["decision_id"], entry["local"], entry["remote"]) == ("d-1", "10.0.0.1:8000", None)


def test_no_path_logs_to_stdout_only(capsys: pytest.CaptureFixture[str]) -> None:
    audit = AuditLog("")
    entry = audit.record(WOULD_CANCEL, {})
    assert json.loads(capsys.readouterr().out) == entry
    assert entry["request_id"] is None
    silent = AuditLog(None, echo=None)
    silent.record(WOULD_CANCEL, {})
    assert silent.entries_recorded == 1
    assert capsys.readouterr().out == ""


def test_a_path_that_cannot_be_opened_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with pytest.raises(ConfigError) as raised:
        AuditLog(str(blocker / "audit.jsonl"))
    assert "not-a-directory" in raised.value.message
    assert "audit.path" in raised.value.hint


def test_write_failures_are_counted_never_raised() -> None:
    """/dev/full accepts the open and fails every flush with ENOSPC: a real full disk."""
    echo = io.StringIO()
    audit = AuditLog("/dev/full", echo=echo)
    audit.record(WOULD_CANCEL, {})
    audit.record_outcome({"request_id": "r"}, "reset", {"errno": 0})
    assert audit.write_errors == 2
    assert len(echo.getvalue().splitlines()) == 2  # the echo still got both
    echo.close()
    audit.record(WOULD_CANCEL, {})
    assert audit.write_errors == 4  # the file again, and the closed echo
    audit.close()


def test_concurrent_writers_never_interleave_lines(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path), echo=None)
    big = {"blob": "x" * 5000}

    def write(worker: int) -> None:
        for n in range(100):
            audit.record(WOULD_CANCEL, big, {"request_id": f"{worker}-{n}"})

    threads = [threading.Thread(target=write, args=(worker,)) for worker in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    audit.close()
    lines = read_lines(path)
    assert len(lines) == 800
    assert len({line["request_id"] for line in lines}) == 800
    assert audit.write_errors == 0

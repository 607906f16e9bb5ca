"""The audit log: one JSON line per policy decision and per action outcome.

Each line goes to a file (appended, flushed per line) and, by default, to stdout, which
journald collects under systemd. A decision line holds the time (RFC 3339 UTC and monotonic
nanoseconds), the verdict, actions, reason, detail, request ID and the evidence the caller
gathered (socket fields and durations, the judge's required time and evidence, KV bytes, GPU
memory). An outcome line records what an action did (the engine's cancel acknowledgement with
the freed blocks and bytes, or the reset's result). Both carry the same reference: the
decision's id, the request ID (null for a stream no engine announced) and the socket's
local and remote addresses, so an outcome is matched to its decision by id, never by position.
Rotation is not done here: use logrotate with `copytruncate` (the file is kept open
in append mode, so writes after a truncation land at the new end).
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO, Final, TextIO

from kvwatch.errors import ConfigError
from kvwatch.policy.rules import Decision

log = logging.getLogger(__name__)


# What ties audit lines together: decision_id, request_id, local, remote.
Reference = Mapping[str, Any]
REFERENCE_KEYS = ("decision_id", "request_id", "local", "remote")


def _referenced(ref: Reference | None) -> dict[str, Any]:
    """The reference fields of an entry, each present (null when unknown)."""
    given = ref or {}
    return {key: given.get(key) for key in REFERENCE_KEYS}


class _Stdout:
    """The default echo: the process's stdout at the time the log is opened."""


STDOUT: Final = _Stdout()


def rfc3339_now() -> str:
    """The current UTC time as RFC 3339 with milliseconds, e.g. 2024-05-01T12:00:00.123Z."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _open_append(path: str) -> BinaryIO:
    """Unbuffered and append-only: each entry is one write() at the file's end, so nothing
    waits in a buffer after a failure and a copytruncate rotation loses no partial line."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return open(path, "ab", buffering=0)
    except OSError as exc:
        raise ConfigError(
            f"cannot open the audit log {path}: {exc.strerror}",
            'set audit.path to a writable file, or to "" to log to stdout only',
        ) from exc


def _write_all(file: BinaryIO, data: bytes) -> None:
    while data:
        written = file.write(data)
        if not written:
            raise OSError(errno.EIO, "the file accepted no bytes")
        data = data[written:]


def _write_flushed(stream: TextIO, line: str) -> None:
    stream.write(line)
    stream.flush()


class AuditLog:
    """Writes audit entries to `path` ("" or None: no file) and to `echo` (None: nowhere).

    Thread-safe: one lock orders whole lines. A failing write (disk full, closed stdout) is
    counted in `write_errors` and logged, never raised: the agent keeps running without its
    log rather than stopping its policy. Owns the file it opened; `close` closes it.
    """

    def __init__(self, path: str | None, echo: TextIO | _Stdout | None = STDOUT) -> None:
        self.path = path or ""
        self._file = _open_append(self.path) if self.path else None
        self._echo = sys.stdout if isinstance(echo, _Stdout) else echo
        self._lock = threading.Lock()
        self.entries_recorded = 0
        self.write_errors = 0

    def record(
        self, decision: Decision, evidence: dict[str, Any], ref: Reference | None = None
    ) -> dict[str, Any]:
        """Logs one decision with its evidence; `ref` names it and its stream (decision_id,
        request_id, local, remote). Returns the entry as written."""
        entry: dict[str, Any] = {
            "kind": "decision",
            **_referenced(ref),
            "verdict": decision.verdict,
            "actions": list(decision.actions),
            "reason": decision.reason,
            "detail": decision.detail,
            "evidence": evidence,
        }
        return self._write(entry)

    def record_outcome(
        self, ref: Reference | None, action: str, result: dict[str, Any]
    ) -> dict[str, Any]:
        """Logs what an action did (cancel acknowledgement, reset result) under the reference
        of the decision that ordered it; returns the entry."""
        entry = {"kind": "outcome", **_referenced(ref), "action": action, "result": result}
        return self._write(entry)

    def _write(self, fields: dict[str, Any]) -> dict[str, Any]:
        entry = {"ts": rfc3339_now(), "monotonic_ns": time.monotonic_ns(), **fields}
        # default=str: evidence may hold endpoints or enums; an audit line is never refused.
        line = json.dumps(entry, default=str, separators=(",", ":")) + "\n"
        with self._lock:
            file, echo = self._file, self._echo
            if file is not None:
                self._guarded(file.name, lambda: _write_all(file, line.encode()))
            if echo is not None:
                self._guarded("the echo stream", lambda: _write_flushed(echo, line))
            self.entries_recorded += 1
        written: dict[str, Any] = json.loads(line)
        return written

    def _guarded(self, where: object, write: Callable[[], None]) -> None:
        try:
            write()
        except (OSError, ValueError) as exc:  # ValueError: the stream was closed
            self.write_errors += 1
            log.warning("audit log write to %s failed: %s", where, exc)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

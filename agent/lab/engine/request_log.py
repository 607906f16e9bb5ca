"""The engine's requests as `GET /v1/requests` shows them: every live one and the last finished
ones, with the tokens each generated and the tokens its writer took, so anyone can count the
tokens decoded that no reader read."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass

from kvwatch.lab.engine.metrics import RequestSnapshot
from kvwatch.lab.engine.output import Finish, OutputChannel

FINISHED_KEPT = 256


@dataclass(frozen=True)
class RequestReport:
    """One request: `state` is its snapshot's while it lives ("waiting", "running",
    "egress_blocked", "paused", "parking", "parked"), then "finished" or "cancelled" with its
    `finish_reason`; `tokens_taken` counts the tokens its writer took from the engine's
    output queue (the rest of `tokens_generated` waits there)."""

    request_id: str
    state: str
    kv_blocks: int
    tokens_generated: int
    tokens_taken: int
    finish_reason: str | None

    def as_json(self) -> dict[str, object]:
        return asdict(self)


class RequestLog:
    """Output channels of the live requests and the last FINISHED_KEPT finished ones.

    Thread-safe: `Engine.submit` adds (before the engine thread can see the request), the
    engine thread ends, any thread reads. Invariant: a request is live here from its
    submission until its finish, then among the finished until FINISHED_KEPT newer ones
    have finished."""

    def __init__(self, finished_kept: int = FINISHED_KEPT) -> None:
        self._finished_kept = finished_kept
        self._lock = threading.Lock()
        self._live: dict[str, OutputChannel] = {}
        self._finished: OrderedDict[str, tuple[Finish, OutputChannel]] = OrderedDict()

    def add(self, request_id: str, channel: OutputChannel) -> None:
        with self._lock:
            self._live[request_id] = channel

    def ended(self, request_id: str, finish: Finish) -> None:
        with self._lock:
            channel = self._live.pop(request_id, None)
            if channel is None:
                return
            self._finished[request_id] = (finish, channel)
            self._finished.move_to_end(request_id)
            while len(self._finished) > self._finished_kept:
                self._finished.popitem(last=False)

    def reports(self, snapshots: tuple[RequestSnapshot, ...]) -> list[RequestReport]:
        """Every live request (its state and blocks as `snapshots`, the engine's latest, show
        them; one submitted since is "waiting"), then the finished ones, oldest first."""
        by_id = {snapshot.request_id: snapshot for snapshot in snapshots}
        with self._lock:
            live = list(self._live.items())
            finished = list(self._finished.items())
        reports = []
        for request_id, channel in live:
            snapshot = by_id.get(request_id)
            state, blocks = (
                ("waiting", 0) if snapshot is None else (snapshot.state, snapshot.kv_blocks)
            )
            reports.append(RequestReport(request_id, state, blocks, *channel.token_counts(), None))
        for request_id, (finish, channel) in finished:
            state = "cancelled" if finish.cancelled else "finished"
            counts = channel.token_counts()
            reports.append(RequestReport(request_id, state, 0, *counts, finish.reason))
        return reports

"""Engine-level helpers for the park, pause and transfer tests: requests read on the test's
thread a batch at a time (nothing is read until the test says so, so in coupled mode a request
blocks after `egress_queue_tokens` tokens), and waiting on a request's state."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

from kvwatch.lab.engine.engine import Engine
from kvwatch.lab.engine.requests import GenerationRequest, RequestHandle
from kvwatch.lab.waiting import wait_until

WAIT_SECONDS = 20.0
_ids = itertools.count()


@dataclass
class Reader:
    """Reads one request's output and records what its callbacks said."""

    handle: RequestHandle = field(init=False)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    kv_reports: list[int] = field(default_factory=list)
    resumes: list[tuple[int, int]] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finish_reason: str = ""

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    def kv_changed(self, kv_blocks: int, tokens_out: int) -> None:
        self.kv_reports.append(kv_blocks)

    def resumed(self, kv_blocks: int, recomputed_tokens: int) -> None:
        self.resumes.append((kv_blocks, recomputed_tokens))

    def read_batch(self) -> bool:
        """Reads what is queued (waiting for it); True once the finish record came."""
        batch = self.handle.channel.wait_batch(WAIT_SECONDS)
        assert batch is not None, f"{self.request_id} sent nothing"
        self.token_ids.extend(batch.token_ids)
        self.text += "".join(batch.texts)
        if batch.finish is not None:
            self.finish_reason = batch.finish.reason
        return batch.finish is not None

    def read_all(self) -> Reader:
        while not self.read_batch():
            pass
        return self

    def read_queued(self) -> None:
        """Reads what is queued now, without waiting for more."""
        batch = self.handle.channel.wait_batch(0)
        if batch is not None:
            self.token_ids.extend(batch.token_ids)
            self.text += "".join(batch.texts)


def submit(engine: Engine, prompt: str, max_tokens: int, **options: Any) -> Reader:
    """Submits a request (a fresh id) whose callbacks the returned reader records."""
    reader = Reader()
    request = GenerationRequest(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=engine.tokenizer.encode(prompt),
        max_tokens=max_tokens,
        on_cancelled=reader.cancelled.set,
        on_kv_change=reader.kv_changed,
        on_resumed=reader.resumed,
        **options,
    )
    reader.handle = engine.submit(request)
    return reader


def state_of(engine: Engine, request_id: str) -> str:
    snapshot = next((r for r in engine.stats().requests if r.request_id == request_id), None)
    return "gone" if snapshot is None else snapshot.state


def generated(engine: Engine, request_id: str) -> int:
    """Tokens the request generated, as GET /v1/requests reports them."""
    report = next(r for r in engine.request_reports() if r.request_id == request_id)
    return report.tokens_generated


def wait_state(engine: Engine, reader: Reader, state: str) -> None:
    wait_until(
        lambda: state_of(engine, reader.request_id) == state,
        WAIT_SECONDS,
        lambda: f"{reader.request_id} {state} (it is {state_of(engine, reader.request_id)})",
    )


def assert_all_free(engine: Engine) -> None:
    """Nothing held: no live request, no block, no host copy; block ownership consistent."""
    wait_until(lambda: not engine.stats().requests, WAIT_SECONDS, "every request ended")
    stats = engine.stats()
    assert (stats.kv_blocks_used, stats.parked, stats.parked_host_bytes) == (0, 0, 0)
    engine.kv.check_invariants()
    assert engine.error is None

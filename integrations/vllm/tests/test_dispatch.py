"""The API server's side without a server: the id mapping (kvwatch_vllm.ids) and the hook's
handlers (kvwatch_vllm.dispatch) over an engine that answers as the EngineCore would."""

from __future__ import annotations

from kvwatch_vllm.commands import EngineUnreachableError
from kvwatch_vllm.dispatch import Dispatch
from kvwatch_vllm.ids import engine_request_ids, external_ids_of
from kvwatch_vllm.outcome import HoldResult

LIVE = {
    "cmpl-abc-0": ["cmpl-abc-0-1a2b3c4d"],
    "cmpl-abc-1": ["cmpl-abc-1-5e6f7a8b"],
    "cmpl-abc-x-0": ["cmpl-abc-x-0-9c0d1e2f"],
    "cmpl-ab-0": ["cmpl-ab-0-3a4b5c6d"],
    "chatcmpl-abc": ["chatcmpl-abc-7e8f9a0b"],
    "chatcmpl-abcd": ["chatcmpl-abcd-1b2c3d4e"],
}


def test_an_x_request_id_maps_to_exactly_its_requests_internal_ids() -> None:
    assert external_ids_of("abc", from_header=True, live=LIVE) == [
        "chatcmpl-abc",
        "cmpl-abc-0",
        "cmpl-abc-1",
    ]
    assert engine_request_ids(LIVE, "ab", from_header=True) == ["cmpl-ab-0-3a4b5c6d"]
    assert engine_request_ids(LIVE, "abc-x", from_header=True) == ["cmpl-abc-x-0-9c0d1e2f"]
    assert engine_request_ids(LIVE, "nope", from_header=True) == []


def test_a_chunk_id_maps_to_its_own_requests_only() -> None:
    assert engine_request_ids(LIVE, "cmpl-abc", from_header=False) == [
        "cmpl-abc-0-1a2b3c4d",
        "cmpl-abc-1-5e6f7a8b",
    ]
    assert engine_request_ids(LIVE, "chatcmpl-abc", from_header=False) == ["chatcmpl-abc-7e8f9a0b"]
    assert engine_request_ids(LIVE, "abc", from_header=False) == []  # not a chunk id


class Engine:
    """Answers as kvwatch's engine utility does; or raises what the test sets."""

    def __init__(self, results: list[HoldResult], error: Exception | None = None) -> None:
        self.results, self.error = results, error
        self.calls: list[tuple[str, str, bool]] = []

    def hold(self, command: str, announced: str, *, from_header: bool) -> list[HoldResult]:
        self.calls.append((command, announced, from_header))
        if self.error is not None:
            raise self.error
        return self.results


def dispatch(engine: Engine | None, live: dict[str, bool]) -> Dispatch:
    return Dispatch(lambda: engine, live.get)


def test_the_handlers_answer_in_the_protocols_words() -> None:
    parked = HoldResult("cmpl-s-0-1", "park", "parked", 3, 96, "freed 3 of its 3 blocks")
    engine = Engine([parked])
    handlers = dispatch(engine, {"s": True})

    outcome = handlers.park("s", "backpressure")

    assert (outcome.request_id, outcome.status, outcome.freed_blocks, outcome.freed_bytes) == (
        "s",
        "parked",
        3,
        96,
    )
    assert engine.calls == [("park", "s", True)]
    engine.results = [HoldResult("cmpl-s-0-1", "resume", "resumed")]
    assert handlers.resume("s", "lease").status == "released"  # the protocol's release
    engine.results = [HoldResult("cmpl-s-0-1", "resume", "not_held", detail="running")]
    assert handlers.resume("s", "lease").status == "not_held"


def test_every_case_without_an_answer_from_vllm_has_its_status() -> None:
    assert dispatch(Engine([]), {}).pause("gone").status == "unknown_request"
    assert dispatch(None, {"s": True}).pause("s").status == "failed"
    ended = dispatch(Engine([]), {"s": True}).park("s")
    assert ended.status == "already_finished" and "generation ended" in ended.detail
    slow = dispatch(Engine([], EngineUnreachableError("no answer within 4 s")), {"s": True})
    assert slow.park("s").status == "failed"
    broken = dispatch(Engine([], ValueError("bad wire")), {"s": True}).park("s")
    assert (broken.status, broken.detail) == ("failed", "ValueError: bad wire")


def test_a_stream_of_several_prompts_is_parked_as_one() -> None:
    engine = Engine(
        [
            HoldResult("cmpl-s-0-1", "park", "parked", 2, 64),
            HoldResult("cmpl-s-1-2", "park", "already_finished", detail="finished (length)"),
        ]
    )
    outcome = dispatch(engine, {"s": True}).park("s")
    assert (outcome.status, outcome.freed_blocks) == ("parked", 2)
    assert "cmpl-s-1-2: already_finished" in outcome.detail

"""The engine hook's pause, park and resume (the protocol's "release") handlers for vLLM: from
the id a stream was announced under to the EngineCore's answer, as the hook's outcome.

Runs on the hook's worker threads (and the control socket's); each call blocks until the
EngineCore answered or `EngineCommands`' timeout passed. Imports nothing from vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvwatch.hookwire.types import CancelOutcome
from kvwatch_vllm.commands import EngineUnreachableError
from kvwatch_vllm.outcome import (
    ALREADY_FINISHED,
    FAILED,
    PARK,
    PARKED,
    PAUSE,
    PAUSED,
    RESUME,
    RESUMED,
    UNKNOWN_REQUEST,
    HoldResult,
)

# What the hook's protocol calls each command and its success (docs/protocol.md): a resume
# is the agent's "release", answered "released".
HOOK_COMMAND = {PAUSE: "pause", PARK: "park", RESUME: "release"}
HOOK_SUCCESS = {PAUSED: "paused", PARKED: "parked", RESUMED: "released"}
SUCCESS = {PAUSE: PAUSED, PARK: PARKED, RESUME: RESUMED}


class Engine(Protocol):
    """What the dispatch needs of `EngineCommands`."""

    def hold(self, command: str, announced: str, *, from_header: bool) -> list[HoldResult]: ...


class Dispatch:
    """Runs one command for one announced stream. `engine()` is the EngineCore's command
    client, None until the API server has served a request; `from_header(id)` says whether
    a live stream was announced under its X-Request-Id (True), its first chunk's id (False),
    or is not live (None)."""

    def __init__(
        self, engine: Callable[[], Engine | None], from_header: Callable[[str], bool | None]
    ) -> None:
        self._engine = engine
        self._from_header = from_header

    def pause(self, stream_id: str, reason: str = "") -> CancelOutcome:
        """The hook's `pause_handler`: the stream's vLLM requests get no tokens, keep KV."""
        return self.run(PAUSE, stream_id)

    def park(self, stream_id: str, reason: str = "") -> CancelOutcome:
        """The hook's `park_handler`: the stream's vLLM requests free their KV now."""
        return self.run(PARK, stream_id)

    def resume(self, stream_id: str, reason: str = "") -> CancelOutcome:
        """The hook's `release_handler`: paused or parked requests run again."""
        return self.run(RESUME, stream_id)

    def run(self, command: str, stream_id: str) -> CancelOutcome:
        from_header = self._from_header(stream_id)
        if from_header is None:
            return CancelOutcome(stream_id, UNKNOWN_REQUEST, 0, 0, "no such live stream")
        engine = self._engine()
        if engine is None:
            return CancelOutcome(stream_id, FAILED, 0, 0, "the vLLM engine client is not known yet")
        try:
            results = engine.hold(command, stream_id, from_header=from_header)
        except EngineUnreachableError as exc:
            return CancelOutcome(stream_id, FAILED, 0, 0, str(exc))
        except Exception as exc:  # the hook answers failed; the engine goes on
            return CancelOutcome(stream_id, FAILED, 0, 0, f"{type(exc).__name__}: {exc}")
        if not results:
            return CancelOutcome(
                stream_id,
                ALREADY_FINISHED,
                0,
                0,
                "the stream is live but vLLM has no request for it: its generation ended",
            )
        return combined(command, stream_id, results)


def combined(command: str, stream_id: str, results: list[HoldResult]) -> CancelOutcome:
    """One outcome for a stream from its requests' results (one per prompt of a completion):
    the command's success if any request took it, with the blocks freed summed."""
    success = SUCCESS[command]
    status = success if any(r.status == success for r in results) else results[0].status
    details = [r.detail for r in results if r.detail]
    if len(results) > 1:
        details = [f"{r.request_id}: {r.status} {r.detail}".strip() for r in results]
    return CancelOutcome(
        stream_id,
        HOOK_SUCCESS.get(status, status),
        sum(r.freed_blocks for r in results),
        sum(r.freed_bytes for r in results),
        "; ".join(details),
    )

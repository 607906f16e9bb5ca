"""What other threads ask of the engine thread about a live request (cancel, park, pause,
release, abort), and the answers the engine gives without touching one."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from kvwatch.hookwire.types import CommandOutcome


@dataclass(eq=False)
class Order:
    """A command of the agent's: queued in the engine's inbox, applied at the next step
    boundary, answered exactly once through `outcome`."""

    request_id: str
    reason: str
    outcome: Future[CommandOutcome] = field(default_factory=Future)


class CancelOrder(Order):
    """End the request and free its blocks (`Engine.cancel`)."""


class ParkOrder(Order):
    """Free the request's blocks but keep it until it is released (`Engine.park`)."""


class PauseOrder(Order):
    """Give the request no more steps; it keeps its blocks and its place (`Engine.pause`)."""


class ReleaseOrder(Order):
    """End the request's pause or park: it is scheduled again (`Engine.release`)."""


@dataclass(eq=False)
class Abort:
    """End the request: its client went away (`Engine.abort`); answered by nobody."""

    request_id: str


def failed(request_id: str, detail: str) -> CommandOutcome:
    """An order that could not be carried out: nothing was freed."""
    return CommandOutcome(request_id, "failed", 0, 0, detail)


def not_live(request_id: str, finished: bool) -> CommandOutcome:
    """The answer to an order for a request that is not live: it finished, or never was."""
    if finished:
        return CommandOutcome(
            request_id, "already_finished", 0, 0, "it already finished; its blocks are free"
        )
    return CommandOutcome(request_id, "unknown_request", 0, 0, "no such request")

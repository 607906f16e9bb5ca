"""What other threads ask of the engine thread about a live request (cancel, park, abort), and
the answers the engine gives without touching one."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from kvwatch.hookwire.types import CancelOutcome


@dataclass(eq=False)
class Order:
    """A cancel or a park: queued in the engine's inbox, applied at the next step boundary,
    answered exactly once through `outcome`."""

    request_id: str
    reason: str
    outcome: Future[CancelOutcome] = field(default_factory=Future)


class CancelOrder(Order):
    """End the request and free its blocks (`Engine.cancel`)."""


class ParkOrder(Order):
    """Free the request's blocks but keep it until its client reads (`Engine.park`)."""


@dataclass(eq=False)
class Abort:
    """End the request: its client went away (`Engine.abort`); answered by nobody."""

    request_id: str


def failed(request_id: str, detail: str) -> CancelOutcome:
    """An order that could not be carried out: nothing was freed."""
    return CancelOutcome(request_id, "failed", 0, 0, detail)


def not_live(request_id: str, finished: bool) -> CancelOutcome:
    """The answer to an order for a request that is not live: it finished, or never was."""
    if finished:
        return CancelOutcome(
            request_id, "already_finished", 0, 0, "it already finished; its blocks are free"
        )
    return CancelOutcome(request_id, "unknown_request", 0, 0, "no such request")

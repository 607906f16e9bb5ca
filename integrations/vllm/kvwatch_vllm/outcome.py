"""What a pause, park or resume of one vLLM request did: the statuses (the engine hook's words,
docs/protocol.md) and the result the scheduler returns. Imports nothing from vLLM, so the API
server side and the tests can use it alone."""

from __future__ import annotations

from dataclasses import dataclass

# The three commands, by the name the engine-core utility takes.
PAUSE = "pause"
PARK = "park"
RESUME = "resume"
COMMANDS = (PAUSE, PARK, RESUME)

# Statuses. Each command answers its own word when it did what it asks.
PAUSED = "paused"
PARKED = "parked"
RESUMED = "resumed"
UNKNOWN_REQUEST = "unknown_request"
ALREADY_FINISHED = "already_finished"
DECLINED = "declined"
NOT_HELD = "not_held"
FAILED = "failed"

STATUSES: dict[str, frozenset[str]] = {
    PAUSE: frozenset({PAUSED, UNKNOWN_REQUEST, ALREADY_FINISHED, DECLINED, FAILED}),
    PARK: frozenset({PARKED, UNKNOWN_REQUEST, ALREADY_FINISHED, DECLINED, FAILED}),
    RESUME: frozenset({RESUMED, UNKNOWN_REQUEST, ALREADY_FINISHED, NOT_HELD, FAILED}),
}


@dataclass(frozen=True)
class HoldResult:
    """One command's answer for one vLLM request (its internal id, `cmpl-…-<random>`).

    `freed_blocks` is what a park returned to vLLM's free block pool at once: the request's
    blocks that no other request shares (with prefix caching, shared prefix blocks stay with
    the requests that share them); `freed_bytes` the same in bytes. A pause and a resume free
    nothing. `detail` says, for humans, why a command did not do what it asks, or what else
    is worth knowing (a park of a request that held no blocks).
    """

    request_id: str
    command: str
    status: str
    freed_blocks: int = 0
    freed_bytes: int = 0
    detail: str = ""

    def __post_init__(self) -> None:
        allowed = STATUSES.get(self.command)
        if allowed is None:
            raise ValueError(f"unknown command {self.command!r}; one of {', '.join(COMMANDS)}")
        if self.status not in allowed:
            raise ValueError(
                f"{self.status!r} is not a status of {self.command!r}: {sorted(allowed)}"
            )

    def to_wire(self) -> list[str | int]:
        """The form that crosses vLLM's engine-core utility channel (msgspec: plain values)."""
        return [
            self.request_id,
            self.command,
            self.status,
            self.freed_blocks,
            self.freed_bytes,
            self.detail,
        ]

    @classmethod
    def from_wire(cls, value: object) -> HoldResult:
        """The inverse of `to_wire`; a ValueError names what is wrong."""
        if not isinstance(value, (list, tuple)) or len(value) != 6:
            raise ValueError(f"not a kvwatch hold result: {value!r}")
        request_id, command, status, freed_blocks, freed_bytes, detail = value
        if (
            isinstance(request_id, str)
            and isinstance(command, str)
            and isinstance(status, str)
            and isinstance(freed_blocks, int)
            and isinstance(freed_bytes, int)
            and isinstance(detail, str)
        ):
            return cls(request_id, command, status, freed_blocks, freed_bytes, detail)
        raise ValueError(f"not a kvwatch hold result: {value!r}")

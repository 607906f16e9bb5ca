"""The engine hook's types both sides share besides the messages: where the socket is, and how
an engine answers a cancel, a park or a detach."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_SOCKET_PATH = "/run/kvwatch/engine.sock"
SOCKET_PATH_ENV = "KVWATCH_ENGINE_SOCKET"


def resolve_socket_path(socket_path: str | None) -> str:
    """The explicit path, else $KVWATCH_ENGINE_SOCKET, else the default."""
    return socket_path or os.environ.get(SOCKET_PATH_ENV) or DEFAULT_SOCKET_PATH


@dataclass(frozen=True)
class CancelOutcome:
    """The engine's answer to a cancel or a park, given only after the freed blocks are
    really free.

    `status` is one of "cancelled", "unknown_request", "already_finished", "failed" for a
    cancel, and one of "parked", "unknown_request", "already_finished", "declined", "failed"
    for a park (docs/protocol.md); `detail` says, for humans, why nothing was freed.
    """

    request_id: str
    status: str
    freed_blocks: int
    freed_bytes: int
    detail: str = ""


ParkOutcome = CancelOutcome
"""A park's answer has a cancel's fields; the name says which one a handler returns."""


@dataclass(frozen=True)
class DetachOutcome(CancelOutcome):
    """The engine's answer to a detach: `status` is one of "detached", "unknown_request",
    "already_finished", "declined", "failed"; a detach frees nothing at once (the KV goes when
    the generation ends), so `freed_blocks` and `freed_bytes` are 0; `buffered_bytes` is what
    the stream's host buffer held when it detached (the send it adopted)."""

    buffered_bytes: int = 0


CancelHandler = Callable[[str, str], CancelOutcome]
"""(request_id, reason) -> outcome; runs on a hook worker thread, may block until its timeout."""

ParkHandler = Callable[[str, str], ParkOutcome]
"""(request_id, reason) -> outcome, like a cancel handler: frees the request's KV now, keeps
the request and its connection, and resumes it once its client reads again."""

DetachHandler = Callable[[str, str], DetachOutcome]
"""(request_id, reason) -> outcome, like a cancel handler: from now on the request's output
goes to a bounded host buffer, so its generation no longer waits for its client."""

"""The engine hook's types both sides share besides the messages: where the socket is, and how
an engine answers a cancel or a park."""

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

CancelHandler = Callable[[str, str], CancelOutcome]
"""(request_id, reason) -> outcome; runs on a hook worker thread, may block until its timeout."""

ParkHandler = Callable[[str, str], ParkOutcome]
"""(request_id, reason) -> outcome, like a cancel handler: frees the request's KV now, keeps
the request and its connection, and resumes it once its client reads again."""

"""The engine hook's types both sides share besides the messages: where the socket is, and how
an engine answers a cancel."""

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
    """The engine's answer to a cancel, given only after the freed blocks are really free.

    `status` is one of "cancelled", "unknown_request", "already_finished", "failed"; `detail`
    says, for humans, why nothing was freed.
    """

    request_id: str
    status: str
    freed_blocks: int
    freed_bytes: int
    detail: str = ""


CancelHandler = Callable[[str, str], CancelOutcome]
"""(request_id, reason) -> outcome; runs on a hook worker thread, may block until its timeout."""

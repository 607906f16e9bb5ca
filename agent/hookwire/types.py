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
class CommandOutcome:
    """The engine's answer to one command of the agent's (kvwatch.hookwire.protocol,
    COMMAND_KINDS: cancel, park, detach), given once it took effect: blocks it frees are
    really free by then.

    `status` is one of the statuses of the command's answer type (docs/protocol.md): the
    command's own word when it did what it asks ("cancelled", "parked", "detached"), else
    "unknown_request", "already_finished", "declined" or "failed"; `detail` says, for humans,
    why it did not. `freed_blocks` and `freed_bytes` are what it returned to the pool at once
    (a cancel, a park; 0 for the others); `buffered_bytes` what a detach's host buffer held
    as it detached (0 for the others).
    """

    request_id: str
    status: str
    freed_blocks: int = 0
    freed_bytes: int = 0
    detail: str = ""
    buffered_bytes: int = 0


CancelOutcome = CommandOutcome
"""The name engines wrote their cancel handlers against before every command shared one
outcome type (kvwatch.hook exports it); the same class."""

CommandHandler = Callable[[str, str], CommandOutcome]
"""(request_id, reason) -> outcome; the engine's handler for one command. Runs on a hook
worker thread and may block until its timeout (docs/protocol.md, "Cancel is two-phase")."""

CancelHandler = CommandHandler
"""The handler type under the name kvwatch.hook exports it by."""

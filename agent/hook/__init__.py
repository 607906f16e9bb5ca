"""The engine hook: tells the kvwatch agent about an engine's streams, runs its commands.

Never imports torch. See docs/protocol.md for the wire protocol and `EngineHook` for use.
"""

from kvwatch.hook.engine_hook import EngineHook
from kvwatch.hookwire.protocol import EngineInfo
from kvwatch.hookwire.types import (
    DEFAULT_SOCKET_PATH,
    SOCKET_PATH_ENV,
    CancelHandler,
    CancelOutcome,
    CommandHandler,
    CommandOutcome,
)

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "SOCKET_PATH_ENV",
    "CancelHandler",
    "CancelOutcome",
    "CommandHandler",
    "CommandOutcome",
    "EngineHook",
    "EngineInfo",
]

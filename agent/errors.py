"""The one error hierarchy of kvwatch.

Every error carries a message that says what went wrong and a hint that says what to do next.
The CLI maps each class to the exit code of DESIGN.md's contract.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_PRIVILEGE = 3


class KvwatchError(Exception):
    """Base class: a failure kvwatch understands and can explain."""

    exit_code = EXIT_RUNTIME

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class ConfigError(KvwatchError):
    """Bad user input: flags, config files, arguments."""

    exit_code = EXIT_USAGE


class PrivilegeError(KvwatchError):
    """A missing privilege or kernel feature; the hint says how to get it."""

    exit_code = EXIT_PRIVILEGE


class BpfError(KvwatchError):
    """Loading or attaching the BPF programs failed."""

    exit_code = EXIT_PRIVILEGE


class ProtocolError(KvwatchError):
    """A malformed or unexpected message on the engine-hook protocol."""

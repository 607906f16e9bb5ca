"""The one error hierarchy of kvwatch.

Every error carries a message that says what went wrong and a hint that says what to do next.
The CLI maps each class to its exit code (docs/contracts.md, "Commands and exit codes").
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_PRIVILEGE = 3
# The most characters of a value an error message quotes: a message stays one short line
# whatever the user or a peer sent (a 50 MB config value, a 100 kB id).
QUOTE_CHARS = 80
# A file's path is shown whole up to this many characters (a pod's mounts and a test's
# temporary directories run long; the user must see which file), cut beyond.
PATH_CHARS = 240


def quoted(text: str, limit: int = QUOTE_CHARS) -> str:
    """`text` as an error message may show it: on one line, control characters and bytes that
    are not UTF-8 escaped, at most `limit` characters of it, and its length when cut."""
    shown = text if text.isprintable() else repr(text)[1:-1]
    if len(shown) <= limit:
        return shown
    return f"{shown[:limit]}... ({len(text)} characters)"


def quoted_path(path: object) -> str:
    """A path as an error message shows it: as `quoted`, whole up to PATH_CHARS."""
    return quoted(str(path), PATH_CHARS)


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

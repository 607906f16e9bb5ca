"""Reading a small file a user named (a config file, a saved baseline): only a regular file,
only so many bytes, never blocking, with one clear error for anything else."""

from __future__ import annotations

import os
import stat

from kvwatch.errors import ConfigError, quoted_path

_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _not_regular(path: str, mode: int, what: str, fix: str) -> ConfigError:
    kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return ConfigError(f"{what} {quoted_path(path)} is {kind}, not a regular file", fix)


def _read_head(path: str, what: str, fix: str, max_bytes: int) -> bytes:
    """The first `max_bytes` + 1 bytes of the regular file at `path`. Anything else is refused
    before it is opened (a FIFO would block, a device would never end), and again once open
    (it may have been replaced in between); a read never blocks."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode, what, fix)
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with os.fdopen(descriptor, "rb") as file:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode, what, fix)
        return file.read(max_bytes + 1)


def read_small_file(path: str, what: str, fix: str, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path`, a file a user named (`what` it is, for
    messages: "config file"); ConfigError (with `fix`) for an empty path, anything but a
    regular file, a file over `max_bytes`, or one that cannot be read."""
    shown = quoted_path(path)
    if not path:
        raise ConfigError(f"the {what} path is empty", fix)
    try:
        data = _read_head(path, what, fix, max_bytes)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {shown}: {exc.strerror}", fix) from exc
    except ValueError as exc:  # a NUL in the path
        raise ConfigError(f"cannot read {what} {shown}: {exc}", fix) from exc
    if len(data) > max_bytes:
        raise ConfigError(
            f"{what} {shown} is larger than {max_bytes} bytes ({max_bytes >> 20} MiB), the most "
            "kvwatch reads",
            fix,
        )
    return data

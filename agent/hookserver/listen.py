"""The hook server's listening unix socket: its directory, a stale file, mode, peer credentials."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import struct
from pathlib import Path

from kvwatch.errors import ConfigError, PrivilegeError
from kvwatch.hookserver.engine_connection import PeerCredentials

SOCKET_MODE = 0o660
DIRECTORY_MODE = 0o755
MAX_PATH_BYTES = 107  # sun_path is 108 bytes, NUL included
PROBE_SECONDS = 0.5
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

_log = logging.getLogger("kvwatch.hookserver")
_PATH_HINT = "pass another engine socket path (the engines must be configured with the same one)"


async def bind_listening_socket(path: str) -> tuple[socket.socket, int]:
    """A bound (not yet listening) socket at `path` with mode 0660, and the file's inode.

    Creates the parent directory (0755) when missing and replaces a stale socket file; refuses a
    path where another process listens or where something other than a socket lies. Binding
    before `listen()` means no engine can connect while the mode is still the umask's.
    """
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise ConfigError(
            f"engine socket path {path!r} is longer than {MAX_PATH_BYTES} bytes", _PATH_HINT
        )
    _make_directory(Path(path).parent)
    await _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, SOCKET_MODE)
        inode = os.stat(path).st_ino
    except OSError as exc:
        sock.close()
        raise _os_error(f"cannot create the engine socket {path}", exc) from exc
    sock.setblocking(False)
    return sock, inode


def remove_socket_file(path: str, inode: int) -> None:
    """Removes the socket file if it is still the one this server bound (not a successor's)."""
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == inode:
            os.unlink(path)


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The connected peer's pid, uid and gid from SO_PEERCRED (pid 0: not in our namespace)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


def _make_directory(directory: Path) -> None:
    if directory.is_dir():
        return
    if directory.exists():
        raise ConfigError(f"{directory} exists and is not a directory", _PATH_HINT)
    try:
        directory.mkdir(parents=True, mode=DIRECTORY_MODE)
        os.chmod(directory, DIRECTORY_MODE)  # mkdir's mode is masked by the umask
    except FileExistsError:
        return  # created concurrently
    except OSError as exc:
        raise _os_error(f"cannot create the engine socket directory {directory}", exc) from exc


async def _remove_stale(path: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _os_error(f"cannot inspect {path}", exc) from exc
    if not stat.S_ISSOCK(mode):
        raise ConfigError(
            f"{path} exists and is not a socket; kvwatch will not remove it", _PATH_HINT
        )
    if await _someone_listens(path):
        raise ConfigError(
            f"another process already listens on the engine socket {path}",
            "stop the other kvwatch agent first, or " + _PATH_HINT,
        )
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _os_error(f"cannot remove the stale engine socket {path}", exc) from exc
    _log.info("removed the stale engine socket %s", path)


async def _someone_listens(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(probe, path), PROBE_SECONDS)
    except asyncio.TimeoutError:
        return True  # a full backlog: a listener that is not accepting
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise _os_error(f"cannot probe the engine socket {path}", exc) from exc
    finally:
        probe.close()
    return True


def _os_error(what: str, exc: OSError) -> ConfigError | PrivilegeError:
    reason = exc.strerror or str(exc)
    if isinstance(exc, PermissionError):
        return PrivilegeError(
            f"{what}: {reason}",
            "run the agent as root (it owns /run/kvwatch), or " + _PATH_HINT + " in a directory "
            "the agent may write",
        )
    return ConfigError(f"{what}: {reason}", _PATH_HINT)

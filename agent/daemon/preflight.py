"""What `kvwatch run` checks before anything starts: settings that parse fine but that this
node cannot honour (a busy or foreign listen address, a socket map the kernel would refuse or
cannot fit in memory, an audit "file" that is a device, a procfs path that is no procfs), each
refused with one message naming the setting; and the descriptor limit, raised to what the
process may use.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource
import socket
import stat
from pathlib import Path

from kvwatch.collect.bpf.layout import KvSockRecord
from kvwatch.config.schema import AgentConfig, split_listen
from kvwatch.errors import ConfigError, PrivilegeError, quoted, quoted_path

# The kernel's BPF hash map: elements are preallocated for an LRU hash, each with a header
# (struct htab_elem, 48 bytes on 64-bit) and its 8-byte key, plus one 16-byte bucket per
# slot of a power-of-two table (docs/configuration.md, "collector.max_sockets").
MAP_ELEMENT_HEADER_BYTES = 48
MAP_KEY_BYTES = 8
MAP_BUCKET_BYTES = 16
# The socket map may take at most this share of the memory the agent can get.
MAP_MEMORY_SHARE = 0.5
UNLIMITED_DESCRIPTORS = 1 << 20  # what a soft limit goes up to when the hard one is infinite
# A file only a procfs has: /proc/self/stat (this process's status line).
PROCFS_MARK = ("self", "stat")
_MIB = 1 << 20

log = logging.getLogger("kvwatch")


def check_before_start(config: AgentConfig) -> socket.socket:
    """Runs every check; returns the HTTP API's socket, bound (so the address stays ours)."""
    check_audit_path(config.audit.path)
    if config.collector.backend != "diag":
        check_socket_map_fits(config.collector.max_sockets, config.path.procfs)
    check_procfs(config.path.procfs)
    return bind_listen_address(config.http.listen)


def procfs_problem(procfs: str) -> str | None:
    """Why `procfs` is not a mounted procfs ("does not exist", ...), or None when it is."""
    root = Path(procfs)
    try:
        if not root.is_dir():
            return "does not exist" if not root.exists() else "is not a directory"
        if not root.joinpath(*PROCFS_MARK).is_file():
            return f"is not a procfs (it has no {'/'.join(PROCFS_MARK)})"
    except (OSError, ValueError) as exc:  # not searchable; a NUL in the path
        return f"cannot be read ({quoted(str(exc))})"
    return None


def check_procfs(procfs: str) -> None:
    """ConfigError unless `path.procfs` is a procfs: without one no socket has a known owner,
    so the policy could never act (every stall `owner_unknown`), and no network namespace of
    another process could be reached."""
    problem = procfs_problem(procfs)
    if problem is not None:
        raise ConfigError(
            f"path.procfs {quoted_path(procfs)} {problem}: the agent finds each socket's owner "
            "there, and acts on no socket without one",
            "set path.procfs (--path.procfs) to where the host's /proc is mounted",
        )


def raise_descriptor_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit, logs it, returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_DESCRIPTORS if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning("descriptor limit stays %d: cannot raise it to %d: %s", soft, target, exc)
            return soft
        log.info("descriptor limit raised from %d to %d (the hard limit)", soft, target)
        return target
    log.info("descriptor limit %d", soft)
    return soft


def socket_map_bytes(max_sockets: int) -> int:
    """Kernel memory of a socket map with `max_sockets` entries (an estimate, within ~10%)."""
    value_bytes = -(-ctypes.sizeof(KvSockRecord) // 8) * 8
    buckets = 1 << max(0, (max_sockets - 1).bit_length())
    element = MAP_ELEMENT_HEADER_BYTES + MAP_KEY_BYTES + value_bytes
    return max_sockets * element + buckets * MAP_BUCKET_BYTES


def check_socket_map_fits(max_sockets: int, procfs: str) -> None:
    """ConfigError when the socket map would take more than MAP_MEMORY_SHARE of the memory
    this agent can get (the node's MemAvailable, and its cgroup's memory.max if lower)."""
    budget = _memory_budget(procfs)
    if budget is None:
        return
    needed = socket_map_bytes(max_sockets)
    room = budget * MAP_MEMORY_SHARE
    if needed <= room:
        return
    fits, too_many = 0, max_sockets  # the largest size that fits, by bisection
    while too_many - fits > 1:
        middle = (fits + too_many) // 2
        fits, too_many = (middle, too_many) if socket_map_bytes(middle) <= room else (fits, middle)
    raise ConfigError(
        f"collector.max_sockets = {max_sockets} needs about {needed // _MIB} MiB of kernel "
        f"memory for the socket map; the agent may use {budget // _MIB} MiB and the map may "
        f"take at most {MAP_MEMORY_SHARE:.0%} of it",
        f"lower collector.max_sockets (--max-sockets) to {fits} or less, or give the agent "
        "more memory",
    )


def _memory_budget(procfs: str) -> int | None:
    """Bytes the agent can get: MemAvailable, lowered to what its cgroup v2 still allows."""
    try:
        meminfo = Path(procfs, "meminfo").read_text()
    except OSError:
        return None
    available = next(
        (
            int(line.split()[1]) * 1024
            for line in meminfo.splitlines()
            if line.startswith("MemAvailable:")
        ),
        None,
    )
    cgroup_room = _cgroup_room()
    if available is None or cgroup_room is None:
        return available if available is not None else cgroup_room
    return min(available, cgroup_room)


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup v2, or None if unlimited/unknown."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        directory = Path("/sys/fs/cgroup", line.partition("::")[2].lstrip("/"))
        limit = (directory / "memory.max").read_text().strip()
        current = int((directory / "memory.current").read_text())
    except (OSError, IndexError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - current)


def check_audit_path(path: str) -> None:
    """The audit log must be a regular file the agent may write, or absent (then its nearest
    existing directory must be writable); "" (stdout only) is always fine."""
    if not path:
        return
    fix = 'set audit.path (--audit-log) to a regular file, or to "" to log to stdout only'
    shown = quoted_path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        _check_creatable(path, fix)
        return
    except OSError as exc:
        raise ConfigError(f"audit.path {shown}: {exc.strerror}", fix) from exc
    if not stat.S_ISREG(mode):
        raise ConfigError(f"audit.path {shown} is not a regular file", fix)
    if not os.access(path, os.W_OK):
        raise PrivilegeError(f"audit.path {shown} is not writable by the agent", fix)


def _check_creatable(path: str, fix: str) -> None:
    shown = quoted_path(path)
    directory = Path(path).absolute().parent
    while not directory.exists():
        directory = directory.parent
    if not directory.is_dir():
        raise ConfigError(f"audit.path {shown}: {quoted_path(directory)} is not a directory", fix)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PrivilegeError(
            f"audit.path {shown} cannot be created: {quoted_path(directory)} is not writable "
            "by the agent",
            fix,
        )


def bind_listen_address(listen: str) -> socket.socket:
    """A socket bound to `http.listen`; ConfigError (busy, not this host's) or PrivilegeError."""
    host, port = split_listen(listen)
    shown = quoted(listen)
    fix = 'set http.listen (--listen) to a free address of this node, e.g. "127.0.0.1:9431"'
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as exc:  # UnicodeError: a name IDNA cannot encode
        reason = exc.strerror if isinstance(exc, socket.gaierror) else "not a valid host name"
        raise ConfigError(
            f"http.listen {shown}: {quoted(host)} is not an address: {reason}", fix
        ) from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EACCES:
            raise PrivilegeError(
                f"http.listen {shown}: port {port} needs CAP_NET_BIND_SERVICE",
                "pick a port above 1023 for http.listen (--listen), or run the agent as root",
            ) from exc
        reason = {
            errno.EADDRINUSE: "another process already listens there",
            errno.EADDRNOTAVAIL: f"{quoted(host)} is not an address of this node",
        }.get(exc.errno or 0, exc.strerror or str(exc))
        raise ConfigError(f"http.listen {shown}: {reason}", fix) from exc
    return sock

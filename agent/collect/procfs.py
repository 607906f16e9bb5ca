"""Process facts from procfs: socket owners, comm, cgroup, container and pod identity.

Host paths come from a `procfs_root` option (default "/proc") so a DaemonSet can read the host's
/proc mounted elsewhere. Parsers take text, never paths, and are tested on fixture strings; the
readers around them only open files and tolerate processes that vanish or deny access.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Collection
from dataclasses import dataclass

_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")
# One cgroup path component naming a container: a bare 64-hex id (cgroupfs drivers) or a systemd
# scope of docker, containerd (cri-containerd), cri-o or podman (libpod).
_CONTAINER_COMPONENT = re.compile(
    r"(?:(?:docker|cri-containerd|crio|libpod)-)?([0-9a-f]{64})(?:\.scope)?"
)
# A pod UID in a kubepods path: `pod<uid>` (cgroupfs, dashes) or `kubepods-<qos>-pod<uid>.slice`
# (systemd, dashes escaped as underscores); static pods use 32 hex digits without dashes.
_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32})"
    r"(?:\.slice)?$"
)


@dataclass(frozen=True)
class ProcessInfo:
    """What kvwatch knows about one process; empty strings mean "not in a container/pod"."""

    pid: int
    comm: str
    cgroup_path: str
    container_id: str
    pod_uid: str


def parse_comm(text: str) -> str:
    """The command name from the text of /proc/<pid>/comm."""
    return text.rstrip("\n")


def parse_socket_link(link: str) -> int | None:
    """The socket inode from an fd's readlink text ("socket:[N]"), None for anything else."""
    match = _SOCKET_LINK.fullmatch(link)
    return int(match.group(1)) if match else None


def parse_cgroup(text: str) -> str:
    """The most telling cgroup path from the text of /proc/<pid>/cgroup (v1 and v2 lines).

    Lines are `hierarchy-id:controllers:path`; the v2 line is `0::path`. The choice, in order:
    the first path naming a container (v2 line first, then v1 lines in file order), else the
    first path other than "/" (v2 first), else "/".
    """
    v2_paths: list[str] = []
    v1_paths: list[str] = []
    for line in text.splitlines():
        hierarchy, sep, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep and sep2 and path):
            continue
        (v2_paths if hierarchy == "0" and not controllers else v1_paths).append(path)
    candidates = v2_paths + v1_paths
    for path in candidates:
        if parse_container_id(path):
            return path
    return next((path for path in candidates if path != "/"), "/")


def parse_container_id(cgroup_path: str) -> str:
    """The container ID (64 hex digits) in a cgroup path, the deepest one; "" when none."""
    for component in reversed(cgroup_path.split("/")):
        match = _CONTAINER_COMPONENT.fullmatch(component)
        if match:
            return match.group(1)
    return ""


def parse_pod_uid(cgroup_path: str) -> str:
    """The Kubernetes pod UID in a kubepods cgroup path, with dashes; "" when none."""
    if "kubepods" not in cgroup_path:
        return ""
    for component in reversed(cgroup_path.split("/")):
        match = _POD_UID.search(component)
        if match:
            return match.group(1).replace("_", "-")
    return ""


class Procfs:
    """Reads process facts under one procfs root; holds no state besides the root.

    Every read returns None when the process vanished or access was denied: processes come and
    go between listing and reading, and that is not an error.
    """

    def __init__(self, root: str = "/proc") -> None:
        self.root = root

    def _read(self, pid: int, name: str) -> str | None:
        try:
            with open(os.path.join(self.root, str(pid), name), encoding="utf-8") as file:
                return file.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            return None

    def comm(self, pid: int) -> str | None:
        text = self._read(pid, "comm")
        return parse_comm(text) if text is not None else None

    def process(self, pid: int) -> ProcessInfo | None:
        comm = self.comm(pid)
        cgroup_text = self._read(pid, "cgroup")
        if comm is None or cgroup_text is None:
            return None
        path = parse_cgroup(cgroup_text)
        return ProcessInfo(pid, comm, path, parse_container_id(path), parse_pod_uid(path))

    def pids(self) -> list[int]:
        try:
            return [int(entry.name) for entry in os.scandir(self.root) if entry.name.isdigit()]
        except FileNotFoundError:
            return []

    def network_namespaces(self) -> dict[int, str]:
        """Each network namespace some process lives in: its inode -> a path to enter it by
        (the /proc/PID/ns/net of one of its processes)."""
        found: dict[int, str] = {}
        for pid in self.pids():
            path = os.path.join(self.root, str(pid), "ns", "net")
            try:
                found.setdefault(os.stat(path).st_ino, path)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        return found

    def socket_inodes(self, pid: int) -> list[int]:
        """Inodes of the sockets among the open fds of `pid` (empty if it vanished or denies)."""
        fd_dir = os.path.join(self.root, str(pid), "fd")
        inodes: list[int] = []
        try:
            entries = list(os.scandir(fd_dir))
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            return inodes
        for entry in entries:
            try:
                inode = parse_socket_link(os.readlink(entry.path))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            if inode is not None:
                inodes.append(inode)
        return inodes

    def socket_fd(self, pid: int, inode: int) -> int | None:
        """The fd number under which `pid` holds the socket with this inode, or None."""
        fd_dir = os.path.join(self.root, str(pid), "fd")
        try:
            entries = list(os.scandir(fd_dir))
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            return None
        for entry in entries:
            try:
                if parse_socket_link(os.readlink(entry.path)) == inode:
                    return int(entry.name)
            except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
                continue
        return None

    def scan_socket_owners(self) -> dict[int, int]:
        """Socket inode -> pid for every process readable under the root (one full scan).

        A socket shared by several processes (fork, fd passing) maps to the lowest pid.
        """
        owners: dict[int, int] = {}
        for pid in sorted(self.pids(), reverse=True):
            for inode in self.socket_inodes(pid):
                owners[inode] = pid
        return owners


class SocketOwners:
    """A cache of socket inode -> owning pid, refreshed only when asked about unknown inodes.

    Invariants bounding the cost on a busy node: at most one full procfs scan per
    `rescan_interval_seconds`, however many unknown inodes are asked about; and an inode that
    `MAX_MISSES` scans did not find (its owner lives in a pid namespace this procfs does not
    show, or closed the fd) stops triggering scans. Each scan replaces the whole map, which
    drops stale entries. Owned by one caller thread; not thread-safe.
    """

    MAX_MISSES = 2

    def __init__(self, procfs: Procfs | None = None, rescan_interval_seconds: float = 2.0) -> None:
        self.procfs = procfs if procfs is not None else Procfs()
        self.rescan_interval_ns = int(rescan_interval_seconds * 1e9)
        self.scans = 0
        self._owners: dict[int, int] = {}
        self._misses: dict[int, int] = {}
        self._last_scan_ns: int | None = None

    def resolve(self, inodes: Collection[int]) -> dict[int, int]:
        """The owning pid of each of `inodes` that has one (inode 0 never does)."""
        wanted = [inode for inode in inodes if inode != 0]
        unknown = [inode for inode in wanted if inode not in self._owners]
        worth_a_scan = any(self._misses.get(inode, 0) < self.MAX_MISSES for inode in unknown)
        if worth_a_scan and self._may_rescan():
            self._owners = self.procfs.scan_socket_owners()
            self._last_scan_ns = time.monotonic_ns()
            self.scans += 1
            self._misses = {
                inode: self._misses.get(inode, 0) + 1
                for inode in unknown
                if inode not in self._owners
            }
        return {inode: self._owners[inode] for inode in wanted if inode in self._owners}

    def forget(self, inode: int) -> None:
        """Drops what is known of `inode`: the next `resolve` of it looks in procfs again
        (within the scan budget), e.g. after its owner may have closed it."""
        self._owners.pop(inode, None)
        self._misses.pop(inode, None)

    def _may_rescan(self) -> bool:
        if self._last_scan_ns is None:
            return True
        return time.monotonic_ns() - self._last_scan_ns >= self.rescan_interval_ns

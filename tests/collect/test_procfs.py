"""kvwatch.collect.procfs: parsers on fixture texts, readers on a fixture tree and on the real
/proc."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvwatch.collect.procfs import (
    ProcessInfo,
    Procfs,
    SocketOwners,
    parse_cgroup,
    parse_comm,
    parse_container_id,
    parse_pod_uid,
    parse_socket_link,
)

CID = "3f4c2b1a" * 8
POD = "7a1e9f3c-52b4-4d5e-9b1a-2c3d4e5f6a7b"
POD_ESCAPED = POD.replace("-", "_")

CONTAINERD_V2 = (
    "0::/kubepods.slice/kubepods-burstable.slice/"
    f"kubepods-burstable-pod{POD_ESCAPED}.slice/cri-containerd-{CID}.scope\n"
)
CRIO_V2 = f"0::/kubepods.slice/kubepods-pod{POD_ESCAPED}.slice/crio-{CID}.scope\n"
DOCKER_SYSTEMD_V2 = f"0::/system.slice/docker-{CID}.scope\n"
CGROUPFS_V1 = (
    "12:pids:/\n"
    f"11:memory:/kubepods/besteffort/pod{POD}/{CID}\n"
    f"1:name=systemd:/kubepods/besteffort/pod{POD}/{CID}\n"
    "0::/\n"
)
DOCKER_V1 = f"4:cpu,cpuacct:/docker/{CID}\n3:memory:/docker/{CID}\n"
HOST_HYBRID = "9:name=systemd:/\n4:memory:/user.slice/user-0.slice\n0::/user.slice/user-0.slice\n"


@pytest.mark.parametrize(
    ("text", "path", "container_id", "pod_uid"),
    [
        (CONTAINERD_V2, CONTAINERD_V2[3:-1], CID, POD),
        (CRIO_V2, CRIO_V2[3:-1], CID, POD),
        (DOCKER_SYSTEMD_V2, f"/system.slice/docker-{CID}.scope", CID, ""),
        (CGROUPFS_V1, f"/kubepods/besteffort/pod{POD}/{CID}", CID, POD),
        (DOCKER_V1, f"/docker/{CID}", CID, ""),
        (HOST_HYBRID, "/user.slice/user-0.slice", "", ""),
        ("0::/\n", "/", "", ""),
        ("garbage\n\n0::/init.scope\n", "/init.scope", "", ""),
    ],
    ids=[
        "containerd",
        "crio",
        "docker-systemd",
        "cgroupfs-v1",
        "docker-v1",
        "host",
        "root",
        "junk",
    ],
)
def test_cgroup_identity(text: str, path: str, container_id: str, pod_uid: str) -> None:
    parsed = parse_cgroup(text)
    assert parsed == path
    assert parse_container_id(parsed) == container_id
    assert parse_pod_uid(parsed) == pod_uid


def test_container_id_edge_cases() -> None:
    assert parse_container_id(f"/kubepods.slice/crio-conmon-{CID}.scope") == ""  # the monitor
    assert parse_container_id(f"/machine.slice/libpod-{CID}.scope") == CID
    assert parse_container_id(f"/docker/{CID[:-1]}") == ""  # 63 hex digits
    assert parse_container_id("/system.slice/sshd.service") == ""


def test_pod_uid_forms() -> None:
    static_pod = "5d5a1a0bbb2e4b5ca2e9a1b8ff9e7f2c"
    assert parse_pod_uid(f"/kubepods.slice/kubepods-pod{static_pod}.slice") == static_pod
    assert parse_pod_uid(f"/kubepods/pod{POD}") == POD
    assert parse_pod_uid(f"/system.slice/pod{POD}") == ""  # not a kubepods path


def test_small_parsers() -> None:
    assert parse_comm("python3\n") == "python3"
    assert parse_comm("my (odd) name\n") == "my (odd) name"
    assert parse_socket_link("socket:[12345]") == 12345
    assert parse_socket_link("pipe:[12345]") is None
    assert parse_socket_link("/dev/null") is None


def _fake_process(root: Path, pid: int, comm: str, cgroup: str, links: dict[int, str]) -> None:
    (root / str(pid) / "fd").mkdir(parents=True)
    (root / str(pid) / "comm").write_text(comm + "\n")
    (root / str(pid) / "cgroup").write_text(cgroup)
    for fd, target in links.items():
        os.symlink(target, root / str(pid) / "fd" / str(fd))


def test_procfs_root_option(tmp_path: Path) -> None:
    _fake_process(tmp_path, 300, "uvicorn", CONTAINERD_V2, {3: "socket:[555]", 4: "/dev/null"})
    _fake_process(tmp_path, 200, "worker", "0::/\n", {5: "socket:[555]", 6: "socket:[777]"})
    (tmp_path / "400").mkdir()  # a process that vanished between listing and reading
    (tmp_path / "self").mkdir()  # not a pid
    procfs = Procfs(str(tmp_path))
    assert procfs.scan_socket_owners() == {555: 200, 777: 200}  # shared: the lowest pid
    assert procfs.process(300) == ProcessInfo(300, "uvicorn", CONTAINERD_V2[3:-1], CID, POD)
    assert procfs.process(400) is None
    assert procfs.comm(999) is None
    assert Procfs(str(tmp_path / "absent")).scan_socket_owners() == {}


def test_owners_of_this_process_sockets() -> None:
    with socket.socket() as sock:
        inode = os.fstat(sock.fileno()).st_ino
        owners = SocketOwners()
        assert owners.resolve([inode, 0]) == {inode: os.getpid()}
        info = owners.procfs.process(os.getpid())
        assert info is not None and info.pid == os.getpid() and info.comm


def test_unknown_inodes_rescan_at_most_once_per_interval() -> None:
    unknown_inode = 1 << 40  # beyond the 32-bit range of sockfs inode numbers
    owners = SocketOwners(rescan_interval_seconds=60)
    assert owners.resolve([unknown_inode]) == {}
    assert owners.resolve([unknown_inode]) == {}
    assert owners.scans == 1


def test_inodes_nobody_owns_stop_costing_scans() -> None:
    unknown_inode = 1 << 40
    eager = SocketOwners(rescan_interval_seconds=0)
    for _ in range(5):
        assert eager.resolve([unknown_inode, 0]) == {}
    assert eager.scans == SocketOwners.MAX_MISSES
    with socket.socket() as sock:  # a socket born after those scans: found at the next one
        inode = os.fstat(sock.fileno()).st_ino
        assert eager.resolve([inode, unknown_inode]) == {inode: os.getpid()}
        assert eager.scans == SocketOwners.MAX_MISSES + 1
        assert eager.resolve([inode, unknown_inode]) == {inode: os.getpid()}
        assert eager.scans == SocketOwners.MAX_MISSES + 1  # known and given-up inodes cost nothing

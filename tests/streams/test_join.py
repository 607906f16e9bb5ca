"""The join (kvwatch.streams.join.Joiner.view) on hand-made samples and engine streams, with a
procfs fixture tree (an engine in a Kubernetes pod, a proxy on the host) and the fake NVML: a
socket no engine announced has no request; an announced one carries its request id and KV;
the process, container and pod are the engine's, the GPU memory is the engine's; a proxy's
client socket also names the relaying process; process identity is cached until forgotten;
and `to_json()` holds every key of the `kvwatch streams --json` contract (docs/contracts.md)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvwatch.collect.gpu import GpuInventory, GpuProcessUse
from kvwatch.collect.procfs import ProcessInfo, Procfs
from kvwatch.hookserver.registry import EngineStream
from kvwatch.sockets import Endpoint, Feeder, SocketSample
from kvwatch.streams.join import Joiner
from kvwatch.streams.relay import RelayLink
from kvwatch.streams.states import StallThresholds, StreamState, judge
from tests.collect.conftest import GIB, FakeGpu, FakeNvml

S = 1_000_000_000
POLICY = StallThresholds(stall_seconds=3.0, min_reader_bytes_per_second=4096)
NOW = 1_000 * S
ENGINE_PID, PROXY_PID = 4242, 4343
CID = "3f4c2b1a" * 8
POD = "7a1e9f3c-52b4-4d5e-9b1a-2c3d4e5f6a7b"
POD_CGROUP = (
    "/kubepods.slice/kubepods-burstable.slice/"
    f"kubepods-burstable-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope"
)
GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
ENGINE_SIDE = Endpoint("10.0.0.1", 8000)
CLIENT = Endpoint("10.0.0.2", 50000)
# `kvwatch sockets --json` and what `kvwatch streams --json` adds (docs/contracts.md).
SOCKET_KEYS = {
    "local", "remote", "pid", "comm", "state", "wmem_queued", "sndbuf", "notsent_bytes",
    "unacked_bytes", "peer_rwnd", "srtt_us", "retransmits", "zero_window",
    "zero_window_episodes", "zero_window_seconds", "sndbuf_full", "no_progress_seconds", "source",
}  # fmt: skip
JOIN_KEYS = {"request_id", "engine", "engine_pid", "kv_blocks", "kv_bytes", "gpu"}


def fake_process(root: Path, pid: int, comm: str, cgroup: str) -> None:
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    (root / str(pid) / "comm").write_text(comm + "\n")
    (root / str(pid) / "cgroup").write_text(cgroup)


@pytest.fixture
def procfs(tmp_path: Path) -> Procfs:
    """An engine in a pod's container and a proxy on the host."""
    fake_process(tmp_path, ENGINE_PID, "python3", f"0::{POD_CGROUP}\n")
    fake_process(tmp_path, PROXY_PID, "nginx", "0::/system.slice/nginx.service\n")
    return Procfs(str(tmp_path))


def gpus(init_error: str = "") -> GpuInventory:
    """An H100 where the engine holds 1 GiB, an A100 where it holds an unknown amount."""
    return GpuInventory(
        FakeNvml(
            [
                FakeGpu(GPU_A, "NVIDIA H100 80GB HBM3", 80 * GIB, 30 * GIB, [(ENGINE_PID, GIB)]),
                FakeGpu(GPU_B, "NVIDIA A100-SXM4-40GB", 40 * GIB, 5 * GIB, [(ENGINE_PID, None)]),
            ],
            init_error,
        )
    )


def stalled(pid: int = ENGINE_PID, **changes: object) -> SocketSample:
    """The engine's server socket, its peer silent behind a zero window for 30 s."""
    since = NOW - 30 * S
    base = SocketSample(
        key=7, source="bpf", observed_ns=NOW, local=ENGINE_SIDE, remote=CLIENT, netns=1,
        inode=99, pid=pid, comm="python3", tcp_state=1, wmem_queued=9000, sndbuf=9000,
        notsent_bytes=4096, unacked_bytes=0, peer_rwnd=0, srtt_us=100, snd_cwnd=10,
        retransmits=0, zero_window_probes=6, zero_window_episodes=1,
        zero_window_since_ns=since, zero_window_total_ns=30 * S, last_zero_window_end_ns=0,
        sndbuf_full_episodes=1, sndbuf_full_since_ns=since, progress_ns=since,
        first_seen_ns=NOW - 40 * S, bytes_acked=1 << 20, peer_rwnd_max=32768, rto_us=200_000,
        last_ack_ns=since,
    )  # fmt: skip
    return base.with_changes(**changes)


def announced(kv_estimated: bool = False) -> EngineStream:
    return EngineStream(
        request_id="cmpl-42", engine_pid=ENGINE_PID, announced_pid=1, engine="kvwatch-reference",
        model="tiny", device="cuda:0", local=ENGINE_SIDE, remote=CLIENT, kv_blocks=12,
        bytes_per_block=16384, tokens_out=300, opened_ns=NOW - 20 * S, kv_estimated=kv_estimated,
    )  # fmt: skip


def test_a_socket_no_engine_announced_has_no_request_but_its_owner_is_known(
    procfs: Procfs,
) -> None:
    view = Joiner(procfs, gpus()).view(stalled(), None, NOW, POLICY)
    assert view.engine is None and view.kv_bytes is None
    assert view.process == ProcessInfo(ENGINE_PID, "python3", POD_CGROUP, CID, POD)
    row = view.to_json()
    assert {key: row[key] for key in ("request_id", "engine", "engine_pid", "kv_blocks")} == {
        "request_id": None,
        "engine": None,
        "engine_pid": None,
        "kv_blocks": None,
    }
    assert row["kv_bytes"] is None and row["kv_estimated"] is None
    assert (row["pid"], row["pod_uid"], row["container_id"]) == (ENGINE_PID, POD, CID)
    assert row["age_seconds"] == 40.0  # from the socket's first sight


def test_an_announced_stream_carries_its_request_and_kv(procfs: Procfs) -> None:
    view = Joiner(procfs, gpus()).view(stalled(), announced(), NOW, POLICY)
    row = view.to_json()
    assert row["request_id"] == "cmpl-42"
    assert (row["engine"], row["engine_pid"]) == ("kvwatch-reference", ENGINE_PID)
    assert (row["kv_blocks"], row["kv_bytes"]) == (12, 12 * 16384)
    assert row["kv_estimated"] is False
    assert row["age_seconds"] == 20.0  # from the engine's announcement


def test_an_estimated_kv_size_is_marked_as_one(procfs: Procfs) -> None:
    view = Joiner(procfs, gpus()).view(stalled(), announced(kv_estimated=True), NOW, POLICY)
    assert view.to_json()["kv_estimated"] is True


def test_the_process_and_gpu_memory_are_the_announcing_engines(procfs: Procfs) -> None:
    """An engine may announce a stream for the worker process that owns the socket: the pod
    and the GPU memory are the engine's; the socket's own owner stays in `pid`."""
    view = Joiner(procfs, gpus()).view(stalled(pid=PROXY_PID), announced(), NOW, POLICY)
    assert view.owner_pid == ENGINE_PID
    assert view.process is not None and view.process.pid == ENGINE_PID
    assert view.gpus == (
        GpuProcessUse(0, GPU_A, GIB),
        GpuProcessUse(1, GPU_B, None),
    )
    row = view.to_json()
    assert row["pid"] == PROXY_PID and row["pod_uid"] == POD
    assert row["gpu"] == [
        {"index": 0, "uuid": GPU_A, "used_bytes": GIB},
        {"index": 1, "uuid": GPU_B, "used_bytes": None},
    ]


def test_a_proxys_client_socket_names_the_engine_and_the_relay(procfs: Procfs) -> None:
    upstream = Feeder(Endpoint("127.0.0.1", 41000), ENGINE_SIDE, feeds=5, misses=0, fed_ns=NOW)
    client_socket = stalled(pid=PROXY_PID, local=Endpoint("10.0.0.1", 443), comm="nginx")
    link = RelayLink(PROXY_PID, "nginx", upstream, CLIENT, "joined", "")
    view = Joiner(procfs, gpus()).view(client_socket, announced(), NOW, POLICY, relay=link)
    assert view.process is not None and view.process.pod_uid == POD
    assert view.relay_process is not None and view.relay_process.comm == "nginx"
    assert (view.owner_pid, view.socket_pid) == (ENGINE_PID, PROXY_PID)
    relay = view.to_json()["relay"]
    assert relay["status"] == "joined" and relay["pid"] == PROXY_PID
    assert relay["chain"] == "10.0.0.2:50000 ⇄ nginx[4343] ⇄ engine request cmpl-42"


def test_a_socket_without_an_owner_has_no_process_and_no_gpu(procfs: Procfs) -> None:
    view = Joiner(procfs, gpus()).view(stalled(pid=0, comm=""), None, NOW, POLICY)
    assert view.process is None and view.gpus == ()
    row = view.to_json()
    assert (row["cgroup"], row["pod_uid"], row["gpu"]) == (None, None, None)


def test_without_nvml_the_gpu_is_unknown_and_the_rest_is_joined(procfs: Procfs) -> None:
    inventory = gpus(init_error="Driver Not Loaded")
    assert not inventory.available
    view = Joiner(procfs, inventory).view(stalled(), announced(), NOW, POLICY)
    row = view.to_json()
    assert row["gpu"] is None
    assert (row["request_id"], row["pod_uid"]) == ("cmpl-42", POD)


def test_a_process_of_this_machine_is_joined_from_the_real_proc() -> None:
    pid = os.getpid()
    view = Joiner(Procfs(), gpus()).view(stalled(pid=pid), None, time.monotonic_ns(), POLICY)
    assert view.process is not None and view.process.pid == pid
    assert view.process.comm == Procfs().comm(pid)
    assert view.gpus == ()  # this process runs nothing on the fake GPUs


def test_process_identity_is_cached_until_the_daemon_forgets_it(
    procfs: Procfs, tmp_path: Path
) -> None:
    joiner = Joiner(procfs, gpus())
    assert joiner.view(stalled(), None, NOW, POLICY).to_json()["cgroup"] == POD_CGROUP
    fake_process(tmp_path, ENGINE_PID, "vllm", "0::/system.slice/vllm.service\n")  # pid reused
    cached = joiner.view(stalled(), None, NOW, POLICY)
    assert cached.process is not None and cached.process.comm == "python3"
    joiner.forget_processes()
    fresh = joiner.view(stalled(), None, NOW, POLICY)
    assert fresh.process is not None and fresh.process.comm == "vllm"
    assert fresh.to_json()["pod_uid"] is None


def test_the_view_takes_the_callers_verdict_or_judges_the_socket_itself(procfs: Procfs) -> None:
    joiner = Joiner(procfs, gpus())
    judged = joiner.view(stalled(), None, NOW, POLICY)
    assert judged.judgement == judge(stalled(), NOW, POLICY)
    assert judged.state is StreamState.STALLED
    early = judge(stalled(), NOW - 29 * S, POLICY)  # a verdict from 1 s into the stall
    given = joiner.view(stalled(), None, NOW, POLICY, early)
    assert given.judgement is early and given.state is StreamState.ZERO_WINDOW


def test_the_json_holds_the_streams_contract_and_is_json(procfs: Procfs) -> None:
    for engine in (None, announced()):
        row = Joiner(procfs, gpus()).view(stalled(), engine, NOW, POLICY).to_json()
        assert row.keys() >= SOCKET_KEYS | JOIN_KEYS
        assert json.loads(json.dumps(row)) == row
        assert row["state"] == "stalled" and row["source"] == "bpf"
        assert (row["local"], row["remote"]) == ("10.0.0.1:8000", "10.0.0.2:50000")
        assert row["zero_window"] is True and row["zero_window_seconds"] == 30.0

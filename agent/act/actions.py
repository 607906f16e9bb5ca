"""What the agent does to a stalled stream: cancel it through the engine hook (the engine
frees its KV blocks, two-phase) and/or reset its TCP connection with SOCK_DESTROY (for
engines without the hook: vLLM, TGI and Triton abort a request whose connection dies)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvwatch.act.confirm import KernelCheck, check
from kvwatch.collect.diag.destroy import DestroyResult, destroy_socket
from kvwatch.collect.diag.kernel_view import CheckedViews
from kvwatch.collect.diag.snapshot import DiagClient
from kvwatch.collect.diag.wire import DiagEntry
from kvwatch.collect.netns import socket_namespace
from kvwatch.errors import KvwatchError
from kvwatch.hookserver.registry import EngineStream
from kvwatch.hookserver.server import HookServer
from kvwatch.sockets import SocketSample
from kvwatch.streams.view import StreamView

CANCEL_TIMEOUT_SECONDS = 2.0
# After a reset, how long the agent waits for the engine to close the request the connection
# carried (a client disconnect: the engine aborts it and frees its KV), and how often it looks.
RESET_FOLLOW_SECONDS = 5.0
RESET_FOLLOW_POLL_SECONDS = 0.02


@dataclass
class ActionTally:
    """Counts of actions by (action, reason, result) and the KV bytes reclaimed."""

    outcomes: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    reclaimed_kv_bytes: int = 0
    reclaimed_kv_blocks: int = 0


def reset_in_namespace(sample: SocketSample, pid: int, procfs_root: str) -> str:
    """Finds the socket's cookie and destroys it, inside its network namespace (see
    `socket_namespace`; `pid` owns it). Blocking: runs on the worker thread (netlink sockets
    are per namespace, setns per thread)."""
    local, remote = sample.local, sample.remote
    with socket_namespace(sample.netns, pid, procfs_root), DiagClient() as client:
        entry = client.find(local, remote)
        if entry is None:
            return "not_found"
        result = destroy_socket(local, remote, entry.cookie)
        return "reset" if result is DestroyResult.DESTROYED else "not_found"


def look_up_in_namespace(
    sample: SocketSample, pid: int, procfs_root: str
) -> tuple[DiagEntry | None, int]:
    """The kernel's view of one socket, in its network namespace, and when it was taken
    (CLOCK_MONOTONIC ns). Blocking: runs on the worker thread."""
    with socket_namespace(sample.netns, pid, procfs_root), DiagClient() as client:
        observed_ns = time.monotonic_ns()
        return client.find(sample.local, sample.remote), observed_ns


class Actions:
    """Carries out decisions. Owns one worker thread for netlink work in other namespaces
    (lookups, resets); used from the event loop."""

    def __init__(self, hooks: HookServer, procfs_root: str) -> None:
        self.hooks = hooks
        self.procfs_root = procfs_root
        self.tally = ActionTally()
        self.checked = CheckedViews()
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvwatch-reset")

    async def confirm(self, view: StreamView) -> KernelCheck:
        """Whether the kernel's own view of the socket, now, still makes it stalled
        (kvwatch.act.confirm); a lookup that fails is no confirmation."""
        sample = view.sample
        loop = asyncio.get_running_loop()
        try:
            entry, observed_ns = await loop.run_in_executor(
                self._worker,
                look_up_in_namespace,
                sample,
                view.socket_pid,
                self.procfs_root,
            )
        except KvwatchError as exc:
            detail = f"the kernel's view of the socket could not be read: {exc}"
            return KernelCheck(False, "unconfirmed", detail, sample, view.judgement, None)
        now_ns = time.monotonic_ns()
        return check(sample, view.judgement, entry, observed_ns, now_ns, view.policy, self.checked)

    async def cancel(
        self, view: StreamView, reason: str, evidence: dict[str, Any]
    ) -> dict[str, Any]:
        assert view.engine is not None, "cancel needs an engine-announced stream"
        outcome = await self.hooks.cancel(
            view.engine.request_id, reason, evidence, timeout_seconds=CANCEL_TIMEOUT_SECONDS
        )
        self.tally.outcomes["cancel", reason, outcome.status] += 1
        if outcome.status == "cancelled":
            self.tally.reclaimed_kv_bytes += outcome.freed_bytes
            self.tally.reclaimed_kv_blocks += outcome.freed_blocks
        return {
            "status": outcome.status,
            "freed_blocks": outcome.freed_blocks,
            "freed_bytes": outcome.freed_bytes,
            "detail": outcome.detail,
        }

    async def reset(self, view: StreamView, reason: str, follow: bool) -> dict[str, Any]:
        """Resets the socket (a proxy's client socket, in the proxy's namespace, for a relayed
        stream). With `follow`, and a request known behind the socket, waits for the engine
        to close that request and reports its KV as freed: the engine aborts a request whose
        client is gone (directly, or through the proxy closing its upstream)."""
        sample = view.sample
        loop = asyncio.get_running_loop()
        try:
            status = await loop.run_in_executor(
                self._worker,
                reset_in_namespace,
                sample,
                view.socket_pid,
                self.procfs_root,
            )
            detail = ""
        except KvwatchError as exc:
            status, detail = "failed", str(exc)
        self.tally.outcomes["reset", reason, status] += 1
        result: dict[str, Any] = {"status": status, "detail": detail}
        if follow and status == "reset" and view.engine is not None:
            result.update(await self._follow(view.engine))
        return result

    async def _follow(self, engine: EngineStream) -> dict[str, Any]:
        """The engine's close of `engine`'s request after a reset, as freed KV (or not)."""
        deadline = time.monotonic() + RESET_FOLLOW_SECONDS
        while self.hooks.live(engine.request_id):
            if time.monotonic() > deadline:
                return {"request_closed": False, "freed_blocks": 0, "freed_bytes": 0}
            await asyncio.sleep(RESET_FOLLOW_POLL_SECONDS)
        self.tally.reclaimed_kv_bytes += engine.kv_bytes
        self.tally.reclaimed_kv_blocks += engine.kv_blocks
        return {
            "request_closed": True,
            "freed_blocks": engine.kv_blocks,
            "freed_bytes": engine.kv_bytes,
        }

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

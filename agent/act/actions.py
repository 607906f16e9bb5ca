"""The actions the agent can take on a stalled stream, by the name `policy.actions` gives
them, and the kernel check before any of them. Each action is a module of its own
(kvwatch.act.reset, and the hook commands' table in kvwatch.act.hook_actions): a new one is one
more entry here and a rule in kvwatch.policy that can choose it."""

from __future__ import annotations

import time
from typing import Any, Protocol

from kvwatch.act.confirm import KernelCheck, check
from kvwatch.act.hook_actions import COMMAND_TIMEOUT_SECONDS, hook_actions
from kvwatch.act.kernel import SocketWorker
from kvwatch.act.reset import Reset
from kvwatch.act.tally import ActionTally
from kvwatch.collect.diag.kernel_view import CheckedViews
from kvwatch.errors import KvwatchError
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.hookserver.registry import EngineStream
from kvwatch.streams.episodes import Unfinished
from kvwatch.streams.relay import Cancels
from kvwatch.streams.view import StreamView


class Action(Protocol):
    """One thing done to a stalled stream; its result's `status` says what happened."""

    @property
    def name(self) -> str: ...

    async def __call__(self, view: StreamView, attempt: Unfinished) -> dict[str, Any]: ...


class Actions:
    """The actions by name, what they did (`tally`), the requests cancelled (`cancels`, for
    the relay join) and the kernel check; used from the event loop."""

    def __init__(self, hooks: HookServer, procfs_root: str, lease_ms: int) -> None:
        self.hooks = hooks
        self.tally = ActionTally()
        self.cancels = Cancels()
        self.checked = CheckedViews()
        self.worker = SocketWorker(procfs_root)
        actions: list[Action] = [
            *hook_actions(hooks, self.tally, self.cancels, lease_ms),
            Reset(self.worker, hooks, self.tally),
        ]
        self.by_name = {action.name: action for action in actions}

    async def renew(self, engine: EngineStream, lease_ms: int) -> None:
        """Renews the engine's lease on a held request (a pause again): no decision, no
        outcome line; counted (`ActionTally.renewals`, or `renewals_failed`)."""
        outcome = await self.hooks.command(
            "pause",
            engine.request_id,
            "renew",
            {},
            COMMAND_TIMEOUT_SECONDS,
            lease_ms=lease_ms,
        )
        if outcome.status == "paused":
            self.tally.renewals += 1
        else:
            self.tally.renewals_failed += 1

    async def run(self, name: str, view: StreamView, attempt: Unfinished) -> dict[str, Any]:
        return await self.by_name[name](view, attempt)

    async def confirm(self, view: StreamView) -> KernelCheck:
        """Whether the kernel's own view of the socket, now, still makes it stalled
        (kvwatch.act.confirm); a lookup that fails is no confirmation."""
        sample = view.sample
        try:
            entry, observed_ns = await self.worker.look_up(sample, view.socket_pid)
        except KvwatchError as exc:
            detail = f"the kernel's view of the socket could not be read: {exc}"
            return KernelCheck(False, "unconfirmed", detail, sample, view.judgement, None)
        now_ns = time.monotonic_ns()
        return check(
            sample, view.judgement, entry, observed_ns, now_ns, view.thresholds, self.checked
        )

    def close(self) -> None:
        self.worker.close()

"""Carrying out a decision: the kernel's confirmation first (for a cut), then each action in
order, each ending in an outcome line; a cut that failed is tried again while its stall lasts.

The decision comes from the policy (kvwatch.policy.decide) and is not changed here except in
one way: a decision to cut whose stall the kernel's own view of the socket does not show
becomes a skip ("unconfirmed", "socket_gone") and gives its budget unit back
(kvwatch.act.confirm). A hold (pause, park, detach, release; kvwatch.policy.hold) cuts
nothing and loses no byte: it is carried out without the kernel's confirmation and without
the budget. The actions themselves: kvwatch.act.actions.
"""

from __future__ import annotations

import logging
from typing import Any

from kvwatch.act.actions import Actions
from kvwatch.act.record import Recorder
from kvwatch.hookwire.commands import COMMAND_KINDS
from kvwatch.policy.decide import Decider, retry_after
from kvwatch.policy.rules import Decision
from kvwatch.streams.episodes import Stall, Unfinished
from kvwatch.streams.join import Joiner
from kvwatch.streams.view import StreamView

log = logging.getLogger(__name__)

# Action results that changed something: each hook command's effect, and a reset; the others
# (the target was already gone, or the action failed) leave the decision's budget unit to be
# given back.
TOOK_EFFECT = {kind.effect for kind in COMMAND_KINDS.values()} | {"reset"}
# A cut action that failed (or raised) is tried again after each of these delays, within
# its stall and on the kernel's confirmation each time; the budget is charged once.
RETRY_DELAYS_SECONDS = (1.0, 2.0, 4.0)


class Executor:
    """Carries decisions out and records them; owned by the event loop."""

    def __init__(
        self, actions: Actions, recorder: Recorder, decider: Decider, joiner: Joiner
    ) -> None:
        self.actions = actions
        self.recorder = recorder
        self.decider = decider
        self.budget = decider.budget
        self.joiner = joiner

    async def on_stalled(self, stall: Stall, view: StreamView) -> float | None:
        """A stalled stream, in its stall: the actions still to try are tried again; else,
        once per stall, the policy decides and the decision is confirmed, recorded and
        carried out. Returns when to look at the stream again, or None."""
        if stall.unfinished is not None:
            return await self._try_again(stall, view)
        if stall.acted:
            return None
        return await self._handle(stall, view, self.decider.decide(view))

    async def hold(self, view: StreamView, unfinished: Unfinished) -> dict[str, Any]:
        """Carries out one hold action (unfinished.actions holds exactly one) once, with its
        outcome line; returns its result (`status` says what the engine did)."""
        unfinished.tries += 1
        results = await self._carry_out(view, unfinished)
        return results[0]

    async def _handle(self, stall: Stall, view: StreamView, decision: Decision) -> float | None:
        kernel: dict[str, Any] | None = None
        if decision.acts:
            view, decision, kernel = await self._confirmed(view, decision)
        ref, evidence = self.recorder.decision(view, decision, stall, kernel)
        if decision.acts:
            stall.acted = True
        if decision.verdict != "act":
            return retry_after(decision)
        unfinished = Unfinished(decision.reason, ref, evidence, decision.actions)
        return await self._attempt(stall, view, unfinished)

    async def _try_again(self, stall: Stall, view: StreamView) -> float | None:
        """The next try of the stall's failed actions, if the kernel still shows the stall;
        else they are given up, each with an outcome line that says why."""
        unfinished = stall.unfinished
        assert unfinished is not None, "nothing to try again"
        confirmed = await self.actions.confirm(view)
        if confirmed.agrees:
            return await self._attempt(stall, view, unfinished)
        stall.unfinished = None
        for action in unfinished.actions:
            result = {"status": "abandoned", "detail": confirmed.detail}
            self._outcome(view, unfinished, action, result)
        self._settle(unfinished)
        return None

    async def _confirmed(
        self, view: StreamView, decision: Decision
    ) -> tuple[StreamView, Decision, dict[str, Any] | None]:
        """The decision to act, held against the kernel's own view of the socket now: the
        view it rests on becomes that one; where the kernel does not show a stall, the
        decision becomes a skip and its budget unit is given back."""
        confirmed = await self.actions.confirm(view)
        view = self.joiner.view(
            confirmed.sample,
            view.engine,
            view.now_ns,
            view.thresholds,
            confirmed.judgement,
            view.relay,
        )
        if not confirmed.agrees:
            self.budget.give_back()
            decision = Decision("skip", (), confirmed.reason, confirmed.detail)
        return view, decision, confirmed.kernel

    async def _attempt(
        self, stall: Stall, view: StreamView, unfinished: Unfinished
    ) -> float | None:
        """Carries out the remaining actions once; returns when to try the failed ones again,
        or None when nothing is left to try."""
        unfinished.tries += 1
        results = await self._carry_out(view, unfinished)
        failed = tuple(
            action
            for action, result in zip(unfinished.actions, results, strict=True)
            if result["status"] == "failed"
        )
        stall.unfinished = None
        if not failed:
            self._settle(unfinished)
            return None
        unfinished.actions = failed
        if unfinished.tries <= len(RETRY_DELAYS_SECONDS):
            stall.unfinished = unfinished
            return RETRY_DELAYS_SECONDS[unfinished.tries - 1]
        stall.failed = {"actions": list(failed), "tries": unfinished.tries, **unfinished.ref}
        self._settle(unfinished)
        return None

    def _settle(self, unfinished: Unfinished) -> None:
        if not unfinished.took_effect:
            self.budget.give_back()

    async def _carry_out(self, view: StreamView, unfinished: Unfinished) -> list[dict[str, Any]]:
        """Tries each remaining action once and writes its outcome; returns their results in
        order (an action that raised failed, with the exception as its detail)."""
        results: list[dict[str, Any]] = []
        for action in unfinished.actions:
            try:
                result = await self._act(view, unfinished, action)
            except Exception as exc:  # an action must end in an outcome, whatever went wrong
                log.exception("%s of %s failed", action, unfinished.ref["remote"])
                result = {"status": "failed", "detail": f"{type(exc).__name__}: {exc}"}
            unfinished.took_effect = unfinished.took_effect or result["status"] in TOOK_EFFECT
            self._outcome(view, unfinished, action, result)
            results.append(result)
        return results

    async def _act(self, view: StreamView, unfinished: Unfinished, action: str) -> dict[str, Any]:
        result = await self.actions.run(action, view, unfinished)
        if "freed_bytes" in result:
            result["estimated"] = unfinished.evidence["kv_estimated"]
        return result

    def _outcome(
        self, view: StreamView, unfinished: Unfinished, action: str, result: dict[str, Any]
    ) -> None:
        self.recorder.outcome(view, unfinished.ref, action, {**result, "attempt": unfinished.tries})

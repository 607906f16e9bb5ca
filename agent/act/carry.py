"""Carrying out a decision: the kernel's confirmation first, then each action in order, each
ending in an outcome line; a failed one is tried again while its episode lasts.

The decision comes from the policy (kvwatch.policy.decide) and is not changed here except in
one way: a decision to act whose stall the kernel's own view of the socket does not show
becomes a skip ("unconfirmed", "socket_gone") and gives its budget unit back
(kvwatch.act.confirm). The actions themselves: kvwatch.act.actions.
"""

from __future__ import annotations

import logging
from typing import Any

from kvwatch.act.actions import Actions
from kvwatch.act.episodes import Episode, Unfinished
from kvwatch.act.record import Recorder
from kvwatch.policy.decide import Decider, retry_after
from kvwatch.policy.park import NOT_NEWS
from kvwatch.policy.rules import Decision
from kvwatch.streams.join import Joiner
from kvwatch.streams.view import StreamView

log = logging.getLogger(__name__)

# Action results that changed something; the others (the target was already gone, or the
# action failed) leave the decision's budget unit to be given back.
TOOK_EFFECT = {"cancelled", "reset", "parked", "detached"}
# An action that failed (or raised) is tried again after each of these delays, within its
# stall episode and on the kernel's confirmation each time; the budget is charged once.
RETRY_DELAYS_SECONDS = (1.0, 2.0, 4.0)
# A park the engine declined (its own socket still takes output: it is not held by its
# client yet) is asked for again after each of these, ~32 s in all. A non-blocking writer
# is held only once its socket's whole send buffer is queued, not at the 2/3 that counts as
# back-pressure here: a slow generation (a few KB/s of output) fills the last third in
# 10 s and more.
PARK_RETRY_DELAYS_SECONDS = (0.25, 0.5, 1.0, 2.0) + (4.0,) * 7


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

    async def on_stalled(self, episode: Episode, view: StreamView) -> float | None:
        """A stalled stream, in its episode: the actions still to try are tried again; else,
        once per episode, the policy decides and the decision is confirmed, recorded and
        carried out. Returns when to look at the stream again, or None."""
        if episode.unfinished is not None:
            return await self._try_again(episode, view)
        if episode.acted:
            return None
        return await self._handle(episode, view, self.decider.decide(view))

    async def on_pressure(self, episode: Episode, view: StreamView) -> float | None:
        """A stream under back-pressure for `park_seconds`, not stalled yet: once per
        episode, the park rule decides; a park (or detach) is carried out without the
        kernel's confirmation (it cuts nothing) and without the budget (it bounds cuts). One
        that took no effect (the engine declined: its own write buffer is still filling)
        is asked again after each of PARK_RETRY_DELAYS_SECONDS. Returns when to look at the
        stream again for a park, or None."""
        if episode.park_decided:
            return None
        decision = self.decider.decide_park(view)
        if decision.reason in NOT_NEWS:
            return retry_after(decision)
        ref, evidence = self.recorder.decision(view, decision, episode, None)
        if decision.verdict == "skip":
            return retry_after(decision)
        if decision.verdict != "act":
            episode.park_decided = True
            return None
        unfinished = Unfinished(decision.reason, ref, evidence, decision.actions)
        episode.park_tries += 1
        unfinished.tries = episode.park_tries
        await self._carry_out(view, unfinished)
        if unfinished.took_effect or episode.park_tries > len(PARK_RETRY_DELAYS_SECONDS):
            episode.park_decided = True
            return None
        return PARK_RETRY_DELAYS_SECONDS[episode.park_tries - 1]

    async def _handle(self, episode: Episode, view: StreamView, decision: Decision) -> float | None:
        kernel: dict[str, Any] | None = None
        if decision.acts:
            view, decision, kernel = await self._confirmed(view, decision)
        ref, evidence = self.recorder.decision(view, decision, episode, kernel)
        if decision.acts:
            episode.acted = True
        if decision.verdict != "act":
            return retry_after(decision)
        unfinished = Unfinished(decision.reason, ref, evidence, decision.actions)
        return await self._attempt(episode, view, unfinished)

    async def _try_again(self, episode: Episode, view: StreamView) -> float | None:
        """The next try of the episode's failed actions, if the kernel still shows the stall;
        else they are given up, each with an outcome line that says why."""
        unfinished = episode.unfinished
        assert unfinished is not None, "nothing to try again"
        confirmed = await self.actions.confirm(view)
        if confirmed.agrees:
            return await self._attempt(episode, view, unfinished)
        episode.unfinished = None
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
        self, episode: Episode, view: StreamView, unfinished: Unfinished
    ) -> float | None:
        """Carries out the remaining actions once; returns when to try the failed ones again,
        or None when nothing is left to try."""
        unfinished.tries += 1
        failed = await self._carry_out(view, unfinished)
        episode.unfinished = None
        if not failed:
            self._settle(unfinished)
            return None
        unfinished.actions = failed
        if unfinished.tries <= len(RETRY_DELAYS_SECONDS):
            episode.unfinished = unfinished
            return RETRY_DELAYS_SECONDS[unfinished.tries - 1]
        episode.failed = {"actions": list(failed), "tries": unfinished.tries, **unfinished.ref}
        self._settle(unfinished)
        return None

    def _settle(self, unfinished: Unfinished) -> None:
        if not unfinished.took_effect:
            self.budget.give_back()

    async def _carry_out(self, view: StreamView, unfinished: Unfinished) -> tuple[str, ...]:
        """Tries each remaining action once and writes its outcome; returns those that
        failed (an action that raised failed, with the exception as its detail)."""
        failed: list[str] = []
        for action in unfinished.actions:
            try:
                result = await self._act(view, unfinished, action)
            except Exception as exc:  # an action must end in an outcome, whatever went wrong
                log.exception("%s of %s failed", action, unfinished.ref["remote"])
                result = {"status": "failed", "detail": f"{type(exc).__name__}: {exc}"}
            unfinished.took_effect = unfinished.took_effect or result["status"] in TOOK_EFFECT
            if result["status"] == "failed":
                failed.append(action)
            self._outcome(view, unfinished, action, result)
        return tuple(failed)

    async def _act(self, view: StreamView, unfinished: Unfinished, action: str) -> dict[str, Any]:
        result = await self.actions.run(action, view, unfinished)
        if "freed_bytes" in result:
            result["estimated"] = unfinished.evidence["kv_estimated"]
        return result

    def _outcome(
        self, view: StreamView, unfinished: Unfinished, action: str, result: dict[str, Any]
    ) -> None:
        self.recorder.outcome(view, unfinished.ref, action, {**result, "attempt": unfinished.tries})

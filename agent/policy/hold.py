"""The hold rule: whether to pause, park or detach one stream now, or release it. Pure logic,
no I/O, no clock.

A stream's reader that falls behind by `pause_seconds` of the stream's own output (its unread
backlog as the server's kernel shows it, kvwatch.streams.backlog) gets its request **paused**:
the engine stops scheduling its decode steps and keeps its KV and its place, so it stops
decoding for nobody. Pausing never changes a byte of the stream. When the backlog is back
under `release_seconds` (the reader caught up) the request is **released** and decodes on.
Held (paused) for `park_seconds`, it is **parked**: its KV is freed and comes back on release
(docs/protocol.md, "Park and resume"), or, for an engine that can detach but not park (the
ASGI middleware), **detached**: the rest of the response goes to a bounded host buffer, so
the generation runs to its end and frees its KV (or its generation lock) then. An engine that
cannot pause has the park (or detach) after its reader has been behind for `park_seconds`.
None of these cuts anyone or loses a byte, so none needs proof that the reader is gone; the
cut (kvwatch.policy.rules) still does.

`decide_hold` checks, in this order:
1. holding is on (`policy.pause` or `policy.park`; "hold_off") and the stream can be held:
   an engine that says it can announced it on this very socket, or, behind a proxy, this is
   the client socket whose reader it waits on ("not_holdable"; the engine's own socket
   behind a proxy is `relayed`: the client socket decides). None of these skips is news;
2. a held stream whose reader caught up is released ("reader_caught_up"), with no further
   check: ending a hold only gives back what the hold took;
3. an unheld stream whose reader is not behind needs nothing ("not_behind", not news);
4. the owner is known and the deny and allow rules pass, as for any action
   (kvwatch.policy.rules, checks 2-3);
5. a stream not paused yet is paused ("reader_behind") when its engine can pause and
   `policy.pause` is on;
6. a stream paused (or behind, where it cannot be paused) for `park_seconds` is parked, else
   detached ("reader_still_behind"), when `policy.park` is on; past `grace_seconds` and
   holding at least `min_kv_bytes` (checks 4-5 of the cut; a KV the engine cannot tell,
   `kv_estimated` with no blocks, is unknown, not zero); a stream that holds no KV now is not
   parked ("no_kv_held", looked at again);
Then the verdict is "act" in enforce mode and "would_act" in observe mode: observe mode holds
nothing, so its log shows each hold it would make once per episode. Holds take nothing from
the budget of `max_cancels_per_minute`: that bounds cuts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.config.schema import PolicyConfig
from kvwatch.policy.rules import Candidate, Decision, Verdict, owner_refusal, size_refusal, skip

# Skips that say only that holding does not apply to the stream now: never news.
NOT_NEWS = {"hold_off", "not_holdable", "not_behind", "holding", "not_yet", "no_kv_held"}
_MIB = 1 << 20


@dataclass(frozen=True)
class HoldSituation:
    """Where the stream's episode stands (kvwatch.streams.episodes.Hold): whether its reader
    is `behind` (backlog at or above `pause_seconds` of its output, and past the backlog's
    error: kvwatch.act.episode_runner.BEHIND_MIN_BYTES) or `caught_up` (below
    `release_seconds`, or within the error), the backlog in seconds (None: its rate is
    unknown yet), how long it has been held (`held_seconds`; 0 when it is not) or behind
    (`behind_seconds`), what the engine says it did (`held`: "paused", "parked", "detached"
    or ""), and the hold actions already decided in this episode."""

    behind: bool
    caught_up: bool
    backlog_seconds: float | None
    behind_seconds: float
    held: str
    held_seconds: float
    decided: frozenset[str]

    @property
    def pressure_seconds(self) -> float:
        """How long the reader has kept the request from running: held, else behind."""
        return self.held_seconds if self.held else self.behind_seconds


def relief_action(candidate: Candidate) -> str | None:
    """What frees the stream's KV without a cut: "park", else "detach", else None."""
    if candidate.can_park:
        return "park"
    return "detach" if candidate.can_detach else None


def _not_holdable(candidate: Candidate) -> str | None:
    if candidate.request_id is None or not candidate.has_engine_hook:
        return "no engine announced a request on this socket"
    if candidate.relay_status not in (None, "joined"):
        return (
            "the engine's own socket behind a proxy: the client socket at the proxy decides"
            if candidate.relay_status == "relayed"
            else f"its relay link is {candidate.relay_status}"
        )
    if not (candidate.can_pause or relief_action(candidate)):
        return "its engine can neither pause, park nor detach (its hello's features)"
    return None


def _fmt(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds:.2f}"


def decide_hold(candidate: Candidate, now: HoldSituation, config: PolicyConfig) -> Decision:
    """Whether to hold `candidate`, or release it, now (see the module docstring)."""
    if config.pause == "off" and config.park == "off":
        return skip("hold_off", "policy.pause and policy.park are off")
    not_holdable = _not_holdable(candidate)
    if not_holdable is not None:
        return skip("not_holdable", not_holdable)
    verdict: Verdict = "act" if config.enforce else "would_act"
    if now.held in ("paused", "parked") and now.caught_up:
        detail = (
            f"backlog {_fmt(now.backlog_seconds)} s < release_seconds "
            f"{config.release_seconds} s after {now.held_seconds:.2f} s held"
        )
        return Decision(verdict, ("release",), "reader_caught_up", detail)
    if not now.held and not now.behind:
        return skip("not_behind", f"backlog {_fmt(now.backlog_seconds)} s")
    refusal = owner_refusal(candidate, config)
    if refusal is not None:
        return refusal
    can_pause = candidate.can_pause and config.pause == "on"
    if not now.held and "pause" not in now.decided and can_pause:
        detail = (
            f"the reader is {_fmt(now.backlog_seconds)} s of its stream behind "
            f"(pause_seconds {config.pause_seconds} s)"
        )
        return Decision(verdict, ("pause",), "reader_behind", detail)
    return _relief(candidate, now, config, verdict)


def _relief(
    candidate: Candidate, now: HoldSituation, config: PolicyConfig, verdict: Verdict
) -> Decision:
    """Step 6 of the module docstring: park (or detach) a stream held or behind for long."""
    action = relief_action(candidate)
    if (
        config.park == "off"
        or action is None
        or now.held in ("parked", "detached")
        or action in now.decided
    ):
        return skip("holding", f"held as {now.held or 'nothing'}; nothing more to do now")
    if now.pressure_seconds < config.park_seconds:
        return skip(
            "not_yet",
            f"held or behind for {now.pressure_seconds:.2f} s < park_seconds "
            f"{config.park_seconds} s",
        )
    known_zero = candidate.kv_bytes == 0 and not candidate.kv_estimated
    if known_zero and not candidate.parked_kv_bytes:
        return skip("no_kv_held", "it holds no KV now (waiting for admission, or preempted)")
    kv_bytes = None if candidate.kv_unknown else candidate.claimed_kv_bytes
    refusal = size_refusal(candidate, config, kv_bytes)
    if refusal is not None:
        return refusal
    kv_text = "unknown" if kv_bytes is None else f"{kv_bytes / _MIB:.1f} MiB"
    detail = (
        f"the reader kept the request from running for {now.pressure_seconds:.2f} s "
        f"(park_seconds {config.park_seconds} s; backlog {_fmt(now.backlog_seconds)} s), "
        f"{kv_text} KV; {action}"
    )
    return Decision(verdict, (action,), "reader_still_behind", detail)

"""Stall episodes: one object per episode of one connection, and one place where it ends.

An episode lasts while nothing is acknowledged: the kernel's cumulative bytes_acked names it
(`episode_of`), whichever view of the connection (BPF, the start-up sock_diag view, carried
over) the collector shows, so a connection gets one decision per episode however many views
of it there are. It holds everything the stages keep about it: when its stall began (for
the timeline and the duration histogram), the decision last written, whether it was acted
on, the actions still to try and those that failed on every try.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvwatch.collect.collectors import ConnectionKey, connection_key
from kvwatch.sockets import SocketSample
from kvwatch.streams.stall_timers import episode_of


@dataclass
class Unfinished:
    """The actions of an "act" decision still to carry out (in order): `tries` is how often
    they were tried, `took_effect` whether any action of the decision did, `cancelled`
    whether its cancel did."""

    reason: str
    ref: dict[str, Any]
    evidence: dict[str, Any]
    actions: tuple[str, ...]
    tries: int = 0
    took_effect: bool = False
    cancelled: bool = False


@dataclass
class Episode:
    """One stall episode of one connection. `number` is its bytes_acked; `stalled_since_ns`
    when the stall conditions began, once the judge called it stalled (0: not stalled, or
    no longer: the conditions lapsed without progress, and may begin again); `logged` the
    decision last written ((verdict, reason), its reference, its evidence); `acted` whether
    it got "act" or "would_act"; `unfinished` the actions still to try; `failed` what failed
    on every try (for `streams`, `top` and the metrics); `park_decided` whether the park
    rule (kvwatch.policy.park) is done with the episode, `park_tries` how often its park was
    asked for."""

    number: int
    stalled_since_ns: int = 0
    logged: tuple[tuple[str, str], dict[str, Any], dict[str, Any]] | None = None
    acted: bool = False
    unfinished: Unfinished | None = None
    failed: dict[str, Any] | None = None
    park_decided: bool = False
    park_tries: int = 0


class Episodes:
    """The current episode of each connection; owned by the event loop."""

    def __init__(self) -> None:
        self._current: dict[ConnectionKey, Episode] = {}

    def of(self, sample: SocketSample) -> Episode:
        """The connection's episode as of `sample`: a new one once bytes_acked moved (the
        old one ends; see `end` for what the caller may do with it)."""
        connection = connection_key(sample)
        episode = self._current.get(connection)
        if episode is None or episode.number != episode_of(sample):
            episode = self._current[connection] = Episode(episode_of(sample))
        return episode

    def current(self, sample: SocketSample) -> Episode | None:
        """The connection's newest episode, whether or not `sample` is still in it."""
        return self._current.get(connection_key(sample))

    def failed(self, sample: SocketSample) -> dict[str, Any] | None:
        """What failed on every try in the episode `sample` is in, or None."""
        episode = self.current(sample)
        return episode.failed if episode and episode.number == episode_of(sample) else None

    def connections(self) -> set[ConnectionKey]:
        return set(self._current)

    def end(self, connection: ConnectionKey) -> Episode | None:
        """The one place an episode ends before its bytes_acked moves: its socket closed or
        left the table. Returns it, so its stall can be measured."""
        return self._current.pop(connection, None)

"""Episodes: one object owns the whole story of one stream under pressure, from the moment
its reader falls behind or its socket's stall conditions begin until its reader has caught up
and nothing holds it, or its socket is gone: the pause, the park or detach, the release, the
stall's proof and the cut, with every decision written and every action still to try.

An episode belongs to a connection (its 4-tuple in its network namespace), whichever view of
it (BPF, the start-up sock_diag view, carried over) the collector shows. Inside it, a `Stall`
lasts while nothing is acknowledged: the kernel's cumulative bytes_acked names it (`stall_of`),
so a connection gets one cut decision per stall however many views of it there are. `Hold`
is the reader-paced part: what the engine was told (pause, park, detach) and when.

`Episodes.end` is the one place an episode ends: everything kept about it goes with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvwatch.collect.collectors import ConnectionKey, connection_key
from kvwatch.sockets import SocketSample

# A decision as last written: ((verdict, reason), its reference, its evidence).
Logged = tuple[tuple[str, str], dict[str, Any], dict[str, Any]]
HeldAs = Literal["", "paused", "parked", "detached"]


def stall_of(sample: SocketSample) -> int:
    """A stall lasts while nothing is acknowledged: the kernel's cumulative bytes_acked names
    it, whichever view (BPF, sock_diag, carried over) the sample is."""
    return sample.bytes_acked


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
class Stall:
    """The cut's part of an episode, while nothing is acknowledged. `number` is its
    bytes_acked; `since_ns` when the stall conditions began, once the judge called it
    stalled (0: not stalled, or no longer: the conditions lapsed without progress, and may
    begin again); `logged` the decision last written; `acted` whether it got "act" or
    "would_act"; `unfinished` the actions still to try; `failed` what failed on every try
    (for `streams`, `top` and the metrics); `done` whether the cut is done with it, and
    `retry_ns` when it is looked at again where it is not (0: at the next look)."""

    number: int
    since_ns: int = 0
    logged: Logged | None = None
    acted: bool = False
    unfinished: Unfinished | None = None
    failed: dict[str, Any] | None = None
    done: bool = False
    retry_ns: int = 0


@dataclass
class Hold:
    """The reader-paced part of an episode (kvwatch.policy.hold). `behind_since_ns` is when
    the reader last fell behind by the pause bound (0: it is not behind now); `held` what the
    engine says it did to the request (paused, parked, detached; "" nothing) and `held_since_ns`
    since when it is held at all; `decided` the hold actions decided in this episode ("act" or
    "would_act", so that observe mode writes each once); `tries` how often each was asked of
    the engine; `renew_ns` when the hold's lease is renewed next; `retry_ns` when a decision
    that did not take effect is looked at again (0: at the next look); `logged` the hold
    decision last written."""

    behind_since_ns: int = 0
    held: HeldAs = ""
    held_since_ns: int = 0
    decided: set[str] = field(default_factory=set)
    tries: dict[str, int] = field(default_factory=dict)
    renew_ns: int = 0
    retry_ns: int = 0
    logged: Logged | None = None


@dataclass
class Episode:
    """One stream's story under pressure (module docstring): its connection, its socket's
    key, when it began, its current stall (None: none yet, or progress ended the last one),
    and its hold."""

    connection: ConnectionKey
    key: int
    began_ns: int
    stall: Stall | None = None
    hold: Hold = field(default_factory=Hold)

    def stall_for(self, sample: SocketSample) -> Stall:
        """The stall `sample` is in: a new one once bytes_acked moved (the old one ends)."""
        if self.stall is None or self.stall.number != stall_of(sample):
            self.stall = Stall(stall_of(sample))
        return self.stall

    def stall_done(self, sample: SocketSample) -> bool:
        """Whether the cut is done with the stall `sample` is in."""
        stall = self.stall
        return stall is not None and stall.done and stall.number == stall_of(sample)

    def failed(self, sample: SocketSample) -> dict[str, Any] | None:
        """What failed on every try in the stall `sample` is in, or None."""
        stall = self.stall
        return stall.failed if stall is not None and stall.number == stall_of(sample) else None


class Episodes:
    """The open episode of each connection; owned by the event loop."""

    def __init__(self) -> None:
        self._open: dict[ConnectionKey, Episode] = {}

    def __len__(self) -> int:
        return len(self._open)

    def get(self, sample: SocketSample) -> Episode | None:
        return self._open.get(connection_key(sample))

    def begin(self, sample: SocketSample, now_ns: int) -> Episode:
        """The connection's open episode, begun now if it has none."""
        connection = connection_key(sample)
        episode = self._open.get(connection)
        if episode is None:
            episode = self._open[connection] = Episode(connection, sample.key, now_ns)
        episode.key = sample.key  # the view the collector shows now (BPF after sock_diag)
        return episode

    def connections(self) -> set[ConnectionKey]:
        return set(self._open)

    def open_episodes(self) -> list[Episode]:
        return list(self._open.values())

    def end(self, connection: ConnectionKey) -> Episode | None:
        """The one place an episode ends: its reader caught up and nothing holds it, or its
        socket closed or left the table. Returns it, so its stall can be measured."""
        return self._open.pop(connection, None)

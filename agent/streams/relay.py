"""Behind a proxy: from a relaying process's client socket to the engine request it carries.

A proxy (nginx, haproxy, Envoy) reads a response from its upstream connection and writes it
to its client's. The BPF programs pair those sockets from kernel evidence (bpf/kvwatch.h,
relay pairing): a client socket's `feeder` is the upstream socket, as the proxy sees it. That
socket's peer, seen from the other end, is the engine's own socket, which the engine
announced with its request; so the client socket inherits the request, when the evidence is
clear. Only a connection the relaying process opened itself can feed one: a feeder whose
local port a listener of its network namespace holds was accepted (a server thread that
reads one client and writes another), and makes no link at all. Each link has one status:

- `joined`: the feeder was confirmed on at least MIN_FEEDS writes and on more writes than
  other sockets fed; at least MIN_FEEDS of them came after the request began; and no other
  client socket was fed by the upstream since this one;
- `request_ended`: the request this socket carried has ended, whatever fed since: the
  upstream's peer is a hooked engine's server address with no live request on it; or the
  upstream now carries a request that began after this socket was last fed, or after it
  was fed (MIN_FEEDS writes or more) with fewer than MIN_FEEDS writes since (an upstream
  kept alive serves requests one after another, and a proxy thread that read the upstream
  for the next client may then write an earlier response's buffered bytes to this socket).
  The rest of that response waits in the proxy's or the kernel's buffers, and no KV is
  pinned for it;
- `ambiguous`: too few feeds, or as many from other sockets (HTTP/2 to the client multiplexes
  many upstreams into one connection), or another client socket took the upstream over:
  nothing is inherited, and the link says why;
- `request_cancelled`: kvwatch itself cancelled the request this socket carried (it was
  judged on the engine's own socket first); the client socket is still waiting at the proxy
  for a response that will never come;
- `no_engine`: no engine announced streams on the upstream's peer (an engine without the
  hook, or one reached through an address the node rewrites, such as a Service's virtual IP);
- `relayed`, on the other end: the engine's own socket (any socket that relays nothing
  itself) whose peer is an upstream that feeds a client socket, when that client socket
  carries this socket's data (it joined this socket's request, or, when this socket carries
  no live request, it is not ambiguous). That client socket decides: its stall is judged
  with the client's own buffers, where this socket's would be judged with the proxy's.
  Without a tracked client socket (the proxy's port is not watched, or the client is gone)
  the socket is judged alone.

`feeds` is cumulative since the feeder was confirmed; how many came after a request began
is known from the daemon's FeedLedger, which keeps each client socket's recent counts.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kvwatch.collect.listeners import ListeningPorts
from kvwatch.hookserver.registry import EngineStream
from kvwatch.sockets import Endpoint, Feeder, SocketSample

MIN_FEEDS = 3
# Feed counts kept per client socket. More than MIN_FEEDS: when older ones are dropped, the
# ones kept are all distinct counts, so a socket with that many after a request began has
# at least that many feeds since, which is all a join asks.
LEDGER_POINTS = 8
MAX_CANCELS_REMEMBERED = 4096
RelayStatus = Literal[
    "joined", "ambiguous", "request_ended", "request_cancelled", "no_engine", "relayed"
]
UpstreamKey = tuple[Endpoint, Endpoint]
# A client socket fed by one upstream: its own addresses, then the feeder's.
FeedRun = tuple[Endpoint, Endpoint, Endpoint, Endpoint]


@dataclass(frozen=True)
class CancelledRequest:
    """A request kvwatch cancelled, on the engine socket `engine_local` ⇄ `engine_remote`."""

    request_id: str
    opened_ns: int
    cancelled_ns: int


class Cancels:
    """The newest requests kvwatch cancelled, by the engine socket they were on (bounded)."""

    def __init__(self) -> None:
        self._by_socket: OrderedDict[UpstreamKey, CancelledRequest] = OrderedDict()

    def add(self, stream: EngineStream, cancelled_ns: int) -> None:
        key = (stream.local, stream.remote)
        self._by_socket.pop(key, None)
        self._by_socket[key] = CancelledRequest(stream.request_id, stream.opened_ns, cancelled_ns)
        if len(self._by_socket) > MAX_CANCELS_REMEMBERED:
            self._by_socket.popitem(last=False)

    def on(self, local: Endpoint, remote: Endpoint) -> CancelledRequest | None:
        return self._by_socket.get((local, remote))


def _run_of(sample: SocketSample, feeder: Feeder) -> FeedRun:
    return (sample.local, sample.remote, feeder.local, feeder.remote)


class FeedLedger:
    """Each client socket's recent feed counts, so the join can tell how many feeds came
    after a request began (the kernel keeps only the cumulative count and the newest feed's
    time). A count `feeds` seen with `fed_ns` says the count was `feeds` from `fed_ns` on,
    whenever it was observed. Owned by the daemon, which notes every sample it looks at;
    bounded: LEDGER_POINTS counts per socket, and only sockets of the newest full look
    (`note_all`) or noted since."""

    def __init__(self) -> None:
        self._runs: dict[int, tuple[FeedRun, deque[tuple[int, int]]]] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def note(self, sample: SocketSample) -> None:
        """Keeps the sample's feed count when it is newer than the last one kept (samples
        taken by a scan may arrive after an event's newer one); a new feeder, the same one
        paired again (its count restarts) or a reused socket key starts over."""
        feeder = sample.feeder
        if feeder is None:
            return
        run, point = _run_of(sample, feeder), (feeder.feeds, feeder.fed_ns)
        known = self._runs.get(sample.key)
        if known is not None and known[0] == run:
            last_feeds, last_fed_ns = known[1][-1]
            if feeder.fed_ns <= last_fed_ns:
                return
            if feeder.feeds > last_feeds:
                known[1].append(point)
                return
        self._runs[sample.key] = (run, deque([point], maxlen=LEDGER_POINTS))

    def note_all(self, present: Collection[int], news: Iterable[SocketSample]) -> None:
        """A full look at the socket table: the keys `present` in it, and its samples that
        are `news` (the rest were noted before, unchanged); sockets not in it are forgotten."""
        for key in self._runs.keys() - present:
            del self._runs[key]
        for sample in news:
            self.note(sample)

    def forget(self, key: int) -> None:
        self._runs.pop(key, None)

    def feeds_since(self, sample: SocketSample, since_ns: int) -> int:
        """How many of `sample`'s feeds came after `since_ns`: all of them when none of its
        counts from its current feeder dates from before (a socket first seen after)."""
        feeder = sample.feeder
        if feeder is None:
            return 0
        known = self._runs.get(sample.key)
        points = known[1] if known is not None and known[0] == _run_of(sample, feeder) else ()
        before = [
            feeds
            for feeds, fed_ns in (*points, (feeder.feeds, feeder.fed_ns))
            if fed_ns <= since_ns and feeds <= feeder.feeds
        ]
        return feeder.feeds - max(before, default=0)


class EngineStreams(Protocol):
    """What engines announced (the hook server)."""

    def find(self, local: Endpoint, remote: Endpoint) -> EngineStream | None: ...

    def serves(self, local: Endpoint) -> bool: ...


@dataclass(frozen=True)
class RelayLink:
    """A client socket of a relaying process and the upstream socket that feeds it; for
    `relayed`, the same link seen from the upstream's other end. `client` is the end client's
    address as the relay sees it."""

    relay_pid: int
    relay_comm: str
    feeder: Feeder
    client: Endpoint
    status: RelayStatus
    detail: str

    @property
    def joined(self) -> bool:
        return self.status == "joined"

    def chain(self, request_id: str | None) -> str:
        """`client ⇄ nginx[812] ⇄ engine request cmpl-1`, for people."""
        relay = f"{self.relay_comm or 'relay'}[{self.relay_pid}]"
        far = (
            f"engine request {request_id}"
            if request_id
            else f"{self.feeder.remote} ({self.status})"
        )
        return f"{self.client} ⇄ {relay} ⇄ {far}"

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.relay_pid,
            "comm": self.relay_comm,
            "upstream_local": str(self.feeder.local),
            "upstream_remote": str(self.feeder.remote),
            "feeds": self.feeder.feeds,
            "misses": self.feeder.misses,
            "status": self.status,
            "detail": self.detail,
        }


def _upstream(feeder: Feeder) -> UpstreamKey:
    return (feeder.local, feeder.remote)


class RelayIndex:
    """Which client socket each upstream socket fed last, over a set of samples; built per
    look (a decision, an API call) from what the daemon keeps between looks: the listening
    ports (is a feeder actively opened), the feed ledger and kvwatch's own cancels. Without
    them, a look remembers nothing: /proc read afresh, no earlier feed counts, no cancels."""

    def __init__(
        self,
        samples: Iterable[SocketSample],
        *,
        listeners: ListeningPorts | None = None,
        ledger: FeedLedger | None = None,
        cancels: Cancels | None = None,
    ) -> None:
        self._listeners = listeners if listeners is not None else ListeningPorts()
        self._ledger = ledger if ledger is not None else FeedLedger()
        self._cancels = cancels if cancels is not None else Cancels()
        self._newest: dict[UpstreamKey, tuple[SocketSample, Feeder]] = {}
        for sample in samples:
            feeder = self._feeder(sample)
            if feeder is None:
                continue
            newest = self._newest.get(_upstream(feeder))
            if newest is None or newest[1].fed_ns < feeder.fed_ns:
                self._newest[_upstream(feeder)] = (sample, feeder)

    def _feeder(self, sample: SocketSample) -> Feeder | None:
        """The sample's feeder when the relaying process opened that connection itself."""
        feeder = sample.feeder
        if feeder is None:
            return None
        opened = self._listeners.actively_opened(sample.pid, sample.netns, feeder.local.port)
        return feeder if opened else None

    def behind(
        self, sample: SocketSample, engines: EngineStreams
    ) -> tuple[EngineStream | None, RelayLink | None]:
        """The engine stream `sample` carries, and its relay link: the link through which the
        stream was found for a proxy's client socket; `relayed` for a socket whose peer is a
        proxy that relays it to a client socket which decides; None when neither. An orphaned
        socket carries none: its process closed it (whatever an engine announced on it)."""
        if sample.orphaned:
            return None, None
        direct = engines.find(sample.local, sample.remote)
        feeder = self._feeder(sample)
        if feeder is None:
            return direct, self._relayed(sample, direct, engines)
        if direct is not None:
            return direct, None
        return self._link(sample, feeder, engines)

    def _link(
        self, sample: SocketSample, feeder: Feeder, engines: EngineStreams
    ) -> tuple[EngineStream | None, RelayLink]:
        stream = engines.find(feeder.remote, feeder.local)  # the engine's side of the upstream
        status, detail = self._judge(sample, feeder, stream, engines.serves(feeder.remote))
        link = RelayLink(sample.pid, sample.comm, feeder, sample.remote, status, detail)
        return (stream if link.joined else None), link

    def _relayed(
        self, sample: SocketSample, direct: EngineStream | None, engines: EngineStreams
    ) -> RelayLink | None:
        """`relayed` when the client socket fed last by the upstream at `sample`'s other end
        carries `sample`'s data: joined to its request, or, when it carries none, any link
        but an ambiguous one."""
        newest = self._newest.get((sample.remote, sample.local))
        if newest is None:
            return None
        client, feeder = newest
        _, link = self._link(client, feeder, engines)
        if link.status == "ambiguous" or (direct is not None and not link.joined):
            return None
        relay = f"{client.comm or 'relay'}[{client.pid}]"
        return RelayLink(
            client.pid,
            client.comm,
            feeder,
            client.remote,
            "relayed",
            f"{relay} relays this socket to its client socket {client.local} ⇄ "
            f"{client.remote} ({link.status}): that socket's stall decides, with the "
            "client's own buffers",
        )

    def _judge(
        self, sample: SocketSample, feeder: Feeder, stream: EngineStream | None, hooked: bool
    ) -> tuple[RelayStatus, str]:
        upstream = f"upstream {feeder.local} → {feeder.remote}"
        if feeder.feeds < MIN_FEEDS or feeder.misses >= feeder.feeds:
            return "ambiguous", (
                f"{upstream} fed {feeder.feeds} writes, other sockets {feeder.misses}: "
                f"pairing needs at least {MIN_FEEDS} and more than the others"
            )
        if stream is None:
            return self._without_request(feeder, hooked, upstream)
        if feeder.fed_ns < stream.opened_ns:
            return "request_ended", (
                f"{upstream} now carries request {stream.request_id}, which began after this "
                "socket was last fed: the request this socket carried has ended"
            )
        since = self._ledger.feeds_since(sample, stream.opened_ns)
        if since < MIN_FEEDS:
            return "request_ended", (
                f"{upstream} fed this socket before request {stream.request_id} began and "
                f"{since} writes since (a join needs {MIN_FEEDS}): the upstream is kept "
                "alive, and the request this socket carried has ended"
            )
        newest = self._newest.get(_upstream(feeder))
        if newest is not None and newest[1].fed_ns > feeder.fed_ns:
            return "ambiguous", f"{upstream} has fed another client socket since"
        return "joined", (
            f"fed by {upstream}: {since} writes since request {stream.request_id} began, "
            f"{feeder.feeds} in all"
        )

    def _without_request(
        self, feeder: Feeder, hooked: bool, upstream: str
    ) -> tuple[RelayStatus, str]:
        cancelled = self._cancels.on(feeder.remote, feeder.local)
        if cancelled is not None and cancelled.opened_ns <= feeder.fed_ns <= cancelled.cancelled_ns:
            return "request_cancelled", (
                f"kvwatch cancelled request {cancelled.request_id}, which {upstream} carried "
                "to this socket: its client still waits at the proxy"
            )
        if hooked:
            return "request_ended", (
                f"the engine at {feeder.remote} carries no live request on {upstream}: the "
                "request this socket carried has ended"
            )
        return "no_engine", f"no engine announced streams at {feeder.remote}"

"""Behind a proxy: from a relaying process's client socket to the engine request it carries.

A proxy (nginx, haproxy, Envoy) reads a response from its upstream connection and writes it
to its client's. The BPF programs pair those sockets from kernel evidence (bpf/kvwatch.h,
relay pairing): a client socket's `feeder` is the upstream socket, as the proxy sees it. That
socket's peer, seen from the other end, is the engine's own socket, which the engine
announced with its request; so the client socket inherits the request, when the evidence is
clear. Each link has one status:

- `joined`: the feeder was confirmed on at least MIN_FEEDS writes and on more writes than
  other sockets fed; this socket is the one the upstream fed last; and it was fed after the
  request began. An upstream connection kept alive serves requests one after another, so a
  client socket last fed before the current request began belongs to an earlier request;
- `ambiguous`: too few feeds, or as many from other sockets (HTTP/2 to the client multiplexes
  many upstreams into one connection), or another client socket took the upstream over:
  nothing is inherited, and the link says why;
- `request_ended`: the upstream's peer is a hooked engine's server address, but no live
  request there is the one this socket carried: it finished, the rest of its response waits
  in the proxy's or the kernel's buffers, and no KV is pinned for it;
- `request_cancelled`: kvwatch itself cancelled the request this socket carried (it was
  judged on the engine's own socket first); the client socket is still waiting at the proxy
  for a response that will never come;
- `no_engine`: no engine announced streams on the upstream's peer (an engine without the
  hook, or one reached through an address the node rewrites, such as a Service's virtual IP).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kvwatch.hookserver.registry import EngineStream
from kvwatch.sockets import Endpoint, Feeder, SocketSample

MIN_FEEDS = 3
MAX_CANCELS_REMEMBERED = 4096
RelayStatus = Literal["joined", "ambiguous", "request_ended", "request_cancelled", "no_engine"]
UpstreamKey = tuple[Endpoint, Endpoint]


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


class EngineStreams(Protocol):
    """What engines announced (the hook server)."""

    def find(self, local: Endpoint, remote: Endpoint) -> EngineStream | None: ...

    def serves(self, local: Endpoint) -> bool: ...


@dataclass(frozen=True)
class RelayLink:
    """A client socket of a relaying process and the upstream socket that feeds it."""

    relay_pid: int
    relay_comm: str
    feeder: Feeder
    status: RelayStatus
    detail: str

    @property
    def joined(self) -> bool:
        return self.status == "joined"

    def chain(self, client: Endpoint, request_id: str | None) -> str:
        """`client ⇄ nginx[812] ⇄ engine request cmpl-1`, for people."""
        relay = f"{self.relay_comm or 'relay'}[{self.relay_pid}]"
        far = (
            f"engine request {request_id}"
            if request_id
            else f"{self.feeder.remote} ({self.status})"
        )
        return f"{client} ⇄ {relay} ⇄ {far}"

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
    look (a decision, an API call), it holds no state between them."""

    def __init__(self, samples: Iterable[SocketSample], cancels: Cancels | None = None) -> None:
        self._cancels = cancels if cancels is not None else Cancels()
        self._newest: dict[UpstreamKey, int] = {}
        for sample in samples:
            if sample.feeder is not None:
                key = _upstream(sample.feeder)
                self._newest[key] = max(self._newest.get(key, 0), sample.feeder.fed_ns)

    def behind(
        self, sample: SocketSample, engines: EngineStreams
    ) -> tuple[EngineStream | None, RelayLink | None]:
        """The engine stream `sample` carries, and the relay link it came through (None when
        the engine announced this very socket, or no feeder is known)."""
        direct = engines.find(sample.local, sample.remote)
        if direct is not None or sample.feeder is None:
            return direct, None
        feeder = sample.feeder
        stream = engines.find(feeder.remote, feeder.local)  # the engine's side of the upstream
        status, detail = self._judge(feeder, stream, engines.serves(feeder.remote))
        link = RelayLink(sample.pid, sample.comm, feeder, status, detail)
        return (stream if link.joined else None), link

    def _judge(
        self, feeder: Feeder, stream: EngineStream | None, hooked: bool
    ) -> tuple[RelayStatus, str]:
        upstream = f"upstream {feeder.local} → {feeder.remote}"
        if feeder.feeds < MIN_FEEDS or feeder.misses >= feeder.feeds:
            return "ambiguous", (
                f"{upstream} fed {feeder.feeds} writes, other sockets {feeder.misses}: "
                f"pairing needs at least {MIN_FEEDS} and more than the others"
            )
        if self._newest.get(_upstream(feeder), 0) > feeder.fed_ns:
            return "ambiguous", f"{upstream} has fed another client socket since"
        cancelled = self._cancels.on(feeder.remote, feeder.local)
        if (
            stream is None
            and cancelled is not None
            and cancelled.opened_ns <= feeder.fed_ns <= cancelled.cancelled_ns
        ):
            return "request_cancelled", (
                f"kvwatch cancelled request {cancelled.request_id}, which {upstream} carried "
                "to this socket: its client still waits at the proxy"
            )
        if stream is None and hooked:
            return "request_ended", (
                f"the engine at {feeder.remote} carries no live request on {upstream}: the "
                "request this socket carried has ended"
            )
        if stream is None:
            return "no_engine", f"no engine announced streams at {feeder.remote}"
        if feeder.fed_ns < stream.opened_ns:
            return "request_ended", (
                f"{upstream} now carries request {stream.request_id}, which began after this "
                "socket was last fed: the request this socket carried has ended"
            )
        return "joined", f"fed by {upstream}, {feeder.feeds} writes"

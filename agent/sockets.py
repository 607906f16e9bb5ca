"""The per-socket view every collector produces, whatever its source.

A `SocketSample` is one TCP socket's send-side backpressure at one instant. The BPF collector
fills it from kernel records; the sock_diag collector from netlink snapshots. Everything
downstream (stream states, the join, policy, exporters) reads only this type.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

Source = Literal["bpf", "inet_diag"]
# Linux TCP states (include/net/tcp_states.h), by number.
TCP_STATE_NAMES = {
    1: "ESTABLISHED",
    2: "SYN_SENT",
    3: "SYN_RECV",
    4: "FIN_WAIT1",
    5: "FIN_WAIT2",
    6: "TIME_WAIT",
    7: "CLOSE",
    8: "CLOSE_WAIT",
    9: "LAST_ACK",
    10: "LISTEN",
    11: "CLOSING",
}
TCP_CLOSE = 7
TCP_CLOSE_WAIT = 8
# The states in which the application has closed its sending side, by close() or
# shutdown(SHUT_WR): FIN_WAIT1, FIN_WAIT2, TIME_WAIT, CLOSE, LAST_ACK, CLOSING. Nothing writes
# to such a socket any more; the kernel sends what was queued (and gives up on its own:
# tcp_orphan_retries, tcp_fin_timeout).
SENDER_CLOSED_STATES = frozenset({4, 5, 6, 7, 9, 11})


def tcp_state_name(state: int) -> str:
    return TCP_STATE_NAMES.get(state, str(state))


def sndbuf_full(wmem_queued: int, sndbuf: int) -> bool:
    """The send buffer is full when the kernel would not report the socket writable: free
    space below half of what is queued (sk_stream_is_writeable), i.e. more than 2/3 in use.
    A writer blocked in send() or waiting for EPOLLOUT sits above this line. The BPF side
    applies the same test (kv_sndbuf_full in bpf/kvwatch_socket.h)."""
    return 3 * wmem_queued > 2 * sndbuf


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One side of a TCP connection; `ip` is the textual address (no brackets)."""

    ip: str
    port: int

    def __str__(self) -> str:
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"

    @classmethod
    def from_packed(cls, family: int, packed: bytes, port: int) -> Endpoint:
        """Builds an endpoint from a raw in_addr / in6_addr (IPv4-mapped v6 shown as v4)."""
        if family == socket.AF_INET:
            return cls(socket.inet_ntop(socket.AF_INET, packed[:4]), port)
        address = ipaddress.IPv6Address(packed[:16])
        mapped = address.ipv4_mapped
        return cls(str(mapped) if mapped is not None else str(address), port)

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Parses "ip:port" or "[ipv6]:port"; raises ValueError on anything else."""
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"not an ip:port endpoint: {text!r}")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        return cls(str(ipaddress.ip_address(host)), int(port))


@dataclass(frozen=True, slots=True)
class Feeder:
    """The socket whose data a socket relays, from kernel evidence (BPF only): the process
    that writes to it last read from `local`⇄`remote` (that socket's own view) before each
    write. `feeds` counts such writes since it became the feeder, `misses` writes after a
    read from some other socket since then; `fed_ns` is the newest feed."""

    local: Endpoint
    remote: Endpoint
    feeds: int
    misses: int
    fed_ns: int


class SocketSample(NamedTuple):
    """One TCP socket's send-side state at `observed_ns` (CLOCK_MONOTONIC nanoseconds).
    Immutable; a named tuple rather than a frozen dataclass because the collector makes one
    per changed record on every scan, and a frozen dataclass of this many fields takes
    several times longer to build (docs/collector.md, "Cost").

    Counters are cumulative since the socket was first seen (`retransmits` from sock_diag:
    since the socket was created); `peer_rwnd` is -1 where the kernel does not report the
    peer's window (sock_diag before Linux 5.4); `*_since_ns` are the start of the
    current episode or 0 when none is open. `progress_ns` is the last time the ACK point moved
    or data became pending on an idle socket: "no progress" is measured from it.
    `bytes_acked` is the kernel's cumulative count of acknowledged bytes, the same counter
    for every source, so two views of one socket can tell whether progress happened between.
    `peer_rwnd_max` is the largest window the peer ever advertised (0: unknown, sock_diag);
    `peer_wscale` the peer's window scale (-1: unknown); `rto_us` the retransmission timeout
    the zero-window probes are timed from and `probe_backoff` how often their interval has
    doubled (icsk_backoff, as of the newest segment); `last_ack_ns` when the last segment
    from the peer arrived (0: unknown) — during a zero window, the answer to the newest probe.
    `feeder` is the socket whose data this one relays (a proxy's upstream), None when none is
    known.
    """

    key: int
    source: Source
    observed_ns: int
    local: Endpoint
    remote: Endpoint
    netns: int
    inode: int
    pid: int
    comm: str
    tcp_state: int
    wmem_queued: int
    sndbuf: int
    notsent_bytes: int
    unacked_bytes: int
    peer_rwnd: int
    srtt_us: int
    snd_cwnd: int
    retransmits: int
    zero_window_probes: int
    zero_window_episodes: int
    zero_window_since_ns: int
    zero_window_total_ns: int
    last_zero_window_end_ns: int
    sndbuf_full_episodes: int
    sndbuf_full_since_ns: int
    progress_ns: int
    first_seen_ns: int
    bytes_acked: int
    first_send_ns: int = 0
    first_acked_ns: int = 0
    peer_rwnd_max: int = 0
    peer_wscale: int = -1
    rto_us: int = 0
    probe_backoff: int = 0
    last_ack_ns: int = 0
    feeder: Feeder | None = None

    @property
    def pending_bytes(self) -> int:
        """Bytes the application wrote that the peer has not acknowledged."""
        return self.notsent_bytes + self.unacked_bytes

    @property
    def sender_closed(self) -> bool:
        """The application has closed its sending side (`SENDER_CLOSED_STATES`)."""
        return self.tcp_state in SENDER_CLOSED_STATES

    @property
    def orphaned(self) -> bool:
        """Its sender closed and no process holds it any more: the kernel drains what was
        queued; no request is behind it."""
        return self.sender_closed and self.pid == 0

    @property
    def zero_window(self) -> bool:
        return self.zero_window_since_ns != 0

    @property
    def sndbuf_full(self) -> bool:
        return self.sndbuf_full_since_ns != 0

    @property
    def sndbuf_fill(self) -> float:
        """Send-queue fill as a fraction of the send buffer (0 when the buffer size is unknown)."""
        return self.wmem_queued / self.sndbuf if self.sndbuf > 0 else 0.0

    def seconds_since(self, since_ns: int, now_ns: int) -> float:
        return max(0.0, (now_ns - since_ns) / 1e9) if since_ns else 0.0

    def zero_window_seconds(self, now_ns: int) -> float:
        """Length of the current zero-window episode (0 when the window is open)."""
        return self.seconds_since(self.zero_window_since_ns, now_ns)

    def no_progress_seconds(self, now_ns: int) -> float:
        """How long data has been pending without the ACK point moving (0 when nothing pends)."""
        return self.seconds_since(self.progress_ns, now_ns) if self.pending_bytes > 0 else 0.0

    def with_changes(self, **changes: Any) -> SocketSample:
        return self._replace(**changes)

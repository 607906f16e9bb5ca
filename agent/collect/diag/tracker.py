"""Turns successive sock_diag snapshots into SocketSample objects (source "inet_diag").

A snapshot is one instant; episodes and progress need history, which DiagTracker keeps per
socket cookie between polls. Everything is measured at poll resolution: an episode starts at
the first poll that sees its condition and ends at the first poll that no longer does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwatch.collect.diag.snapshot import DiagSnapshot
from kvwatch.collect.diag.wire import TIMER_PERSIST, DiagEntry
from kvwatch.collect.probes import persist_elapsed_ns
from kvwatch.collect.procfs import SocketOwners
from kvwatch.sockets import SocketSample, sndbuf_full

# peer_rwnd when the kernel does not report the peer's window (tcpi_snd_wnd needs Linux 5.4):
# unknown, never 0, so such a socket never counts as being in a zero window.
PEER_RWND_UNKNOWN = -1


@dataclass
class _Episodes:
    """Start, count and duration of the episodes of one condition on one socket."""

    since_ns: int = 0
    count: int = 0
    closed_ns: int = 0
    last_end_ns: int = 0

    def observe(self, active: bool, now_ns: int) -> None:
        if active and not self.since_ns:
            self.since_ns = now_ns
            self.count += 1
        elif not active and self.since_ns:
            self.closed_ns += now_ns - self.since_ns
            self.last_end_ns = now_ns
            self.since_ns = 0

    def total_ns(self, now_ns: int) -> int:
        """Time spent in the condition so far, the open episode included."""
        return self.closed_ns + (now_ns - self.since_ns if self.since_ns else 0)


@dataclass
class _History:
    """What one socket looked like at the previous poll, plus its running counters."""

    first_seen_ns: int
    progress_ns: int
    bytes_acked: int
    pending_bytes: int
    backoff: int
    pid: int = 0
    comm: str = ""
    zero_window_probes: int = 0
    zero_window: _Episodes = field(default_factory=_Episodes)
    sndbuf_full: _Episodes = field(default_factory=_Episodes)


def _pending_bytes(entry: DiagEntry) -> int:
    return entry.notsent_bytes + entry.unacked_bytes


def _in_zero_window(entry: DiagEntry) -> bool:
    """The peer's window is 0 while there is data to send: only then does a zero window hold
    anything back (a silent peer with nothing queued for it is merely idle)."""
    return entry.tcp_info.snd_wnd == 0 and _pending_bytes(entry) > 0


def stalled_before_ns(entry: DiagEntry) -> int:
    """How long a socket first seen now has at least sat in a zero window with data pending
    and no ACK progress, from the kernel's persist timer (0 when it is not in one). Capped by
    the time since data was last sent: all of it was acknowledged before the window closed."""
    info = entry.tcp_info
    if entry.timer != TIMER_PERSIST or not _in_zero_window(entry):
        return 0
    elapsed = persist_elapsed_ns(info.backoff, info.rto_us, entry.timer_expires_ms)
    return min(elapsed, info.last_data_sent_ms * 1_000_000)


def _sndbuf_full(entry: DiagEntry) -> bool:
    return entry.sndbuf > 0 and sndbuf_full(entry.wmem_queued, entry.sndbuf)


class DiagTracker:
    """Keeps per-socket history between polls and emits one SocketSample per socket per poll.

    Semantics, per poll at `observed_ns` (the snapshot's CLOCK_MONOTONIC time):
    - key = socket cookie; a socket absent from a poll is dropped with its history.
    - first sight sets first_seen_ns = progress_ns = observed_ns, except for a socket the
      kernel holds in a zero window with its persist timer running: its probe schedule says
      how long it has at least been there (`stalled_before_ns`), and the zero-window episode
      and the no-progress clock start that long ago.
    - progress_ns moves to observed_ns when tcpi_bytes_acked grew since the previous poll, or
      when data is pending now and nothing was pending at the previous poll.
    - zero window = tcpi_snd_wnd == 0 and pending bytes > 0; sndbuf full = wmem_queued >=
      sndbuf. Episodes open at the first poll that sees the condition and close at the first
      that does not; `zero_window_total_ns` includes the open episode up to observed_ns.
    - zero_window_probes counts, while the persist timer is armed, the growth of icsk_backoff
      (which rises by one per zero-window probe and resets when the window opens); tcpi_probes
      itself resets on every ACK, so it cannot be totalled. A poll interval that spans a reset
      and regrowth undercounts: a lower bound.
    - retransmits = tcpi_total_retrans (since the socket was created, as the kernel counts).
    - pid/comm: the owner of the socket's inode from `owners` (lowest pid if shared), looked
      up until found; 0/"" for orphaned sockets (inode 0) or owners not visible.
    Owned by one polling thread; not thread-safe.
    """

    def __init__(self, owners: SocketOwners | None = None) -> None:
        self.owners = owners if owners is not None else SocketOwners()
        self._history: dict[int, _History] = {}

    def __len__(self) -> int:
        return len(self._history)

    def update(self, *snapshots: DiagSnapshot) -> list[SocketSample]:
        """One poll: a snapshot of each network namespace, taken together (cookies are
        unique across namespaces)."""
        previous, self._history = self._history, {}
        for snapshot in snapshots:
            for entry in snapshot.entries:
                history = previous.get(entry.cookie)
                if history is None:
                    history = self._first_sight(entry, snapshot.observed_ns)
                self._advance(history, entry, snapshot.observed_ns)
                self._history[entry.cookie] = history
        self._resolve_owners(tuple(e for snapshot in snapshots for e in snapshot.entries))
        return [self._sample(e, snapshot) for snapshot in snapshots for e in snapshot.entries]

    @staticmethod
    def _first_sight(entry: DiagEntry, now_ns: int) -> _History:
        info = entry.tcp_info
        history = _History(now_ns, now_ns, info.bytes_acked, 0, info.backoff)
        stalled_ns = stalled_before_ns(entry)
        if stalled_ns:
            # Already stalled: pending, so _advance does not take the first poll for progress.
            history.progress_ns = now_ns - stalled_ns
            history.pending_bytes = _pending_bytes(entry)
            history.zero_window.observe(True, now_ns - stalled_ns)
        return history

    @staticmethod
    def _advance(history: _History, entry: DiagEntry, now_ns: int) -> None:
        info, pending = entry.tcp_info, _pending_bytes(entry)
        if info.bytes_acked > history.bytes_acked or (pending > 0 and history.pending_bytes == 0):
            history.progress_ns = now_ns
        if entry.timer == TIMER_PERSIST:
            grown = info.backoff - history.backoff
            history.zero_window_probes += grown if grown >= 0 else info.backoff
        history.bytes_acked = info.bytes_acked
        history.pending_bytes = pending
        history.backoff = info.backoff
        history.zero_window.observe(_in_zero_window(entry), now_ns)
        history.sndbuf_full.observe(_sndbuf_full(entry), now_ns)

    def _resolve_owners(self, entries: tuple[DiagEntry, ...]) -> None:
        unresolved = {e.inode: e.cookie for e in entries if not self._history[e.cookie].pid}
        if not unresolved:
            return
        comms: dict[int, str] = {}
        for inode, pid in self.owners.resolve(unresolved).items():
            if pid not in comms:
                comms[pid] = self.owners.procfs.comm(pid) or ""
            history = self._history[unresolved[inode]]
            history.pid, history.comm = pid, comms[pid]

    def _sample(self, entry: DiagEntry, snapshot: DiagSnapshot) -> SocketSample:
        history, info, now_ns = self._history[entry.cookie], entry.tcp_info, snapshot.observed_ns
        return SocketSample(
            key=entry.cookie,
            source="inet_diag",
            observed_ns=now_ns,
            local=entry.local,
            remote=entry.remote,
            netns=snapshot.netns,
            inode=entry.inode,
            pid=history.pid,
            comm=history.comm,
            tcp_state=entry.tcp_state,
            wmem_queued=entry.wmem_queued,
            sndbuf=entry.sndbuf,
            notsent_bytes=entry.notsent_bytes,
            unacked_bytes=entry.unacked_bytes,
            peer_rwnd=info.snd_wnd if info.snd_wnd is not None else PEER_RWND_UNKNOWN,
            srtt_us=info.rtt_us,
            snd_cwnd=info.snd_cwnd,
            retransmits=info.total_retrans,
            zero_window_probes=history.zero_window_probes,
            zero_window_episodes=history.zero_window.count,
            zero_window_since_ns=history.zero_window.since_ns,
            zero_window_total_ns=history.zero_window.total_ns(now_ns),
            last_zero_window_end_ns=history.zero_window.last_end_ns,
            sndbuf_full_episodes=history.sndbuf_full.count,
            sndbuf_full_since_ns=history.sndbuf_full.since_ns,
            progress_ns=history.progress_ns,
            first_seen_ns=history.first_seen_ns,
            bytes_acked=info.bytes_acked,
            peer_wscale=info.peer_wscale,
            rto_us=info.rto_us,
            probe_backoff=info.backoff,
            last_ack_ns=now_ns - info.last_ack_recv_ms * 1_000_000,
        )

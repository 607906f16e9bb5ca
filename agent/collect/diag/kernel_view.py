"""The kernel's own view of one socket (sock_diag's `tcp_info`), folded into a record.

A BPF record sees the peer's segments only where the ACK path attaches: `tcp_probe` fires in
`tcp_rcv_established` alone, so a socket in CLOSE_WAIT (the client half-closed and reads on)
is acknowledged out of its sight, and a record can lag the kernel for any reason a program
did not run. `with_kernel_view` brings a record up to what `tcp_info` says now — bytes
acknowledged, the time since the peer's newest segment, the peer's window, the queue, the
TCP state — and every change it makes is in the direction of "not stalled": the kernel's
newer ACK time and progress replace the record's, never older ones (docs/collector.md,
"States the ACK path does not follow").
"""

from __future__ import annotations

from typing import Any

from kvwatch.collect.diag.wire import DiagEntry
from kvwatch.sockets import SocketSample, sndbuf_full

NS_PER_MS = 1_000_000
# tcpi_last_ack_recv counts jiffies (up to 10 ms each, HZ=100) in milliseconds, rounded down:
# a newest segment the record already holds can read up to this much later.
HEARD_SLACK_NS = 20 * NS_PER_MS


def heard_ns(entry: DiagEntry, observed_ns: int) -> int:
    """When the newest segment from the peer arrived, by the kernel's clock (tcp_info)."""
    return observed_ns - entry.tcp_info.last_ack_recv_ms * NS_PER_MS


class CheckedViews:
    """What each socket's last check found: the kernel's bytes_acked then, and when the
    peer's newest segment had come. Progress the record missed happened, at the latest,
    with the newest segment before the check that first showed it; if a later check finds
    the same count, nothing moved since that earlier segment. Owned by one thread."""

    def __init__(self) -> None:
        self._found: dict[int, tuple[int, int]] = {}

    def progress_by(self, key: int, bytes_acked: int, heard: int) -> int:
        """The latest the ACK point can have moved, given `bytes_acked` seen now with the
        newest segment at `heard`; remembers them for the next check."""
        earlier = self._found.get(key)
        self._found[key] = (
            earlier if earlier and earlier[0] == bytes_acked else (bytes_acked, heard)
        )
        return self._found[key][1]

    def refresh(self, sample: SocketSample, entry: DiagEntry, observed_ns: int) -> SocketSample:
        """`sample` brought up to the kernel's view `entry`, taken at `observed_ns`."""
        heard = heard_ns(entry, observed_ns)
        progress_by = self.progress_by(sample.key, entry.tcp_info.bytes_acked, heard)
        return with_kernel_view(sample, entry, observed_ns, progress_by)

    def forget(self, key: int) -> None:
        self._found.pop(key, None)


def with_kernel_view(
    sample: SocketSample, entry: DiagEntry, observed_ns: int, progress_by_ns: int
) -> SocketSample:
    """`sample` brought up to the kernel's view at `observed_ns` (see the module docstring);
    `progress_by_ns` is the latest the ACK point can have moved where the kernel counts more
    bytes acknowledged than the record (`CheckedViews`)."""
    info, heard = entry.tcp_info, heard_ns(entry, observed_ns)
    changes: dict[str, Any] = {
        "tcp_state": entry.tcp_state,
        "notsent_bytes": entry.notsent_bytes,
        "unacked_bytes": entry.unacked_bytes,
        "wmem_queued": entry.wmem_queued,
        "sndbuf": entry.sndbuf,
    }
    if heard > sample.last_ack_ns + HEARD_SLACK_NS:
        # The judge times the probes from the newest answer with the backoff as it was
        # then: tcpi_backoff has since grown by one for each probe sent and not answered
        # (tcpi_probes, reset by every ACK).
        changes["last_ack_ns"] = heard
        changes["probe_backoff"] = max(0, info.backoff - info.probes)
    if info.bytes_acked > sample.bytes_acked:
        changes["bytes_acked"] = info.bytes_acked
        changes["progress_ns"] = max(sample.progress_ns, progress_by_ns)
    if info.snd_wnd:
        changes["peer_rwnd"] = info.snd_wnd
        changes["zero_window_since_ns"] = 0
    if not sndbuf_full(entry.wmem_queued, entry.sndbuf):
        changes["sndbuf_full_since_ns"] = 0
    return sample.with_changes(**changes)

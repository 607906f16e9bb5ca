"""Before a cancel or a reset: the kernel's own view of the socket, at that moment.

The judge works from BPF records, and a record sees the peer's segments only where the ACK
path attaches: `tcp_probe` fires for ESTABLISHED sockets only, so a socket in CLOSE_WAIT (the
client half-closed and reads on) is acknowledged out of its sight; a record can also lag the
kernel for any reason a program was not run. So no destructive action rests on the record
alone: the socket is looked up with sock_diag (an exact lookup by 4-tuple, in its network
namespace), the record is brought up to what `tcp_info` says now (bytes acknowledged, the
time since the newest segment from the peer, the peer's window, the queue, the TCP state),
and the same judge must still say stalled. Every change is in the direction of "not
stalled": the kernel's newer ACK time and progress replace the record's, never older ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvwatch.collect.diag.wire import DiagEntry
from kvwatch.sockets import SocketSample, sndbuf_full
from kvwatch.streams.states import StallJudgement, StatePolicy, judge

NS_PER_MS = 1_000_000
# tcpi_last_ack_recv counts jiffies (up to 10 ms each, HZ=100) in milliseconds, rounded down:
# a newest segment the record already holds can read up to this much later.
HEARD_SLACK_NS = 20 * NS_PER_MS
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


@dataclass(frozen=True)
class KernelCheck:
    """The verdict of the kernel's view: `agrees` when the judge still says stalled from it.
    `sample` and `judgement` are the socket brought up to that view (the record's own when
    the socket is gone); `reason` ("socket_gone", "unconfirmed") and `detail` say why not;
    `kernel` is what sock_diag reported, for the evidence (None: no such socket)."""

    agrees: bool
    reason: str
    detail: str
    sample: SocketSample
    judgement: StallJudgement
    kernel: dict[str, Any] | None


def state_name(tcp_state: int) -> str:
    return TCP_STATE_NAMES.get(tcp_state, str(tcp_state))


def heard_ns(entry: DiagEntry, observed_ns: int) -> int:
    """When the newest segment from the peer arrived, by the kernel's clock (tcp_info)."""
    return observed_ns - entry.tcp_info.last_ack_recv_ms * NS_PER_MS


class CheckedViews:
    """What each socket's last check found: the kernel's bytes_acked then, and when the
    peer's newest segment had come. Progress the record missed happened, at the latest,
    with the newest segment before the check that first showed it; if a later check finds
    the same count, nothing moved since that earlier segment. Owned by the event loop."""

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
        "probe_backoff": max(sample.probe_backoff, info.backoff),
    }
    if heard > sample.last_ack_ns + HEARD_SLACK_NS:
        changes["last_ack_ns"] = heard
    if info.bytes_acked > sample.bytes_acked:
        changes["bytes_acked"] = info.bytes_acked
        changes["progress_ns"] = max(sample.progress_ns, progress_by_ns)
    if info.snd_wnd:
        changes["peer_rwnd"] = info.snd_wnd
        changes["zero_window_since_ns"] = 0
    if not sndbuf_full(entry.wmem_queued, entry.sndbuf):
        changes["sndbuf_full_since_ns"] = 0
    return sample.with_changes(**changes)


def kernel_evidence(entry: DiagEntry, observed_ns: int, now_ns: int) -> dict[str, Any]:
    info = entry.tcp_info
    return {
        "tcp_state": state_name(entry.tcp_state),
        "bytes_acked": info.bytes_acked,
        "last_ack_seconds_ago": round((now_ns - heard_ns(entry, observed_ns)) / 1e9, 3),
        "peer_rwnd": info.snd_wnd,
        "notsent_bytes": entry.notsent_bytes,
        "unacked_bytes": entry.unacked_bytes,
        "probe_backoff": info.backoff,
    }


def _differences(record: SocketSample, kernel: SocketSample, now_ns: int) -> list[str]:
    """What the kernel knows that the record did not, for people."""
    found = []
    if kernel.sender_closed:
        found.append(f"the sender has closed ({state_name(kernel.tcp_state)})")
    if kernel.bytes_acked > record.bytes_acked:
        found.append(f"{kernel.bytes_acked - record.bytes_acked} more bytes acknowledged")
    if kernel.last_ack_ns > record.last_ack_ns:
        found.append(
            f"the peer's newest segment {(now_ns - kernel.last_ack_ns) / 1e9:.3f} s ago"
            + (
                f" (the record's {(now_ns - record.last_ack_ns) / 1e9:.3f} s ago)"
                if record.last_ack_ns
                else ""
            )
        )
    if record.zero_window and not kernel.zero_window:
        found.append(f"the window is open ({kernel.peer_rwnd} bytes)")
    if record.sndbuf_full and not kernel.sndbuf_full:
        found.append("the send buffer is no longer full")
    return found


def check(
    sample: SocketSample,
    judgement: StallJudgement,
    entry: DiagEntry | None,
    observed_ns: int,
    now_ns: int,
    policy: StatePolicy,
    checked: CheckedViews,
) -> KernelCheck:
    """Whether the kernel's view of the socket (`entry`, looked up at `observed_ns`; None
    when no such socket exists) still makes it stalled at `now_ns`; `checked` holds what
    earlier checks of it found."""
    if entry is None:
        checked.forget(sample.key)
        return KernelCheck(
            False, "socket_gone", "the kernel has no such socket any more", sample, judgement, None
        )
    heard = heard_ns(entry, observed_ns)
    progress_by = checked.progress_by(sample.key, entry.tcp_info.bytes_acked, heard)
    kernel = with_kernel_view(sample, entry, observed_ns, progress_by)
    verdict = judge(kernel, now_ns, policy)
    evidence = kernel_evidence(entry, observed_ns, now_ns)
    if verdict.stalled:
        return KernelCheck(True, "", "", kernel, verdict, evidence)
    differences = _differences(sample, kernel, now_ns) or ["its proof has not come yet"]
    detail = "the kernel's own view of the socket is not stalled: " + "; ".join(differences)
    return KernelCheck(False, "unconfirmed", detail, kernel, verdict, evidence)

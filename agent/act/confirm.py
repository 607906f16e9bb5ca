"""Before a cancel or a reset: the kernel's own view of the socket, at that moment.

The judge works from records, and a record can lag the kernel (kvwatch.collect.diag.
kernel_view says where and why). So no destructive action rests on the record alone: the
socket is looked up with sock_diag (an exact lookup by 4-tuple, in its network namespace),
the record is brought up to what `tcp_info` says now (`with_kernel_view`), and the same judge
must still say stalled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvwatch.collect.diag.kernel_view import CheckedViews, heard_ns
from kvwatch.collect.diag.wire import DiagEntry
from kvwatch.sockets import SocketSample, tcp_state_name
from kvwatch.streams.states import StallJudgement, StallThresholds, judge


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


def kernel_evidence(entry: DiagEntry, observed_ns: int, now_ns: int) -> dict[str, Any]:
    info = entry.tcp_info
    return {
        "tcp_state": tcp_state_name(entry.tcp_state),
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
        found.append(f"the sender has closed ({tcp_state_name(kernel.tcp_state)})")
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
    thresholds: StallThresholds,
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
    kernel = checked.refresh(sample, entry, observed_ns)
    verdict = judge(kernel, now_ns, thresholds)
    evidence = kernel_evidence(entry, observed_ns, now_ns)
    if verdict.stalled:
        return KernelCheck(True, "", "", kernel, verdict, evidence)
    differences = _differences(sample, kernel, now_ns) or ["its proof has not come yet"]
    detail = "the kernel's own view of the socket is not stalled: " + "; ".join(differences)
    return KernelCheck(False, "unconfirmed", detail, kernel, verdict, evidence)

"""The sock_diag (netlink inet_diag) collector: snapshots, per-socket tracking, socket reset.

It bootstraps sockets that existed before the BPF collector attached, and is the degraded
collector when BPF cannot load. Everything here is blocking (it waits on the kernel): call
it from a worker thread when inside asyncio.
"""

from kvwatch.collect.diag.destroy import DestroyResult, destroy_socket
from kvwatch.collect.diag.snapshot import DiagClient, DiagSnapshot, current_netns, take_snapshot
from kvwatch.collect.diag.tracker import PEER_RWND_UNKNOWN, DiagTracker
from kvwatch.collect.diag.wire import DiagEntry, TcpInfo

__all__ = [
    "PEER_RWND_UNKNOWN",
    "DestroyResult",
    "DiagClient",
    "DiagEntry",
    "DiagSnapshot",
    "DiagTracker",
    "TcpInfo",
    "current_netns",
    "destroy_socket",
    "take_snapshot",
]

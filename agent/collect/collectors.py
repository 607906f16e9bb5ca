"""Chooses and runs a socket collector: BPF when the node allows it, else sock_diag.

`auto` picks the CO-RE object where the kernel has BTF; else BCC, which compiles the same
programs against the kernel's headers, where BCC and the headers are installed; else
sock_diag polling. The choice and its reason are reported to the operator.

Sockets that existed before the BPF programs attached are invisible to them until their next
send or ACK; a sock_diag snapshot fills that gap at start-up. `MergedCollector` shows the
diag view of such sockets until BPF has its own record of them, then polls diag no more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from kvwatch.collect.bpf.collector import BpfBackend, BpfCollector
from kvwatch.collect.bpf.loader import BTF_PATH, AttachReport, CollectorSettings
from kvwatch.collect.diag.kernel_view import CheckedViews
from kvwatch.collect.diag.namespaces import NamespacedDiag
from kvwatch.collect.diag.tracker import DiagTracker
from kvwatch.collect.procfs import Procfs, SocketOwners
from kvwatch.errors import ConfigError, KvwatchError
from kvwatch.sockets import TCP_CLOSE, TCP_CLOSE_WAIT, Endpoint, SocketSample

# After the kernel's socket table last evicted a record, sock_diag sweeps for the stalls it
# has no room for, for this long.
SWEEP_AFTER_EVICTION_SECONDS = 60.0
DRAINING_INODES_KEPT = 4096
Backend = Literal["auto", "core", "bcc", "diag"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)
BACKEND_TITLES = {"core": "CO-RE", "bcc": "BCC", "diag": "sock_diag polling"}
DIAG_LIMITS = "no edge events, episodes at poll resolution"
ConnectionKey = tuple[int, Endpoint, Endpoint]


class SocketCollector(Protocol):
    """Every collector is also the door every sample passes before anyone judges it: owner
    resolution and bootstrap carry-over happen in `samples`, `sample` and `admit` alike.
    Call them from one thread (the owner cache is not thread-safe)."""

    def samples(self) -> list[SocketSample]: ...

    def sample(self, key: int) -> SocketSample | None:
        """A fresh look at one socket (None: gone, or never seen)."""

    def admit(self, sample: SocketSample) -> SocketSample:
        """A sample that came another way (an edge event), through the same door."""

    def close(self) -> None: ...


class DiagCollector:
    """sock_diag polling, in every network namespace of the node: the degraded collector (no
    BPF) and the start-up bootstrap."""

    def __init__(self, settings: CollectorSettings, owners: SocketOwners) -> None:
        self.ports = settings.ports
        self.pid = settings.pid
        self.client = NamespacedDiag(owners.procfs)
        self.tracker = DiagTracker(owners)
        self._last: dict[int, SocketSample] = {}

    def samples(self) -> list[SocketSample]:
        found = self.tracker.update(*self.client.snapshots(self.ports))
        kept = [s for s in found if not self.pid or s.pid == self.pid]
        self._last = {s.key: s for s in kept}
        return kept

    def sample(self, key: int) -> SocketSample | None:
        """The last poll's view (polls run every half second; there is nothing fresher)."""
        return self._last.get(key)

    def admit(self, sample: SocketSample) -> SocketSample:
        return sample  # the tracker resolved its owner when it polled

    def close(self) -> None:
        self.client.close()


def connection_key(sample: SocketSample) -> ConnectionKey:
    return (sample.netns, sample.local, sample.remote)


def _earliest_open(first: int, second: int) -> int:
    """The earlier start of an episode both views see open; 0 when `first` sees it closed."""
    return min(first, second) if first and second else first


def carry_bootstrap(bpf: SocketSample, diag: SocketSample) -> SocketSample:
    """BPF's view of a socket that sock_diag saw first. Call it only while not one byte has
    been acknowledged since diag's last look (the kernel's bytes_acked is unchanged): then the
    stall evidence diag gathered (from the kernel's persist timer, see
    DiagTracker) still holds, so its older clocks are kept."""
    return bpf.with_changes(
        progress_ns=min(bpf.progress_ns, diag.progress_ns),
        first_seen_ns=min(bpf.first_seen_ns, diag.first_seen_ns),
        zero_window_since_ns=_earliest_open(bpf.zero_window_since_ns, diag.zero_window_since_ns),
        sndbuf_full_since_ns=_earliest_open(bpf.sndbuf_full_since_ns, diag.sndbuf_full_since_ns),
    )


@dataclass
class TableStatus:
    """How full the kernel's socket table is. `full` while it evicted records in the last
    SWEEP_AFTER_EVICTION_SECONDS; `sockets_seen` is how many watched sockets the newest
    sock_diag sweep found (the size that would fit them all; None before any sweep)."""

    max_sockets: int
    tracked: int = 0
    evictions: int = 0
    full: bool = False
    sockets_seen: int | None = None


def needed_sockets(table: TableStatus) -> int:
    """A --max-sockets that fits what the newest sweep saw, with a quarter to spare."""
    seen = table.sockets_seen
    if seen is None:  # no sweep yet: what the table holds and dropped
        seen = table.tracked + table.evictions
    return max(table.max_sockets, seen + seen // 4)


class MergedCollector:
    """BPF records first; diag's view for sockets BPF has no record of.

    Owns both collectors. Invariants: diag is polled only while some bootstrapped socket is
    still unknown to BPF, or while the kernel's table evicts (then every poll sweeps for the
    sockets it has no room for that hold pending data under back-pressure, so no stall goes
    unseen for the table's size); a long-running agent with room in its table pays for one
    netlink dump at start-up. `handover` keeps diag's last view of each bootstrapped socket
    until BPF sees it make progress.
    """

    def __init__(
        self, bpf: BpfCollector, diag: DiagCollector, owners: SocketOwners, max_sockets: int
    ) -> None:
        self.bpf = bpf
        self.diag = diag
        self.owners = owners
        self.table = TableStatus(max_sockets)
        self.bootstrapping = True
        self._swept_until_ns = 0
        self.handover: dict[ConnectionKey, SocketSample] = {}
        # Inodes of sockets seen draining after their sender closed, whose owner was looked
        # up again; each leaves when its socket closes (and all of them past
        # DRAINING_INODES_KEPT, should close events be lost).
        self._draining_inodes: set[int] = set()
        self.checked = CheckedViews()
        # The table's samples pass this door as they are made (SampleCache), and again only
        # when `settled` says its answer may have moved: a kept sample costs no admission.
        bpf.cache.door = self
        # The bootstrap snapshot is taken now, at attach time, so a socket that was already
        # stalled is timed from the agent's start, not from its first report.
        self.handover.update((connection_key(s), s) for s in diag.samples())

    @property
    def report(self) -> AttachReport:
        return self.bpf.report

    def samples(self) -> list[SocketSample]:
        found = self.bpf.samples()  # admitted by this door (its table's cache)
        self._note_evictions(len(found))
        if not (self.bootstrapping or self.table.full):
            return found
        swept = self.diag.samples()
        self.table.sockets_seen = len(swept)
        known = {connection_key(sample) for sample in found}
        unseen = [s for s in swept if connection_key(s) not in known]
        if self.bootstrapping:
            self.handover.update((connection_key(s), s) for s in swept)
            self.bootstrapping = bool(unseen)
            return found + unseen
        return found + [s for s in unseen if s.pending_bytes and (s.zero_window or s.sndbuf_full)]

    def _note_evictions(self, tracked: int) -> None:
        evictions = self.bpf.stats(tracked)["evictions"]
        now_ns = time.monotonic_ns()
        if evictions > self.table.evictions:
            self._swept_until_ns = now_ns + int(SWEEP_AFTER_EVICTION_SECONDS * 1e9)
        self.table.tracked, self.table.evictions = tracked, evictions
        self.table.full = now_ns < self._swept_until_ns

    def sample(self, key: int) -> SocketSample | None:
        fresh = self.bpf.sample(key)
        return self.admit(fresh) if fresh is not None else None

    def admit(self, sample: SocketSample) -> SocketSample:
        return self._in_kernel_view(self._carried(self._with_owner(sample)))

    def settled(self, sample: SocketSample) -> bool:
        """Whether `admit`'s answer for this very sample stays until the sample changes: not
        while bootstrapping or while diag's view of it is handed over, nor while its owner
        is looked up (none known yet, or draining after its sender closed), nor while it is
        brought up to the kernel's view (CLOSE_WAIT with data pending)."""
        if self.bootstrapping or (self.handover and connection_key(sample) in self.handover):
            return False
        if sample.pending_bytes and (sample.sender_closed or sample.tcp_state == TCP_CLOSE_WAIT):
            return False
        if sample.tcp_state == TCP_CLOSE or sample.sender_closed:
            return True  # whose it was no longer matters (_with_owner)
        return bool(sample.pid) or not sample.inode

    def _in_kernel_view(self, sample: SocketSample) -> SocketSample:
        """A socket in CLOSE_WAIT with data pending (its client half-closed and reads on) is
        acknowledged out of the ACK path's sight: its record is brought up to the kernel's
        view (collect/diag/kernel_view.py) each time it passes the door."""
        if sample.tcp_state != TCP_CLOSE_WAIT or not sample.pending_bytes:
            self.checked.forget(sample.key)
            return sample
        try:
            entry, observed_ns = self.diag.client.find(sample.netns, sample.local, sample.remote)
        except KvwatchError:
            return sample
        return self.checked.refresh(sample, entry, observed_ns) if entry is not None else sample

    def _carried(self, sample: SocketSample) -> SocketSample:
        if not self.handover:
            return sample
        key = connection_key(sample)
        earlier = self.handover.get(key)
        if earlier is None:
            return sample
        if sample.bytes_acked != earlier.bytes_acked:
            self.handover.pop(key, None)
            return sample
        return carry_bootstrap(sample, earlier)

    def _with_owner(self, sample: SocketSample) -> SocketSample:
        """BPF learns the owner at the first send; before that, /proc tells it by inode. A
        socket whose sender has closed while data is still queued is looked up again: once no
        process holds it (an orphan, draining after close()), it has no owner, whoever wrote
        to it last."""
        draining = sample.sender_closed and sample.pending_bytes > 0
        if sample.tcp_state == TCP_CLOSE or (sample.sender_closed and not draining):
            self._draining_inodes.discard(sample.inode)
            return sample  # gone, or nothing left to send: whose it was no longer matters
        if not sample.inode or (sample.pid and not draining):
            return sample  # socket inodes are unique across namespaces
        if draining and sample.inode not in self._draining_inodes:
            if len(self._draining_inodes) >= DRAINING_INODES_KEPT:
                self._draining_inodes.clear()
            self._draining_inodes.add(sample.inode)  # its owner's fd may be gone since
            self.owners.forget(sample.inode)
        pid = self.owners.resolve([sample.inode]).get(sample.inode)
        if pid is None:
            return sample.with_changes(pid=0, comm="") if draining else sample
        comm = self.owners.procfs.comm(pid) or ""
        return sample.with_changes(pid=pid, comm=comm)

    def close(self) -> None:
        self.bpf.close()
        self.diag.close()


@dataclass
class OpenedCollector:
    """The collector in use and a sentence on why this one, for the operator."""

    collector: SocketCollector
    backend: str
    note: str


def auto_backend() -> tuple[Backend, str]:
    """What `auto` picks on this machine, and why, in a sentence for the operator."""
    if BTF_PATH.exists():
        return "core", (
            f"auto chose CO-RE: the kernel has BTF ({BTF_PATH}), so the prebuilt object loads "
            "without a compiler or headers; BCC is only for kernels without BTF"
        )
    from kvwatch.collect.bpf.bcc import bcc_status  # imports BCC when present: only without BTF

    status = bcc_status()
    if status.usable:
        return "bcc", (
            f"auto chose BCC: the kernel has no BTF ({BTF_PATH} is missing), and BCC and "
            f"kernel headers ({status.headers}) are installed"
        )
    return "diag", (
        f"auto chose sock_diag polling: the kernel has no BTF ({BTF_PATH} is missing) and BCC "
        f"cannot run ({status.problem}): {DIAG_LIMITS}. To fix: {status.hint}"
    )


def open_collector(
    settings: CollectorSettings, backend: str = "auto", procfs_root: str = "/proc"
) -> OpenedCollector:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    settings.validate()
    owners = SocketOwners(Procfs(procfs_root))
    if backend == "auto":
        chosen, why = auto_backend()
    else:
        chosen, why = backend, f"{BACKEND_TITLES[backend]}, as asked (--backend {backend})"
    if chosen == "diag":
        return OpenedCollector(DiagCollector(settings, owners), "diag", why)
    bpf_backend: BpfBackend = "bcc" if chosen == "bcc" else "core"
    try:
        bpf = BpfCollector(settings, bpf_backend)
    except KvwatchError as exc:
        if backend != "auto":
            raise
        note = (
            f"{why}, but BPF is unavailable ({exc.message}); falling back to sock_diag "
            f"polling: {DIAG_LIMITS}. To fix: {exc.hint}"
        )
        return OpenedCollector(DiagCollector(settings, owners), "diag", note)
    merged = MergedCollector(bpf, DiagCollector(settings, owners), owners, settings.max_sockets)
    return OpenedCollector(merged, chosen, f"{why}; {bpf.report.describe()}")

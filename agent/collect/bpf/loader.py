"""Loads kvwatch's BPF object, chooses the attach modes for this kernel and attaches them.

The send path has four variants of one handler: fentry (BPF trampolines), kprobe, and the
`sock:sock_send_length` raw tracepoint, BTF-typed (tp_btf) or plain (raw_tp). `auto` tries
them in that order; each try opens the object afresh with only that variant autoloaded, so a
kernel that refuses one never poisons the next. The ACK path, lifecycle and retransmit attach
points are raw tracepoints: tp_btf where the kernel's BTF describes them (5.5+), else raw_tp.
BTF-typed programs read kernel memory with plain loads, the others through
bpf_probe_read_kernel (several times slower per field). Zero-window probes are counted only
where fentry or kprobe attach.

Where every attach point is BTF-typed (send fentry or tp_btf, tracepoints tp_btf), the records
live in socket-local storage (found through the socket, freed with it) and are read through a
BPF iterator; otherwise in the LRU hash, read in batches. Both hold the same records.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvwatch.collect.bpf.btf import datasec_offset
from kvwatch.collect.bpf.layout import MAX_FILTER_PORTS, KvSettings
from kvwatch.collect.bpf.libbpf import BTF_KIND_TYPEDEF, check_ptr, check_rc, libbpf, privilege_hint
from kvwatch.collect.bpf.maps import HashTable, SocketTable, StorageTable, UnreadableTable
from kvwatch.errors import BpfError, ConfigError

log = logging.getLogger(__name__)

SEND_MODES = ("fentry", "kprobe", "tp_btf", "raw_tp")
STORAGES = ("sk_storage", "lru_hash")
BTF_SEND_MODES = ("fentry", "tp_btf")
STORAGE_ITERATOR = "kv_dump_sockets"
TRACEPOINT_MODES = ("tp_btf", "raw_tp")
SEND_TRACEPOINT = "sock_send_length"
PROBE0_PROGRAMS = {"fentry": "kv_probe0_fentry", "kprobe": "kv_probe0_kprobe"}
# attach point -> (kernel tracepoint, program name prefix); the mode is appended to the prefix.
TRACEPOINT_ATTACH_POINTS = {
    "ack": ("tcp_probe", "kv_segment"),
    "lifecycle": ("inet_sock_set_state", "kv_state"),
    "retransmit": ("tcp_retransmit_skb", "kv_retransmit"),
    "read": ("tcp_rcv_space_adjust", "kv_read"),
}


def storages_for(requested: str, send_mode: str, tracepoint_mode: str) -> tuple[str, ...]:
    """Where records may live under these modes, best first: socket-local storage needs
    BTF-typed programs at every attach point, and its table is read through a BPF iterator,
    which a kernel may refuse where it loads the programs themselves (seen: EPERM in a VM
    sandbox); `auto` then keeps the modes and takes the LRU hash."""
    typed = send_mode in BTF_SEND_MODES and tracepoint_mode == "tp_btf"
    if requested == "sk_storage" and not typed:
        raise BpfError(
            f"socket-local storage needs BTF-typed attach points, not send={send_mode} "
            f"tracepoints={tracepoint_mode}",
            "use --storage auto or lru_hash, or force fentry/tp_btf attach points",
        )
    if requested == "auto":
        return ("sk_storage", "lru_hash") if typed else ("lru_hash",)
    return (requested,)


def send_program(mode: str) -> str:
    return f"kv_send_{mode}"


def tracepoint_programs(mode: str) -> dict[str, str]:
    return {point: f"{prefix}_{mode}" for point, (_, prefix) in TRACEPOINT_ATTACH_POINTS.items()}


@functools.cache
def kernel_btf_tracepoints() -> frozenset[str]:
    """Tracepoints the running kernel's BTF describes (btf_trace_<name>), among those used."""
    lib = libbpf()
    btf = lib.btf__load_vmlinux_btf()
    if not btf:
        return frozenset()
    try:
        wanted = [SEND_TRACEPOINT, *(tp for tp, _ in TRACEPOINT_ATTACH_POINTS.values())]
        return frozenset(
            name
            for name in wanted
            if lib.btf__find_by_name_kind(btf, f"btf_trace_{name}".encode(), BTF_KIND_TYPEDEF) > 0
        )
    finally:
        lib.btf__free(btf)


def tracepoint_mode_for_kernel() -> str:
    described = kernel_btf_tracepoints()
    return (
        "tp_btf"
        if all(tp in described for tp, _ in TRACEPOINT_ATTACH_POINTS.values())
        else "raw_tp"
    )


def send_mode_unavailable(mode: str) -> str | None:
    """Why a send mode cannot work here without trying, or None when it is worth a try."""
    if mode in TRACEPOINT_MODES and SEND_TRACEPOINT not in kernel_btf_tracepoints():
        return f"this kernel has no sock:{SEND_TRACEPOINT} tracepoint (added in Linux 6.3)"
    return None


DEFAULT_OBJECT = Path(__file__).with_name("kvwatch.bpf.o")
BTF_PATH = Path("/sys/kernel/btf/vmlinux")  # the kernel's BTF: CO-RE relocates against it


@dataclass(frozen=True)
class CollectorSettings:
    """What to watch. Filters are applied in the kernel before any map work; empty = all."""

    ports: tuple[int, ...] = ()
    pid: int = 0
    cgroup_id: int = 0
    max_sockets: int = 16384
    send_mode: str = "auto"
    tracepoint_mode: str = "auto"
    storage: str = "auto"

    def kernel_settings(self) -> KvSettings:
        """The filters as the programs read them (struct kv_settings), for either toolchain."""
        values = KvSettings(
            filter_cgroup_id=self.cgroup_id,
            filter_tgid=self.pid,
            filter_port_count=len(self.ports),
        )
        for index, port in enumerate(self.ports):
            values.filter_ports[index] = port
        return values

    def validate(self) -> None:
        if len(self.ports) > MAX_FILTER_PORTS:
            raise ConfigError(
                f"at most {MAX_FILTER_PORTS} ports can be filtered in the kernel",
                "watch fewer ports, or none (all sockets) and filter the output",
            )
        if any(not 0 < port < 65536 for port in self.ports):
            raise ConfigError(f"ports must be 1..65535, got {self.ports}", "fix --port")
        if self.max_sockets < 1:
            raise ConfigError("max_sockets must be at least 1", "fix --max-sockets")
        if self.send_mode not in ("auto", *SEND_MODES):
            raise ConfigError(
                f"unknown send mode {self.send_mode!r}",
                f"use one of auto, {', '.join(SEND_MODES)}",
            )
        if self.storage not in ("auto", *STORAGES):
            raise ConfigError(
                f"unknown record storage {self.storage!r}",
                f"use one of auto, {', '.join(STORAGES)}",
            )
        if self.tracepoint_mode not in ("auto", *TRACEPOINT_MODES):
            raise ConfigError(
                f"unknown tracepoint mode {self.tracepoint_mode!r}",
                f"use one of auto, {', '.join(TRACEPOINT_MODES)}",
            )


@dataclass
class AttachReport:
    """Which mode each attach point got, why the better send modes were refused, and, when
    the records went to the LRU hash although the modes allowed socket storage, why
    (`storage_refused`)."""

    points: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    storage: str = "lru_hash"
    storage_refused: str = ""

    @property
    def send_mode(self) -> str:
        return self.points["send"]

    def describe(self) -> str:
        parts = [f"{point}={mode}" for point, mode in self.points.items()]
        text = "BPF attach points: " + ", ".join(parts) + f"; records in {self.storage}"
        if self.storage_refused:
            text += f" (socket storage refused: {self.storage_refused})"
        if self.rejected:
            reasons = "; ".join(f"{mode}: {why}" for mode, why in self.rejected.items())
            text += f" (send path fell back: {reasons})"
        return text


def object_path() -> Path:
    override = os.environ.get("KVWATCH_BPF_OBJECT")
    path = Path(override) if override else DEFAULT_OBJECT
    if not path.is_file():
        raise BpfError(
            f"the compiled BPF object is missing: {path}",
            "build it with `make bpf` (needs clang and libbpf-dev), or reinstall kvwatch",
        )
    return path


class _OpenObject:
    """One bpf_object with a chosen send mode. Owns the object and its links until closed."""

    def __init__(
        self,
        path: Path,
        settings: CollectorSettings,
        send_mode: str,
        tracepoint_mode: str,
        storage: str,
        readable: bool,
    ) -> None:
        self.lib = libbpf()
        self.handle = check_ptr(
            self.lib.bpf_object__open_file(str(path).encode(), None), f"open {path}"
        )
        self.links: list[int] = []
        self.points: dict[str, str] = {}
        self.storage = storage
        self.readable = readable
        try:
            self._configure(settings, send_mode, tracepoint_mode)
            check_rc(self.lib.bpf_object__load(self.handle), f"load BPF programs ({send_mode})")
            self.modes = (send_mode, tracepoint_mode)
            self._attach_all(send_mode, tracepoint_mode)
        except BaseException:
            self.close()
            raise

    def program(self, name: str) -> int:
        return check_ptr(
            self.lib.bpf_object__find_program_by_name(self.handle, name.encode()),
            f"find program {name}",
        )

    def map_handle(self, name: str) -> int:
        return check_ptr(
            self.lib.bpf_object__find_map_by_name(self.handle, name.encode()), f"find map {name}"
        )

    def map_fd(self, name: str) -> int:
        return check_rc(self.lib.bpf_map__fd(self.map_handle(name)), f"fd of map {name}")

    def _configure(self, settings: CollectorSettings, send_mode: str, tracepoint_mode: str) -> None:
        wanted = {send_program(send_mode), *tracepoint_programs(tracepoint_mode).values()}
        if send_mode in PROBE0_PROGRAMS:
            wanted.add(PROBE0_PROGRAMS[send_mode])
        if self.storage == "sk_storage" and self.readable:
            wanted.add(STORAGE_ITERATOR)
        prog = self.lib.bpf_object__next_program(self.handle, None)
        while prog:
            name = self.lib.bpf_program__name(prog).decode()
            check_rc(self.lib.bpf_program__set_autoload(prog, name in wanted), f"autoload {name}")
            prog = self.lib.bpf_object__next_program(self.handle, prog)
        # The unused hash keeps one slot: the programs still name it.
        hash_entries = settings.max_sockets if self.storage == "lru_hash" else 1
        check_rc(
            self.lib.bpf_map__set_max_entries(self.map_handle("kv_sockets"), hash_entries),
            "size kv_sockets",
        )
        self._write_settings(settings)

    def _write_settings(self, settings: CollectorSettings) -> None:
        self._write_rodata("kv_settings", settings.kernel_settings())
        self._write_rodata("kv_use_sk_storage", ctypes.c_bool(self.storage == "sk_storage"))

    def _write_rodata(self, name: str, value: ctypes.Structure | ctypes.c_bool) -> None:
        btf = check_ptr(self.lib.bpf_object__btf(self.handle), "read the object's BTF")
        offset, size = datasec_offset(btf, ".rodata", name)
        if size != ctypes.sizeof(value):
            raise BpfError(
                f"{name} differs between BPF and Python", "rebuild the BPF object with `make bpf`"
            )
        data_size = ctypes.c_size_t()
        data = check_ptr(
            self.lib.bpf_map__initial_value(self.map_handle(".rodata"), ctypes.byref(data_size)),
            "map .rodata",
        )
        ctypes.memmove(data + offset, ctypes.addressof(value), size)

    def _attach(self, point: str, program: str, mode: str) -> None:
        link = check_ptr(
            self.lib.bpf_program__attach(self.program(program)), f"attach {program} ({mode})"
        )
        self.links.append(link)
        self.points[point] = mode

    def _attach_all(self, send_mode: str, tracepoint_mode: str) -> None:
        self._attach("send", send_program(send_mode), send_mode)
        for point, program in tracepoint_programs(tracepoint_mode).items():
            self._attach(point, program, tracepoint_mode)
        self.points["zero_window_probe"] = "unavailable"
        if send_mode in PROBE0_PROGRAMS:
            try:
                self._attach("zero_window_probe", PROBE0_PROGRAMS[send_mode], send_mode)
            except BpfError as exc:
                log.info("zero-window probe attach point not attached: %s", exc.message)

    def detach(self) -> None:
        for link in self.links:
            self.lib.bpf_link__destroy(link)
        self.links.clear()

    def close(self) -> None:
        self.detach()
        if self.handle:
            self.lib.bpf_object__close(self.handle)
            self.handle = 0


class BpfPrograms:
    """kvwatch's programs, loaded and attached; `close()` detaches and frees everything.

    Invariant: while open, the send, ACK, lifecycle and retransmit attach points are attached and
    the map fds are valid. Owned by one collector; not shared between threads that may close it.
    `readable=False` loads socket storage's programs without its iterator, so its table cannot
    be read (`table` refuses): for measuring the handlers where a kernel refuses the iterator.
    """

    def __init__(
        self, settings: CollectorSettings, path: Path | None = None, readable: bool = True
    ) -> None:
        settings.validate()
        self.settings = settings
        self.report = AttachReport()
        self._object = self._load(path or object_path(), settings, readable)
        self.report.points = dict(self._object.points)
        self.report.storage = self._object.storage
        self.sockets_fd = self._object.map_fd("kv_sockets")
        self.events_fd = self._object.map_fd("kv_events")
        self.stats_fd = self._object.map_fd("kv_stats")
        self.table: SocketTable = HashTable(self.sockets_fd)
        if self._object.storage == "sk_storage" and not readable:
            self.table = UnreadableTable()
        elif self._object.storage == "sk_storage":
            try:
                self.table = StorageTable(
                    self._object.program(STORAGE_ITERATOR),
                    self._object.map_fd("kv_socket_storage"),
                )
            except BpfError:
                self._object.close()
                raise
        log.debug("%s", self.report.describe())

    def _load(self, path: Path, settings: CollectorSettings, readable: bool) -> _OpenObject:
        tracepoint_mode = settings.tracepoint_mode
        if tracepoint_mode == "auto":
            tracepoint_mode = tracepoint_mode_for_kernel()
        modes = SEND_MODES if settings.send_mode == "auto" else (settings.send_mode,)
        for mode in modes:
            unavailable = send_mode_unavailable(mode)
            if unavailable:
                self.report.rejected[mode] = unavailable
                continue
            try:
                storages = storages_for(settings.storage, mode, tracepoint_mode)
            except BpfError as exc:  # socket storage asked for, this mode cannot have it
                self.report.rejected[mode] = exc.message
                continue
            refused: dict[str, str] = {}
            for storage in storages:
                try:
                    opened = _OpenObject(path, settings, mode, tracepoint_mode, storage, readable)
                except BpfError as exc:
                    refused[storage] = exc.message
                    log.debug("send mode %s with %s refused: %s", mode, storage, exc.message)
                    continue
                self.report.storage_refused = refused.get("sk_storage", "")
                return opened
            self.report.rejected[mode] = list(refused.values())[-1]  # the last storage's
        reasons = "; ".join(f"{mode}: {why}" for mode, why in self.report.rejected.items())
        if any(
            "EPERM" in why for mode, why in self.report.rejected.items() if mode in TRACEPOINT_MODES
        ):
            raise BpfError(f"not allowed to load BPF programs ({reasons})", privilege_hint())
        if len(modes) == 1:
            raise BpfError(
                f"send mode {modes[0]} is unavailable: {reasons.split(': ', 1)[1]}",
                "try --send-mode auto, or see `kvwatch doctor`",
            )
        raise BpfError(
            f"the send attach point could not attach in any mode ({reasons})",
            "run `kvwatch doctor` to see what this kernel offers",
        )

    def program_fds(self) -> dict[str, int]:
        """fd of each attached program, by attach point."""
        tracepoint_mode = self.report.points["ack"]
        names = {
            "send": send_program(self.report.send_mode),
            **tracepoint_programs(tracepoint_mode),
        }
        if self.report.points.get("zero_window_probe", "unavailable") != "unavailable":
            names["zero_window_probe"] = PROBE0_PROGRAMS[self.report.send_mode]
        return {
            point: self._object.lib.bpf_program__fd(self._object.program(program))
            for point, program in names.items()
        }

    def pause(self) -> None:
        """Detaches from every attach point; programs, maps and records stay (for benchmarks)."""
        self._object.detach()

    def resume(self) -> None:
        """Attaches the programs again, in the modes they had."""
        if not self._object.links:
            self._object._attach_all(*self._object.modes)

    def close(self) -> None:
        self.table.close()
        self._object.close()

    def __enter__(self) -> BpfPrograms:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

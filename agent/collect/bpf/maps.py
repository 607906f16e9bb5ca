"""Reads kvwatch's BPF maps: socket records, per-CPU counters, the edge ring buffer.

The socket records live in one of two tables (`SocketTable`): the LRU hash, read in batches
of BATCH_RECORDS keys, or socket-local storage, which has no keys userspace can name and is
read whole through a BPF iterator (one program run per record, one read() per ~32 KB). A read
of the whole table is one `bytes` of records back to back, each led by its socket's address
(the hash's key): no object per record, so a large table costs its own size while it is read."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Callable
from typing import Protocol

from kvwatch.collect.bpf.layout import STAT_NAMES, KvEvent, KvSockRecord
from kvwatch.collect.bpf.libbpf import RingBufferSampleFn, check_ptr, check_rc, libbpf
from kvwatch.errors import BpfError

log = logging.getLogger(__name__)

BATCH_RECORDS = 512


def read_record(map_fd: int, key: int) -> KvSockRecord | None:
    """One socket's record, or None when the socket is not tracked (closed or evicted)."""
    record = KvSockRecord()
    lookup_key = ctypes.c_uint64(key)
    rc = libbpf().bpf_map_lookup_elem(map_fd, ctypes.byref(lookup_key), ctypes.byref(record))
    return record if rc == 0 else None


def read_all_records(map_fd: int) -> bytes:
    """Every record in the socket map, back to back: batched where the kernel can (5.6+),
    else key by key."""
    try:
        return _read_batched(map_fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        return _read_key_by_key(map_fd)


def _read_batched(map_fd: int) -> bytes:
    lib = libbpf()
    record_size = ctypes.sizeof(KvSockRecord)
    keys = (ctypes.c_uint64 * BATCH_RECORDS)()
    values = (KvSockRecord * BATCH_RECORDS)()
    token = ctypes.c_uint64()
    chunks: list[bytes] = []
    first = True
    while True:
        count = ctypes.c_uint32(BATCH_RECORDS)
        rc = lib.bpf_map_lookup_batch(
            map_fd,
            None if first else ctypes.byref(token),
            ctypes.byref(token),
            keys,
            values,
            ctypes.byref(count),
            None,
        )
        first = False
        err = ctypes.get_errno() if rc < 0 else 0
        chunks.append(ctypes.string_at(values, count.value * record_size))
        if rc < 0 and err == errno.ENOENT:
            return b"".join(chunks)
        if rc < 0:
            raise OSError(err, "bpf_map_lookup_batch")


def _read_key_by_key(map_fd: int) -> bytes:
    lib = libbpf()
    key = ctypes.c_uint64()
    next_key = ctypes.c_uint64()
    records: list[bytes] = []
    previous = None
    while lib.bpf_map_get_next_key(map_fd, previous, ctypes.byref(next_key)) == 0:
        key.value = next_key.value
        record = read_record(map_fd, key.value)
        if record is not None:
            records.append(bytes(record))
        previous = ctypes.byref(key)
    return b"".join(records)


def read_stats(map_fd: int) -> dict[str, int]:
    """The per-CPU counters of kv_stats, summed over CPUs."""
    lib = libbpf()
    cpus = check_rc(lib.libbpf_num_possible_cpus(), "count possible CPUs")
    values = (ctypes.c_uint64 * cpus)()
    totals: dict[str, int] = {}
    for index, name in enumerate(STAT_NAMES):
        key = ctypes.c_uint32(index)
        check_rc(lib.bpf_map_lookup_elem(map_fd, ctypes.byref(key), values), f"read {name}")
        totals[name] = sum(values)
    return totals


class SocketTable(Protocol):
    """Where the programs keep their socket records: every record (back to back), or one."""

    def read_all(self) -> bytes: ...

    def read(self, key: int) -> KvSockRecord | None: ...

    def close(self) -> None: ...


class HashTable:
    """The LRU hash (`kv_sockets`), keyed by the socket's kernel address."""

    def __init__(self, map_fd: int) -> None:
        self.map_fd = map_fd

    def read_all(self) -> bytes:
        return read_all_records(self.map_fd)

    def read(self, key: int) -> KvSockRecord | None:
        return read_record(self.map_fd, key)

    def close(self) -> None:
        """The map belongs to the programs' object: nothing of its own to free."""


def unreadable() -> BpfError:
    return BpfError("socket records loaded without their reader", "load them readable")


class UnreadableTable:
    """Socket-local storage loaded without its iterator (`BpfPrograms(readable=False)`)."""

    def read_all(self) -> bytes:
        raise unreadable()

    def read(self, key: int) -> KvSockRecord | None:
        raise unreadable()

    def close(self) -> None:
        """Nothing of its own to free."""


class BpfIterLinkInfo(ctypes.Structure):
    """union bpf_iter_link_info, as its `map` member (the rest must be zero)."""

    _fields_ = [("map_fd", ctypes.c_uint32), ("reserved", ctypes.c_uint32 * 3)]


class BpfIterAttachOpts(ctypes.Structure):
    """struct bpf_iter_attach_opts (libbpf)."""

    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("link_info", ctypes.POINTER(BpfIterLinkInfo)),
        ("link_info_len", ctypes.c_uint32),
    ]


ITERATOR_READ_BYTES = 1 << 16


class StorageTable:
    """Socket-local storage (`kv_socket_storage`), read through the `kv_dump_sockets`
    iterator: each read is a fresh pass over every socket that holds a record. A record's
    first field is its socket's address, the same key the hash table uses. Owns the
    iterator link until closed."""

    def __init__(self, program: int, map_fd: int) -> None:
        lib = libbpf()
        self._info = BpfIterLinkInfo(map_fd=map_fd)
        opts = BpfIterAttachOpts(
            sz=ctypes.sizeof(BpfIterAttachOpts),
            link_info=ctypes.pointer(self._info),
            link_info_len=ctypes.sizeof(BpfIterLinkInfo),
        )
        self._link = check_ptr(
            lib.bpf_program__attach_iter(program, ctypes.byref(opts)),
            "attach the socket-storage iterator",
        )
        self._link_fd = check_rc(lib.bpf_link__fd(self._link), "fd of the iterator link")

    def read_all(self) -> bytes:
        """Every record, read() after read(): the kernel hands out whole records, ~32 KB a
        call."""
        chunks: list[bytes] = []
        fd = check_rc(libbpf().bpf_iter_create(self._link_fd), "start a socket-storage read")
        try:
            while chunk := os.read(fd, ITERATOR_READ_BYTES):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks)

    def read(self, key: int) -> KvSockRecord | None:
        record_size = ctypes.sizeof(KvSockRecord)
        records = self.read_all()
        # Each record starts with its socket's address: every key in one strided view.
        for index, found in enumerate(memoryview(records).cast("Q")[:: record_size // 8]):
            if found == key:
                return KvSockRecord.from_buffer_copy(records, index * record_size)
        return None

    def close(self) -> None:
        if self._link:
            libbpf().bpf_link__destroy(self._link)
            self._link = 0


EventHandler = Callable[[KvEvent], None]


class EventRing:
    """The edge-event ring buffer. `poll` (blocking, with timeout) or `consume` (after the
    epoll fd is readable) call the handler once per event, on the calling thread."""

    def __init__(self, map_fd: int, handler: EventHandler) -> None:
        self._handler = handler
        self._callback = RingBufferSampleFn(self._on_sample)
        self._ring = check_ptr(
            libbpf().ring_buffer__new(map_fd, self._callback, None, None),
            "open the event ring buffer",
        )

    def _on_sample(self, _ctx: int, data: int, size: int) -> int:
        if size < ctypes.sizeof(KvEvent):
            log.warning("short event from the ring buffer (%d bytes), ignored", size)
            return 0
        event = KvEvent.from_buffer_copy(ctypes.string_at(data, ctypes.sizeof(KvEvent)))
        try:
            self._handler(event)
        except Exception:
            log.exception("event handler failed; event dropped")
        return 0

    def poll(self, timeout_ms: int) -> int:
        rc: int = libbpf().ring_buffer__poll(self._ring, timeout_ms)
        return 0 if rc == -errno.EINTR else check_rc(rc, "poll the event ring buffer")

    def consume(self) -> int:
        return check_rc(libbpf().ring_buffer__consume(self._ring), "drain the event ring buffer")

    def fileno(self) -> int:
        return int(libbpf().ring_buffer__epoll_fd(self._ring))

    def close(self) -> None:
        if self._ring:
            libbpf().ring_buffer__free(self._ring)
            self._ring = 0

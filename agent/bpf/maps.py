"""Reads kvwatch's BPF maps: socket records (batched), per-CPU counters, the edge ring buffer."""

from __future__ import annotations

import ctypes
import errno
import logging
from collections.abc import Callable

from kvwatch.bpf.layout import STAT_NAMES, KvEvent, KvSockRecord
from kvwatch.bpf.libbpf import RingBufferSampleFn, check_ptr, check_rc, libbpf

log = logging.getLogger(__name__)

BATCH_RECORDS = 512


def read_record(map_fd: int, key: int) -> KvSockRecord | None:
    """One socket's record, or None when the socket is not tracked (closed or evicted)."""
    record = KvSockRecord()
    lookup_key = ctypes.c_uint64(key)
    rc = libbpf().bpf_map_lookup_elem(map_fd, ctypes.byref(lookup_key), ctypes.byref(record))
    return record if rc == 0 else None


def read_raw_records(map_fd: int) -> dict[int, bytes]:
    """Every record in the socket map as raw bytes by key: batched where the kernel can
    (5.6+), else key by key. Raw bytes let callers skip records that did not change."""
    try:
        return _read_batched(map_fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        return _read_key_by_key(map_fd)


def _read_batched(map_fd: int) -> dict[int, bytes]:
    lib = libbpf()
    record_size = ctypes.sizeof(KvSockRecord)
    keys = (ctypes.c_uint64 * BATCH_RECORDS)()
    values = (KvSockRecord * BATCH_RECORDS)()
    token = ctypes.c_uint64()
    records: dict[int, bytes] = {}
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
        raw = ctypes.string_at(values, count.value * record_size)
        for index, key in enumerate(keys[: count.value]):
            records[key] = raw[index * record_size : (index + 1) * record_size]
        if rc < 0 and err == errno.ENOENT:
            return records
        if rc < 0:
            raise OSError(err, "bpf_map_lookup_batch")


def _read_key_by_key(map_fd: int) -> dict[int, bytes]:
    lib = libbpf()
    key = ctypes.c_uint64()
    next_key = ctypes.c_uint64()
    records: dict[int, bytes] = {}
    previous = None
    while lib.bpf_map_get_next_key(map_fd, previous, ctypes.byref(next_key)) == 0:
        key.value = next_key.value
        record = read_record(map_fd, key.value)
        if record is not None:
            records[key.value] = bytes(record)
        previous = ctypes.byref(key)
    return records


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

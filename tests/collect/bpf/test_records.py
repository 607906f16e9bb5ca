"""Records into samples without a kernel: the struct decoding agrees with the ctypes mirror
(itself checked against BTF, test_layout.py), and the cache makes a sample again exactly
when the judge needs one."""

from __future__ import annotations

import ctypes
import random
import socket
from collections.abc import Callable

import pytest

from kvwatch.collect.bpf.layout import KvEndpoints, KvSockRecord
from kvwatch.collect.bpf.records import (
    FLOW_FIELDS,
    FLOW_REFRESH_NS,
    JUDGED_END,
    RECORD,
    RECORD_FIELDS,
    RecordValues,
    SampleCache,
    judged_end,
    sample_from_raw,
)
from kvwatch.sockets import TCP_CLOSE, Endpoint, SocketSample

SECOND_NS = 1_000_000_000


def random_record(rng: random.Random) -> KvSockRecord:
    """Every member filled with random bits."""
    raw = bytes(rng.getrandbits(8) for _ in range(ctypes.sizeof(KvSockRecord)))
    return KvSockRecord.from_buffer_copy(raw)


def ctypes_values(structure: ctypes.Structure, prefix: str = "") -> dict[str, object]:
    """Each member by the name the struct decoding gives it, read through ctypes."""
    values: dict[str, object] = {}
    for name, *_ in structure._fields_:
        value = getattr(structure, name)
        if isinstance(value, ctypes.Structure):
            values.update(ctypes_values(value, f"{prefix}{name}_"))
        elif isinstance(value, (ctypes.Array, bytes)):
            field = getattr(type(structure), name)
            raw = bytes(structure)[field.offset : field.offset + field.size]
            values[prefix + name] = raw
        else:
            values[prefix + name] = value
    return values


def test_struct_decoding_agrees_with_the_ctypes_mirror() -> None:
    rng = random.Random(26)
    assert RECORD.size == ctypes.sizeof(KvSockRecord)
    for _ in range(50):
        record = random_record(rng)
        decoded = RecordValues._make(RECORD.unpack(bytes(record)))._asdict()
        assert decoded == ctypes_values(record)
    assert list(decoded) == RECORD_FIELDS


def test_the_flow_is_the_records_tail() -> None:
    """What the judge reads is one range of bytes (the cache compares it), so kvwatch.h keeps
    the flow fields last; a layout that breaks this is refused at import."""
    tail = [name for name, *_ in KvSockRecord._fields_][-len(FLOW_FIELDS) :]
    assert set(tail) == FLOW_FIELDS
    assert getattr(KvSockRecord, tail[0]).offset == JUDGED_END

    class Misordered(ctypes.Structure):
        _fields_ = [("sk", ctypes.c_uint64), ("acks", ctypes.c_uint64), ("tgid", ctypes.c_uint32)]

    with pytest.raises(ValueError, match="tgid"):
        judged_end(Misordered, frozenset({"acks"}))


def v4(address: str) -> bytes:
    return socket.inet_aton(address) + bytes(12)


def healthy_idle(sk: int = 0xFFFF_8880_1234_5000) -> KvSockRecord:
    """A tracked server socket between tokens: everything acknowledged, window open."""
    record = KvSockRecord(sk=sk, family=socket.AF_INET, sport=8000, dport=40000, tcp_state=1)
    record.saddr[:] = v4("10.0.0.1")
    record.daddr[:] = v4("10.0.0.2")
    record.comm = b"engine"
    record.tgid = 4242
    record.snd_una = record.snd_nxt = record.write_seq = 1000
    record.peer_rwnd = record.peer_rwnd_max = 65535
    record.srtt_us, record.rttvar_us = 300, 100
    record.first_seen_ns = record.progress_ns = 5 * SECOND_NS
    return record


def test_sample_of_a_record() -> None:
    record = healthy_idle()
    record.snd_una, record.snd_nxt, record.write_seq = 0xFFFF_FF00, 0x0000_0100, 0x0000_0300
    record.feeder_sk = 77
    record.feeder = KvEndpoints(sport=9000, dport=8080, family=socket.AF_INET6)
    record.feeder.saddr[:] = bytes(10) + b"\xff\xff" + socket.inet_aton("127.0.0.1")
    record.feeder.daddr[:] = socket.inet_pton(socket.AF_INET6, "fd00::1")
    record.feeds, record.feeder_misses, record.fed_ns = 4, 1, 9 * SECOND_NS
    sample = sample_from_raw(bytes(record), 12)
    assert (sample.key, sample.observed_ns) == (record.sk, 12)
    assert (sample.pid, sample.comm) == (4242, "engine")
    assert sample.local == Endpoint("10.0.0.1", 8000)
    assert sample.remote == Endpoint("10.0.0.2", 40000)
    assert (sample.unacked_bytes, sample.notsent_bytes) == (0x200, 0x200)  # across the wrap
    assert sample.rto_us == 400
    assert sample.feeder is not None
    assert (sample.feeder.local, sample.feeder.remote) == (
        Endpoint("127.0.0.1", 9000),
        Endpoint("fd00::1", 8080),
    )
    feeder = sample.feeder
    assert (feeder.feeds, feeder.misses, feeder.fed_ns) == (4, 1, 9 * SECOND_NS)
    record.write_seq = record.snd_una - 1  # behind: no bytes, not four billion
    assert sample_from_raw(bytes(record), 12).notsent_bytes == 0


def read(cache: SampleCache, record: KvSockRecord, now_ns: int) -> SocketSample:
    (sample,) = cache.update(bytes(record), now_ns)
    return sample


def test_unchanged_records_keep_their_samples() -> None:
    cache, record = SampleCache(), healthy_idle()
    first = read(cache, record, SECOND_NS)
    assert read(cache, record, 2 * SECOND_NS) is first
    assert read(cache, record, 100 * SECOND_NS) is first


def test_a_flow_between_reads_waits_for_the_refresh() -> None:
    """An idle healthy socket that wrote and was acknowledged between two reads keeps its
    sample until FLOW_REFRESH_NS has passed since it was made; then its counters catch up."""
    cache, record = SampleCache(), healthy_idle()
    first = read(cache, record, SECOND_NS)
    record.snd_una = record.snd_nxt = record.write_seq = 1200
    record.bytes_acked += 200
    record.progress_ns = record.last_ack_ns = record.last_send_ns = 2 * SECOND_NS
    record.srtt_us, record.snd_cwnd, record.peer_rwnd = 280, 12, 63000
    assert read(cache, record, 2 * SECOND_NS) is first
    assert read(cache, record, SECOND_NS + FLOW_REFRESH_NS - 1) is first
    caught_up = read(cache, record, SECOND_NS + FLOW_REFRESH_NS)
    assert caught_up is not first
    assert (caught_up.bytes_acked, caught_up.srtt_us) == (200, 280)
    assert caught_up.local is first.local  # a server's endpoint is made once


def test_what_the_judge_reads_is_never_late() -> None:
    """Pending data (now or at the last sample), back-pressure, and any change outside the
    flow counters make a new sample at the next read."""
    changes: dict[str, Callable[[KvSockRecord], None]] = {
        "pending now": lambda r: setattr(r, "write_seq", r.write_seq + 10),
        "zero window": lambda r: setattr(r, "zero_window_since_ns", 3 * SECOND_NS),
        "state": lambda r: setattr(r, "tcp_state", 8),
        "owner": lambda r: setattr(r, "tgid", 7),
        "feeds": lambda r: setattr(r, "feeds", 3),
    }
    for what, change in changes.items():
        cache, record = SampleCache(), healthy_idle()
        first = read(cache, record, SECOND_NS)
        change(record)
        assert read(cache, record, 2 * SECOND_NS) is not first, what

    cache, record = SampleCache(), healthy_idle()
    record.write_seq += 10  # pending at the last sample
    first = read(cache, record, SECOND_NS)
    record.snd_una = record.snd_nxt = record.write_seq
    assert read(cache, record, 2 * SECOND_NS) is not first


def test_closing_records_and_reused_keys() -> None:
    cache, record = SampleCache(), healthy_idle()
    first = read(cache, record, SECOND_NS)
    record.tcp_state = TCP_CLOSE
    assert cache.update(bytes(record), 2 * SECOND_NS) == []
    other = healthy_idle()
    other.dport = 40001  # another socket at the same kernel address
    read(cache, healthy_idle(), 3 * SECOND_NS)
    reused = read(cache, other, 4 * SECOND_NS)
    assert reused.remote == Endpoint("10.0.0.2", 40001)
    assert first.remote == Endpoint("10.0.0.2", 40000)


def test_a_table_read_of_many_records() -> None:
    records = [healthy_idle(sk=0xFFFF_8880_0000_0000 + index * 4096) for index in range(3)]
    for index, record in enumerate(records):
        record.dport = 40000 + index
    records[1].tcp_state = TCP_CLOSE
    samples = SampleCache().update(b"".join(bytes(record) for record in records), SECOND_NS)
    assert [(s.key, s.remote.port) for s in samples] == [
        (records[0].sk, 40000),
        (records[2].sk, 40002),
    ]


class OwnerDoor:
    """A door that names each sample's owner, as the collectors' door does (the owner is
    settled once the record has one)."""

    def __init__(self) -> None:
        self.admitted: list[int] = []

    def admit(self, sample: SocketSample) -> SocketSample:
        self.admitted.append(sample.key)
        return sample.with_changes(comm=f"{sample.comm} (admitted)")

    def settled(self, sample: SocketSample) -> bool:
        return sample.pid != 0


def test_a_kept_sample_passes_the_door_once() -> None:
    """A sample the cache keeps is the very object the door admitted; one whose door answer
    may move (no owner yet) passes again at every read; a new sample passes once."""
    door = OwnerDoor()
    cache, record = SampleCache(door), healthy_idle()
    first = read(cache, record, SECOND_NS)
    assert first.comm == "engine (admitted)"
    assert read(cache, record, 2 * SECOND_NS) is first
    record.bytes_acked += 100  # a flow on an idle socket: kept, then refreshed
    assert read(cache, record, 3 * SECOND_NS) is first
    refreshed = read(cache, record, SECOND_NS + FLOW_REFRESH_NS)
    assert (refreshed.bytes_acked, refreshed.comm) == (100, "engine (admitted)")
    assert len(door.admitted) == 2
    record.tgid = 0  # no owner: the door looks at every read
    for second in (7, 8, 9):
        read(cache, record, second * SECOND_NS)
    assert len(door.admitted) == 5


class OneByOne:
    """The cache's rule, record by record (the module's docstring, written out): what a
    vectorised read of the whole table must decide for each record."""

    def __init__(self) -> None:
        self.known: dict[int, tuple[bytes, int, bool, bool]] = {}  # raw, made at, idle, lagging

    def made_again(self, records: list[KvSockRecord], now_ns: int) -> dict[int, bool]:
        decided: dict[int, bool] = {}
        known: dict[int, tuple[bytes, int, bool, bool]] = {}
        for record in records:
            raw = bytes(record)
            if record.tcp_state == TCP_CLOSE:
                continue
            before = self.known.get(record.sk)
            made = before is None or not self._kept(before, raw, now_ns)
            if made:
                sample = sample_from_raw(raw, now_ns)
                shortfall = sample.peer_rwnd + 4096 < sample.peer_rwnd_max
                idle = not (sample.pending_bytes or sample.zero_window or sample.sndbuf_full)
                known[record.sk] = (raw, now_ns, idle and not shortfall, False)
            else:
                assert before is not None
                lagging = before[3] or raw != before[0]
                known[record.sk] = (raw, before[1], before[2], lagging)
            decided[record.sk] = made
        self.known = known
        return decided

    @staticmethod
    def _kept(before: tuple[bytes, int, bool, bool], raw: bytes, now_ns: int) -> bool:
        old, made_ns, idle, lagging = before
        fresh = now_ns - made_ns < FLOW_REFRESH_NS
        if raw == old:
            return fresh or not lagging
        record = KvSockRecord.from_buffer_copy(raw)
        pending = record.snd_una != record.write_seq
        shortfall = record.peer_rwnd + 4096 < record.peer_rwnd_max
        return (
            fresh and idle and raw[:JUDGED_END] == old[:JUDGED_END] and not (pending or shortfall)
        )


def _all_sent_and_acked(record: KvSockRecord, sequence: int) -> None:
    record.snd_una = record.snd_nxt = record.write_seq = sequence


MUTATIONS: dict[str, Callable[[KvSockRecord, random.Random], None]] = {
    "flow": lambda r, rng: setattr(r, "bytes_acked", r.bytes_acked + rng.randrange(1, 999)),
    "sent and acked": lambda r, rng: _all_sent_and_acked(r, r.write_seq + 100),
    "pending": lambda r, rng: setattr(r, "write_seq", r.write_seq + rng.randrange(1, 99)),
    "window shrinks": lambda r, rng: setattr(r, "peer_rwnd", rng.randrange(0, 65535)),
    "zero window": lambda r, rng: setattr(r, "zero_window_since_ns", rng.randrange(1, 9**9)),
    "feeds": lambda r, rng: setattr(r, "feeds", r.feeds + 1),
    "closes": lambda r, rng: setattr(r, "tcp_state", TCP_CLOSE),
    "nothing": lambda r, rng: None,
}


def test_a_vectorised_read_decides_as_record_by_record() -> None:
    """Random tables read after random changes, sockets coming and going and the table in
    any order: every record gets a new sample exactly when the record-by-record rule makes
    one, and keeps the very same object otherwise."""
    rng = random.Random(34)
    for _ in range(40):
        cache, rule = SampleCache(), OneByOne()
        live = [healthy_idle(sk=0xFFFF_8880_0000_0000 + i * 4096) for i in range(6)]
        last: dict[int, SocketSample] = {}
        now_ns = SECOND_NS
        for _ in range(25):
            now_ns += rng.choice([SECOND_NS // 2, SECOND_NS, 3 * SECOND_NS])
            for record in live:
                MUTATIONS[rng.choice(list(MUTATIONS))](record, rng)
            if rng.random() < 0.3:
                live.append(healthy_idle(sk=0xFFFF_8880_0000_0000 + rng.randrange(6, 12) * 4096))
            live = [r for r in live if r.tcp_state != TCP_CLOSE or rng.random() < 0.5]
            rng.shuffle(live)
            unique = list({r.sk: r for r in live}.values())
            samples = cache.update(b"".join(bytes(r) for r in unique), now_ns)
            expected = rule.made_again(unique, now_ns)
            assert [s.key for s in samples] == list(expected)
            raw = {r.sk: bytes(r) for r in unique}
            for sample in samples:
                assert (sample is not last.get(sample.key)) == expected[sample.key]
                assert expected[sample.key] == (sample.observed_ns == now_ns)
                if expected[sample.key]:  # made whole, or its flow refreshed: the same sample
                    assert sample == sample_from_raw(raw[sample.key], now_ns)
            last = {s.key: s for s in samples}


def test_a_record_read_twice_in_one_pass_counts_once() -> None:
    """A record that moved while the table was read (the hash map's batches) appears twice:
    its last copy is its sample."""
    first, second = healthy_idle(), healthy_idle()
    second.tgid = 99
    (sample,) = SampleCache().update(bytes(first) + bytes(second), SECOND_NS)
    assert sample.pid == 99

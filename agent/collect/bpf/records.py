"""Socket records (struct kv_sock_record, as bytes) turned into `SocketSample`s, only as
often as the judge needs.

A record is unpacked by one `struct.Struct` derived from the ctypes mirror
(`layout.KvSockRecord`, itself checked against the object's BTF), so the two cannot drift.

`SampleCache` keeps the newest table (as 32-bit words) and, aligned with its rows, each
socket's sample and what the cache knows of it. A read of the whole table makes a new sample
only for a record that changed, and not even then while the change is only the flow of a
healthy, idle socket (`FLOW_FIELDS` moved; no back-pressure, nothing pending and the peer's
window near its largest, before and after): such a socket keeps its sample for up to
`FLOW_REFRESH_NS`, so a stream that is between tokens at each read costs a share of a few
vectorised comparisons over the whole table, not a conversion, nor a Python step of its own;
when its sample is that old, its flow counters are decoded together with every other such
row's (numpy columns over the table) into a copy of its sample, not converted again.
Everything the judge reads of a socket under back-pressure, with data pending, whose reader
holds unread bytes (its window `SHORTFALL_BYTES` below its largest), or whose state, owner,
episodes or feeder changed is always as of this read.

The flow is the record's tail (kvwatch.h lays it out so; `judged_end` checks it at import),
so the part the judge reads is one range of words: telling a flow-only change is one
comparison of that range, with no unpacking.
"""

from __future__ import annotations

import collections
import ctypes
import struct
from typing import Any, Protocol

import numpy as np

from kvwatch.collect.bpf.layout import KvSockRecord
from kvwatch.sockets import TCP_CLOSE, Endpoint, Feeder, SocketSample

SEQ_MODULO = 1 << 32
# The fields a healthy flow moves on every write and ACK; a change in any other field (or
# back-pressure, or pending data) makes a new sample at once.
FLOW_FIELDS = frozenset(
    {
        "last_send_ns",
        "last_ack_ns",
        "progress_ns",
        "send_bytes",
        "send_calls",
        "acks",
        "bytes_acked",
        "snd_una",
        "snd_nxt",
        "write_seq",
        "peer_rwnd",
        "peer_rwnd_max",
        "rttvar_us",
        "srtt_us",
        "snd_cwnd",
        "wmem_queued",
        "sndbuf",
        "retransmits",
    }
)
# How long an idle, healthy socket's sample may lag its record's flow counters.
FLOW_REFRESH_NS = 5_000_000_000


# struct codes of the unsigned integer types the shared structs use: '<' gives each its
# standard size (c_uint64 is c_ulong, whose own code 'L' would be 4 bytes there).
UNSIGNED_CODES = {
    ctypes.c_uint8: "B",
    ctypes.c_uint16: "H",
    ctypes.c_uint32: "I",
    ctypes.c_uint64: "Q",
}


def struct_format(
    structure: type[ctypes.Structure], keep: frozenset[str] | None = None, prefix: str = ""
) -> tuple[str, list[str]]:
    """A little-endian `struct` format for a ctypes structure (padding explicit) and the
    names of the values it unpacks, nested members as `outer_inner`; byte arrays are one
    `bytes` value. With `keep`, only those top-level members are unpacked (the rest skipped).
    Raises TypeError on a member of another kind (kvwatch.h has none)."""
    codes: list[str] = []
    names: list[str] = []
    end = 0
    for name, kind, *_ in structure._fields_:
        offset = getattr(structure, name).offset
        size = ctypes.sizeof(kind)
        if offset > end:
            codes.append(f"{offset - end}x")
        if keep is not None and name not in keep:
            codes.append(f"{size}x")
        elif issubclass(kind, ctypes.Structure):
            nested_codes, nested_names = struct_format(kind, prefix=f"{prefix}{name}_")
            codes.append(nested_codes)
            names.extend(nested_names)
        elif issubclass(kind, ctypes.Array) and size == len(kind()):  # one byte an element
            codes.append(f"{size}s")
            names.append(prefix + name)
        elif kind in UNSIGNED_CODES:
            codes.append(UNSIGNED_CODES[kind])
            names.append(prefix + name)
        else:
            raise TypeError(f"{structure.__name__}.{name}: no struct code for {kind.__name__}")
        end = offset + size
    if ctypes.sizeof(structure) > end:
        codes.append(f"{ctypes.sizeof(structure) - end}x")
    return "".join(codes), names


def named_tuple(name: str, fields: list[str]) -> Any:
    """A namedtuple type whose fields are known only at run time (derived from the layout)."""
    make: Any = collections.namedtuple
    return make(name, fields)


RECORD_FORMAT, RECORD_FIELDS = struct_format(KvSockRecord)
RECORD = struct.Struct("<" + RECORD_FORMAT)
RecordValues = named_tuple("RecordValues", RECORD_FIELDS)
# A window this far below the largest its peer advertised holds unread bytes the judge of
# a reader's backlog reads (kvwatch.streams.backlog): such a record is as of every read.
SHORTFALL_BYTES = 4096
TCP_STATE_OFFSET = KvSockRecord.tcp_state.offset
# Past this many, the endpoint cache starts over.
CACHED_ENDPOINTS_MAX = 4096


def judged_end(structure: type[ctypes.Structure], flow: frozenset[str]) -> int:
    """Where the flow starts: `flow` must be exactly the structure's last members (raises
    ValueError when it is not, naming what breaks the order)."""
    names = [name for name, *_ in structure._fields_]
    tail = names[len(names) - len(flow) :]
    if set(tail) != flow:
        raise ValueError(
            f"{structure.__name__}: the flow fields must come last, together; "
            f"out of place: {sorted(flow.symmetric_difference(tail))}"
        )
    end: int = getattr(structure, tail[0]).offset
    return end


JUDGED_END = judged_end(KvSockRecord, FLOW_FIELDS)


def seq_distance(later: int, earlier: int) -> int:
    """Bytes from `earlier` to `later` in 32-bit sequence space (0 if `later` is behind)."""
    distance = (later - earlier) % SEQ_MODULO
    return distance if distance < SEQ_MODULO // 2 else 0


class EndpointCache:
    """Endpoints made once from the kernel's packed addresses: one that many connections
    share (a server's) whole, one of a single connection (a client's ephemeral port) by its
    address text. Bounded: each map starts over past CACHED_ENDPOINTS_MAX entries."""

    def __init__(self) -> None:
        self._locals: dict[tuple[int, bytes, int], Endpoint] = {}
        self._addresses: dict[tuple[int, bytes], str] = {}

    def shared(self, family: int, packed: bytes, port: int) -> Endpoint:
        key = (family, packed, port)
        found = self._locals.get(key)
        if found is None:
            if len(self._locals) >= CACHED_ENDPOINTS_MAX:
                self._locals.clear()
            found = self._locals[key] = Endpoint.from_packed(family, packed, port)
        return found

    def per_connection(self, family: int, packed: bytes, port: int) -> Endpoint:
        key = (family, packed)
        address = self._addresses.get(key)
        if address is None:
            if len(self._addresses) >= CACHED_ENDPOINTS_MAX:
                self._addresses.clear()
            address = self._addresses[key] = Endpoint.from_packed(family, packed, port).ip
        return Endpoint(address, port)


def _feeder(values: Any, endpoints: EndpointCache) -> Feeder | None:
    if not values.feeder_sk:
        return None
    family = values.feeder_family
    return Feeder(
        local=endpoints.per_connection(family, values.feeder_saddr, values.feeder_sport),
        remote=endpoints.shared(family, values.feeder_daddr, values.feeder_dport),
        feeds=values.feeds,
        misses=values.feeder_misses,
        fed_ns=values.fed_ns,
    )


def sample_from_raw(
    raw: bytes | memoryview, observed_ns: int, endpoints: EndpointCache | None = None
) -> SocketSample:
    """The sample of one record (`RECORD.size` bytes)."""
    values = RecordValues._make(RECORD.unpack(raw))
    family = values.family
    endpoints = endpoints or EndpointCache()
    return SocketSample(
        key=values.sk,
        source="bpf",
        observed_ns=observed_ns,
        local=endpoints.shared(family, values.saddr, values.sport),
        remote=endpoints.per_connection(family, values.daddr, values.dport),
        netns=values.netns,
        inode=values.inode,
        pid=values.tgid,
        comm=values.comm.split(b"\0", 1)[0].decode(errors="replace"),
        tcp_state=values.tcp_state,
        wmem_queued=values.wmem_queued,
        sndbuf=values.sndbuf,
        notsent_bytes=seq_distance(values.write_seq, values.snd_nxt),
        unacked_bytes=seq_distance(values.snd_nxt, values.snd_una),
        peer_rwnd=values.peer_rwnd,
        srtt_us=values.srtt_us,
        snd_cwnd=values.snd_cwnd,
        retransmits=values.retransmits,
        zero_window_probes=values.zero_window_probes,
        zero_window_episodes=values.zero_window_episodes,
        zero_window_since_ns=values.zero_window_since_ns,
        zero_window_total_ns=values.zero_window_total_ns,
        last_zero_window_end_ns=values.last_zero_window_end_ns,
        sndbuf_full_episodes=values.sndbuf_full_episodes,
        sndbuf_full_since_ns=values.sndbuf_full_since_ns,
        progress_ns=values.progress_ns,
        first_seen_ns=values.first_seen_ns,
        bytes_acked=values.bytes_acked,
        first_send_ns=values.first_send_ns,
        first_acked_ns=values.first_acked_ns,
        peer_rwnd_max=values.peer_rwnd_max,
        rto_us=values.srtt_us + values.rttvar_us,
        probe_backoff=values.probe_backoff,
        last_ack_ns=values.last_ack_ns,
        feeder=_feeder(values, endpoints),
    )


def idle_and_healthy(sample: SocketSample) -> bool:
    """Nothing pending, no back-pressure, and no unread backlog at the peer to speak of."""
    shortfall = sample.peer_rwnd + SHORTFALL_BYTES < sample.peer_rwnd_max
    return not (sample.pending_bytes or sample.zero_window or sample.sndbuf_full or shortfall)


def _word(offset: int) -> int:
    """The 32-bit word of a record at byte `offset` (a multiple of 4: kvwatch.h aligns
    every member the cache reads as a word, and the record's size, so)."""
    if offset % 4:
        raise ValueError(f"struct kv_sock_record: byte {offset} is not on a 32-bit word")
    return offset // 4


RECORD_WORDS = _word(RECORD.size)
JUDGED_WORDS = _word(JUDGED_END)
SND_UNA_WORD, WRITE_SEQ_WORD, PEER_RWND_WORD, PEER_RWND_MAX_WORD = (
    _word(getattr(KvSockRecord, name).offset)
    for name in ("snd_una", "write_seq", "peer_rwnd", "peer_rwnd_max")
)


# The sample fields a refresh of a lagging row takes from its record's flow (kvwatch.h's
# tail) as they are; rto_us is srtt_us + rttvar_us, and nothing is pending in such a row.
REFRESHED_FIELDS = (
    "wmem_queued",
    "sndbuf",
    "peer_rwnd",
    "peer_rwnd_max",
    "srtt_us",
    "snd_cwnd",
    "retransmits",
    "progress_ns",
    "last_ack_ns",
    "bytes_acked",
)


def flow_dtype(names: tuple[str, ...]) -> np.dtype:
    """A numpy record type over whole kv_sock_records that reads the unsigned members `names`
    in place (the rest of each record skipped)."""
    kinds = {name: kind for name, kind, *_ in KvSockRecord._fields_}
    return np.dtype(
        {
            "names": list(names),
            "formats": [f"<u{ctypes.sizeof(kinds[name])}" for name in names],
            "offsets": [getattr(KvSockRecord, name).offset for name in names],
            "itemsize": RECORD.size,
        }
    )


FLOW_DTYPE = flow_dtype((*REFRESHED_FIELDS, "rttvar_us"))
REFRESHED_POSITIONS = tuple(
    SocketSample._fields.index(name) for name in (*REFRESHED_FIELDS, "rto_us", "observed_ns")
)


def refresh_flows(samples: np.ndarray, rows: np.ndarray, table: np.ndarray, now_ns: int) -> None:
    """Brings the samples at `rows` (idle and healthy, their judged part unchanged, nothing
    pending) up to their records' flow in `table` (the read's bytes, a row a record), in
    place: the flow decoded for all of them at once, each sample copied with it."""
    flows = table.reshape(-1).view(FLOW_DTYPE)[rows]
    columns = [flows[name].tolist() for name in REFRESHED_FIELDS]
    columns.append((flows["srtt_us"].astype(np.uint64) + flows["rttvar_us"]).tolist())
    columns.append([now_ns] * len(rows))
    for index, *values in zip(rows.tolist(), *columns, strict=True):
        fields = list(samples[index])
        for position, value in zip(REFRESHED_POSITIONS, values, strict=True):
            fields[position] = value
        samples[index] = SocketSample._make(fields)


def _last_of_each_key(keys: np.ndarray) -> np.ndarray | None:
    """Row indices keeping, for a key read twice (a record moved while the table was
    read), its last row, in table order; None when every key is read once."""
    ordered = np.sort(keys)
    if not (ordered[1:] == ordered[:-1]).any():
        return None
    _, first_from_end = np.unique(keys[::-1], return_index=True)
    return np.sort(len(keys) - 1 - first_from_end)


class Door(Protocol):
    """What every sample passes before anyone judges it (kvwatch.collect.collectors)."""

    def admit(self, sample: SocketSample) -> SocketSample:
        """The sample as the judge sees it (its owner, state carried over...)."""

    def settled(self, sample: SocketSample) -> bool:
        """Whether `admit` gives this very sample the same answer at every read, until the
        sample itself changes."""


class SampleCache:
    """Samples of every tracked socket, made again only when the judge needs them (module
    docstring). The newest table, each row's sample, when it was made, whether it was idle
    and healthy, and whether it lags its record are kept as arrays aligned with that table's
    rows, so a read decides what to keep in a few vectorised passes over the whole table and
    runs Python only for the records that need a new sample. With a `door`, each row also
    keeps its sample as the door admitted it, admitted again only when the sample is new or
    the door's answer may have moved (not settled): a row kept is the very object the last
    read returned. Owned by one collector; one thread."""

    def __init__(self, door: Door | None = None) -> None:
        self.door = door
        self._keys = np.zeros(0, dtype="<u8")
        self._words = np.zeros((0, RECORD_WORDS), dtype="<u4")
        self._observed = np.zeros(0, dtype=np.int64)
        self._idle = np.zeros(0, dtype=bool)
        self._lagging = np.zeros(0, dtype=bool)
        self._samples = np.zeros(0, dtype=object)
        self._admitted = np.zeros(0, dtype=object)
        self._settled = np.zeros(0, dtype=bool)
        self._endpoints = EndpointCache()

    def update(self, records: bytes, now_ns: int) -> list[SocketSample]:
        """Samples of a read of the whole table (records back to back); records of sockets
        closing as the table was read are left out (their close event removes them)."""
        table = np.frombuffer(records, dtype=np.uint8).reshape(-1, RECORD.size)
        closing = table[:, TCP_STATE_OFFSET] == TCP_CLOSE
        if closing.any():
            table = table[~closing]
        keys = table[:, :8].copy().view("<u8").ravel()
        if not np.array_equal(keys, self._keys) and (last := _last_of_each_key(keys)) is not None:
            table, keys = table[last], keys[last]
        words = table.view("<u4")
        if not len(self._keys):
            kept, lagging, refresh, idle = (np.zeros(len(keys), dtype=bool) for _ in range(4))
            observed = np.full(len(keys), now_ns, dtype=np.int64)
            samples = np.full(len(keys), None, dtype=object)
            admitted, settled = samples.copy(), idle.copy()
        else:
            previous, matched = self._match(keys)
            kept, lagging, refresh = self._kept(words, previous, matched, now_ns)
            observed = np.where(kept, self._observed[previous], now_ns)
            idle = np.where(kept | refresh, self._idle[previous], False)
            samples = self._samples[previous].copy()  # the rows not kept are made below
            admitted = self._admitted[previous].copy()
            settled = kept & self._settled[previous]
            if refresh.any():
                refresh_flows(samples, np.flatnonzero(refresh), table, now_ns)
        view, size = table.reshape(-1).data, RECORD.size
        for index in np.flatnonzero(~(kept | refresh)).tolist():
            raw = view[index * size : (index + 1) * size]
            sample = sample_from_raw(raw, now_ns, self._endpoints)
            samples[index] = sample
            idle[index] = idle_and_healthy(sample)
        self._admit(samples, admitted, settled)
        self._keys, self._words, self._observed = keys, words, observed
        self._idle, self._lagging, self._samples = idle, lagging, samples
        self._admitted, self._settled = admitted, settled
        return admitted.tolist()

    def _admit(self, samples: np.ndarray, admitted: np.ndarray, settled: np.ndarray) -> None:
        """Passes the door every row not `settled` (new, or its answer may have moved), in
        place; without a door, a sample is as it was made."""
        door = self.door
        if door is None:
            admitted[~settled] = samples[~settled]
            settled[:] = True
            return
        for index in np.flatnonzero(~settled).tolist():
            sample = samples[index]
            admitted[index], settled[index] = door.admit(sample), door.settled(sample)

    def _match(self, keys: np.ndarray) -> tuple[np.ndarray | slice, np.ndarray | bool]:
        """For each key, its row in the previous table (not empty; any row where it had
        none) and whether it had one. The table in the same order as before (no socket
        came or went) is every row its own."""
        if np.array_equal(keys, self._keys):
            return slice(None), True
        order = np.argsort(self._keys, kind="stable")
        slots = np.minimum(np.searchsorted(self._keys[order], keys), len(order) - 1)
        previous = order[slots]
        return previous, self._keys[previous] == keys

    def _kept(
        self,
        words: np.ndarray,
        previous: np.ndarray | slice,
        matched: np.ndarray | bool,
        now_ns: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Which rows keep their previous sample, which of those lag their record, and which
        are refreshed: kept where the record is unchanged and its sample not lagging past
        FLOW_REFRESH_NS, or only its flow moved on a socket idle and healthy at its sample and
        with nothing pending now; refreshed where only the age of its sample stops that."""
        differs = words != self._words[previous]
        unchanged = ~differs.any(axis=1)
        judged_unchanged = ~differs[:, :JUDGED_WORDS].any(axis=1)
        fresh = now_ns - self._observed[previous] < FLOW_REFRESH_NS
        was_lagging = self._lagging[previous]
        nothing_pending = words[:, SND_UNA_WORD] == words[:, WRITE_SEQ_WORD]
        window = words[:, PEER_RWND_WORD].astype(np.int64) + SHORTFALL_BYTES
        no_shortfall = window >= words[:, PEER_RWND_MAX_WORD]
        kept_unchanged = matched & unchanged & (fresh | ~was_lagging)
        kept_flow = (
            matched & ~unchanged & fresh & self._idle[previous] & judged_unchanged
            & nothing_pending & no_shortfall
        )  # fmt: skip
        lagging = kept_flow | (kept_unchanged & was_lagging)
        kept = kept_unchanged | kept_flow
        refresh = (
            matched & ~kept & judged_unchanged & self._idle[previous]
            & nothing_pending & no_shortfall
        )  # fmt: skip
        return kept, lagging, refresh

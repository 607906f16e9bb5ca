"""Python mirror of bpf/kvwatch.h. Keep both in step: tests compare this file with the BTF of
the compiled object, member by member."""

from __future__ import annotations

import ctypes
from ctypes import c_char, c_uint8, c_uint16, c_uint32, c_uint64

MAX_FILTER_PORTS = 16
COMM_LEN = 16

EVENT_ZERO_WINDOW_START = 1
EVENT_ZERO_WINDOW_END = 2
EVENT_SNDBUF_FULL_START = 3
EVENT_SNDBUF_FULL_END = 4
EVENT_CLOSE = 5
EVENT_ZERO_WINDOW_ANSWER = 6

EVENT_NAMES = {
    EVENT_ZERO_WINDOW_START: "zero_window_start",
    EVENT_ZERO_WINDOW_END: "zero_window_end",
    EVENT_SNDBUF_FULL_START: "sndbuf_full_start",
    EVENT_SNDBUF_FULL_END: "sndbuf_full_end",
    EVENT_CLOSE: "close",
    EVENT_ZERO_WINDOW_ANSWER: "zero_window_answer",
}

STAT_NAMES = (
    "events_sent",
    "events_dropped",
    "records_created",
    "records_deleted",
    "records_failed",
)


class KvEndpoints(ctypes.Structure):
    """struct kv_endpoints: one side's view of a connection (its address first)."""

    _fields_ = [
        ("saddr", c_uint8 * 16),
        ("daddr", c_uint8 * 16),
        ("sport", c_uint16),
        ("dport", c_uint16),
        ("family", c_uint16),
        ("reserved", c_uint16),
    ]


class KvSockRecord(ctypes.Structure):
    """struct kv_sock_record: one tracked TCP socket; the flow (what a healthy stream's
    writes and ACKs move) last, together."""

    _fields_ = [
        ("sk", c_uint64),
        ("first_seen_ns", c_uint64),
        ("first_send_ns", c_uint64),
        ("first_acked_ns", c_uint64),
        ("zero_window_since_ns", c_uint64),
        ("zero_window_total_ns", c_uint64),
        ("last_zero_window_end_ns", c_uint64),
        ("sndbuf_full_since_ns", c_uint64),
        ("sndbuf_full_total_ns", c_uint64),
        ("inode", c_uint64),
        ("feeder_sk", c_uint64),
        ("feeder_candidate_sk", c_uint64),
        ("fed_ns", c_uint64),
        ("feeder", KvEndpoints),
        ("netns", c_uint32),
        ("tgid", c_uint32),
        ("zero_window_probes", c_uint32),
        ("zero_window_episodes", c_uint32),
        ("sndbuf_full_episodes", c_uint32),
        ("feeds", c_uint32),
        ("feeder_misses", c_uint32),
        ("saddr", c_uint8 * 16),
        ("daddr", c_uint8 * 16),
        ("sport", c_uint16),
        ("dport", c_uint16),
        ("family", c_uint16),
        ("tcp_state", c_uint8),
        ("probe_backoff", c_uint8),
        ("comm", c_char * COMM_LEN),
        ("snd_una", c_uint32),
        ("snd_nxt", c_uint32),
        ("write_seq", c_uint32),
        ("peer_rwnd", c_uint32),
        ("peer_rwnd_max", c_uint32),
        ("rttvar_us", c_uint32),
        ("srtt_us", c_uint32),
        ("snd_cwnd", c_uint32),
        ("wmem_queued", c_uint32),
        ("sndbuf", c_uint32),
        ("retransmits", c_uint32),
        ("last_send_ns", c_uint64),
        ("last_ack_ns", c_uint64),
        ("progress_ns", c_uint64),
        ("send_bytes", c_uint64),
        ("send_calls", c_uint64),
        ("acks", c_uint64),
        ("bytes_acked", c_uint64),
    ]


class KvEvent(ctypes.Structure):
    """struct kv_event: an edge, with the socket's record as of that edge."""

    _fields_ = [
        ("ts_ns", c_uint64),
        ("type", c_uint32),
        ("reserved", c_uint32),
        ("record", KvSockRecord),
    ]


class KvThreadRead(ctypes.Structure):
    """struct kv_thread_read: a thread's newest read (the kv_reads map's value)."""

    _fields_ = [
        ("sk", c_uint64),
        ("read_ns", c_uint64),
        ("endpoints", KvEndpoints),
    ]


class KvSettings(ctypes.Structure):
    """struct kv_settings: load-time filters; zero means off."""

    _fields_ = [
        ("filter_cgroup_id", c_uint64),
        ("filter_tgid", c_uint32),
        ("filter_port_count", c_uint32),
        ("filter_ports", c_uint16 * MAX_FILTER_PORTS),
    ]


MIRRORED_STRUCTS: dict[str, type[ctypes.Structure]] = {
    "kv_endpoints": KvEndpoints,
    "kv_sock_record": KvSockRecord,
    "kv_thread_read": KvThreadRead,
    "kv_event": KvEvent,
    "kv_settings": KvSettings,
}

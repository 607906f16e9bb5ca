/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Structs shared by the BPF programs and kvwatch's Python mirror (kvwatch/collect/bpf/layout.py).
 * Fixed-width types, each aligned to its size, no hidden padding: tests check the Python mirror against
 * the BTF of the compiled object. Change both sides together.
 */
#ifndef KVWATCH_H
#define KVWATCH_H

#define KV_MAX_FILTER_PORTS 16
#define KV_COMM_LEN 16
#define KV_DEFAULT_MAX_SOCKETS 16384
#define KV_DEFAULT_MAX_THREADS 16384	/* threads whose newest read is remembered */
#define KV_WRITER_WORDS 65536		/* kv_writers: one bit per tgid below 2^22 */
#define KV_EVENTS_BYTES (256 * 1024)

/* Edge events sent over the ring buffer. */
enum kv_event_type {
	KV_EVENT_ZERO_WINDOW_START = 1,
	KV_EVENT_ZERO_WINDOW_END = 2,
	KV_EVENT_SNDBUF_FULL_START = 3,
	KV_EVENT_SNDBUF_FULL_END = 4,
	KV_EVENT_CLOSE = 5,
	KV_EVENT_ZERO_WINDOW_ANSWER = 6,	/* a segment during a zero window, still shut */
};

/* A write follows a read (relay pairing) only when the read came at most this long before. */
#define KV_RELAY_WINDOW_NS 1000000000ULL

/* Answers during one zero window closer together than this send no further event. */
#define KV_ZERO_WINDOW_ANSWER_GAP_NS 100000000ULL

/* Indexes of the per-CPU counters in the kv_stats map. */
enum kv_stat {
	KV_STAT_EVENTS_SENT = 0,
	KV_STAT_EVENTS_DROPPED = 1,
	KV_STAT_RECORDS_CREATED = 2,
	KV_STAT_RECORDS_DELETED = 3,
	KV_STAT_RECORDS_FAILED = 4,
	KV_STAT_COUNT = 5,
};

/* One side's view of a TCP connection: its own address and port, then its peer's. */
struct kv_endpoints {
	__u8 saddr[16];			/* IPv4 in the first 4 bytes */
	__u8 daddr[16];
	__u16 sport;			/* host byte order */
	__u16 dport;			/* host byte order */
	__u16 family;
	__u16 reserved;
};

/*
 * One tracked TCP socket. Counters are cumulative; *_since_ns is 0 when no episode is open.
 * Relay pairing (a proxy): a write on this socket by a thread whose newest read, at most
 * KV_RELAY_WINDOW_NS before, came from another socket makes that socket a candidate feeder;
 * a candidate seen on two writes in a row becomes the feeder, so one stray read never
 * re-pairs a socket.
 */
struct kv_sock_record {
	/* What the judge reads: a change here makes the agent build the socket's sample anew. */
	__u64 sk;			/* kernel address of struct sock (the map key) */
	__u64 first_seen_ns;		/* CLOCK_MONOTONIC, like every *_ns field */
	__u64 first_send_ns;		/* the first write seen on the socket */
	__u64 first_acked_ns;		/* the first ACK of data: the client got its first byte */
	__u64 zero_window_since_ns;
	__u64 zero_window_total_ns;	/* closed episodes only */
	__u64 last_zero_window_end_ns;
	__u64 sndbuf_full_since_ns;
	__u64 sndbuf_full_total_ns;	/* closed episodes only */
	__u64 inode;			/* socket inode: joins /proc/<pid>/fd and sock_diag */
	__u64 feeder_sk;		/* the socket whose data this one relays (0: none yet) */
	__u64 feeder_candidate_sk;	/* the newest other socket read before a write here */
	__u64 fed_ns;			/* the newest write that followed a read from the feeder */
	struct kv_endpoints feeder;	/* feeder_sk's addresses, as the feeder sees them (8-aligned: copied whole) */
	__u32 netns;			/* network namespace inode */
	__u32 tgid;			/* last process that sent on it; 0 until one does */
	__u32 zero_window_probes;
	__u32 zero_window_episodes;
	__u32 sndbuf_full_episodes;
	__u32 feeds;			/* writes after a read from the feeder, since it became one */
	__u32 feeder_misses;		/* writes after a read from another socket, since then */
	__u8 saddr[16];			/* IPv4 in the first 4 bytes */
	__u8 daddr[16];
	__u16 sport;			/* host byte order */
	__u16 dport;			/* host byte order */
	__u16 family;
	__u8 tcp_state;
	__u8 probe_backoff;		/* icsk_backoff: probes (or RTOs) since the flow last moved */
	char comm[KV_COMM_LEN];
	/*
	 * The flow: what every write and ACK of a healthy stream moves. Last and together, so
	 * the agent tells a flow-only change from one the judge reads by one range of bytes
	 * (kvwatch/collect/bpf/records.py, FLOW_FIELDS).
	 */
	__u32 snd_una;
	__u32 snd_nxt;
	__u32 write_seq;
	__u32 peer_rwnd;		/* peer's receive window in bytes, as of the newest ACK */
	__u32 peer_rwnd_max;		/* largest window the peer ever advertised (tp->max_window) */
	__u32 rttvar_us;		/* RTT variation; rto = srtt + rttvar (zero-window probe base) */
	__u32 srtt_us;
	__u32 snd_cwnd;
	__u32 wmem_queued;
	__u32 sndbuf;
	__u32 retransmits;
	__u64 last_send_ns;
	__u64 last_ack_ns;
	__u64 progress_ns;		/* ACK point moved, or data became pending on an idle socket */
	__u64 send_bytes;
	__u64 send_calls;
	__u64 acks;
	__u64 bytes_acked;		/* cumulative: the progress counter sock_diag also reports */
};

struct kv_event {
	__u64 ts_ns;
	__u32 type;			/* enum kv_event_type */
	__u32 reserved;
	struct kv_sock_record record;	/* the socket as of the edge */
};

/* Per thread: the socket it read from last (kv_reads map, keyed by pid_tgid). */
struct kv_thread_read {
	__u64 sk;
	__u64 read_ns;
	struct kv_endpoints endpoints;
};

/* Load-time settings (read-only data). Zero means "off" for every filter. */
struct kv_settings {
	__u64 filter_cgroup_id;
	__u32 filter_tgid;
	__u32 filter_port_count;
	__u16 filter_ports[KV_MAX_FILTER_PORTS];
};

#endif /* KVWATCH_H */

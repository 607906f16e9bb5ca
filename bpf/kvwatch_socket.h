/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The per-socket logic of kvwatch, shared by every handler and by every build of the programs.
 * This header holds what never reads kernel memory (record bookkeeping, edge events);
 * kvwatch_handlers.h holds the handlers that do, once per way of reading. The includer supplies
 * the toolchain-specific primitives first:
 *   KV_SETTING(name)                a load-time setting of struct kv_settings
 *   KV_NOW()                        CLOCK_MONOTONIC nanoseconds
 *   KV_SOCKETS_LOOKUP(key), KV_SOCKETS_INSERT(key, rec), KV_SOCKETS_DELETE(key)
 *   KV_EVENT_RESERVE(), KV_EVENT_SUBMIT(ev), KV_STAT_ADD(index)
 *   KV_READS_LOOKUP(thread), KV_READS_UPDATE(thread, value)   the per-thread last read
 *   KV_WRITERS_WORD(index)          the kv_writers bitmap's 64-bit word `*index`
 */
#ifndef KVWATCH_SOCKET_H
#define KVWATCH_SOCKET_H

#include "kvwatch.h"

#define KV_AF_INET 2
#define KV_AF_INET6 10
#define KV_IPPROTO_TCP 6
#define KV_TCP_ESTABLISHED 1
#define KV_TCP_CLOSE 7
#define KV_TCP_CLOSE_WAIT 8
#define KV_EEXIST 17
#define KV_ENOMEM 12

/* A socket's send side as one handler sees it, before it is folded into the record. */
struct kv_tcp_view {
	__u64 bytes_acked;
	__u32 snd_una;
	__u32 snd_nxt;
	__u32 write_seq;
	__u32 peer_rwnd;
	__u32 peer_rwnd_max;
	__u32 srtt_us;
	__u32 rttvar_us;
	__u32 snd_cwnd;
	__u32 wmem_queued;
	__u32 sndbuf;
	__u8 probe_backoff;
	bool sndbuf_full;
};

/* The first 16 bytes of a TCP header (ports, seq, ack, flags, window), in wire order. */
struct kv_tcp_header {
	__be16 source;
	__be16 dest;
	__be32 seq;
	__be32 ack_seq;
	__u8 data_offset;
	__u8 flags;
	__be16 window;
};

/* What the ACK path uses of one incoming segment: host order, window scaled. */
struct kv_segment {
	__u32 seq;
	__u32 ack;
	__u32 window;
};

#define KV_TCP_FLAG_SYN 0x02
#define KV_TCP_FLAG_ACK 0x10

/*
 * The send buffer counts as full when the kernel would not report the socket writable:
 * free space below half of what is queued (sk_stream_is_writeable), i.e. more than 2/3 of
 * sk_sndbuf in use. A writer blocked in send() or waiting for EPOLLOUT sits above it.
 */
static __always_inline bool kv_sndbuf_full(__u64 wmem_queued, __u64 sndbuf)
{
	return 3 * wmem_queued > 2 * sndbuf;
}

static __always_inline bool kv_seq_after(__u32 a, __u32 b)
{
	return (__s32)(a - b) > 0;
}

static __always_inline bool kv_process_filter_on(void)
{
	return KV_SETTING(filter_tgid) != 0 || KV_SETTING(filter_cgroup_id) != 0;
}
static __always_inline bool kv_process_allowed(void)
{
	__u32 tgid = KV_SETTING(filter_tgid);
	__u64 cgroup_id = KV_SETTING(filter_cgroup_id);

	if (tgid && (bpf_get_current_pid_tgid() >> 32) != tgid)
		return false;
	if (cgroup_id && bpf_get_current_cgroup_id() != cgroup_id)
		return false;
	return true;
}
static __always_inline void kv_emit(const struct kv_sock_record *rec, __u32 type, __u64 now)
{
	struct kv_event *ev = KV_EVENT_RESERVE();

	if (!ev) {
		KV_STAT_ADD(KV_STAT_EVENTS_DROPPED);
		return;
	}
	ev->ts_ns = now;
	ev->type = type;
	ev->reserved = 0;
	__builtin_memcpy(&ev->record, rec, sizeof(*rec));
	KV_EVENT_SUBMIT(ev);
	KV_STAT_ADD(KV_STAT_EVENTS_SENT);
}
/*
 * Relay pairing needs only the reads of processes that write to a tracked socket. Each
 * tracked write sets its process's bit (a plain OR: a bit lost to a concurrent OR on another
 * CPU is set again by the process's next write); the read handler tests it first, so every
 * other read on the node costs one array lookup, which the verifier inlines. Tgids past the
 * bitmap (pid_max above 2^22) are always read.
 */
static __always_inline bool kv_is_writer(__u32 tgid)
{
	__u32 index = tgid / 64;
	__u64 *word;

	if (index >= KV_WRITER_WORDS)
		return true;
	word = KV_WRITERS_WORD(&index);
	return word && (*word & (1ULL << (tgid % 64)));
}
static __always_inline void kv_mark_writer(__u32 tgid)
{
	__u32 index = tgid / 64;
	__u64 bit = 1ULL << (tgid % 64);
	__u64 *word;

	if (index >= KV_WRITER_WORDS)
		return;
	word = KV_WRITERS_WORD(&index);
	if (word && !(*word & bit))
		*word |= bit;
}
/*
 * Relay pairing, on a write to `rec`'s socket by `thread` (pid_tgid): the thread's newest read
 * (if recent and from another socket) confirms the feeder, or names a candidate; a candidate
 * seen on two writes in a row replaces the feeder (kvwatch.h, struct kv_sock_record).
 */
static __always_inline void kv_note_feeder(struct kv_sock_record *rec, __u64 thread, __u64 now)
{
	struct kv_thread_read *last = KV_READS_LOOKUP(&thread);

	if (!last || last->sk == rec->sk || now - last->read_ns > KV_RELAY_WINDOW_NS)
		return;
	if (last->sk == rec->feeder_sk) {
		rec->feeds++;
		rec->fed_ns = now;
		rec->feeder_candidate_sk = 0;
	} else if (last->sk == rec->feeder_candidate_sk) {
		rec->feeder_sk = last->sk;
		__builtin_memcpy(&rec->feeder, &last->endpoints, sizeof(rec->feeder));
		rec->feeds = 2;
		rec->feeder_misses = 0;
		rec->fed_ns = now;
	} else {
		rec->feeder_candidate_sk = last->sk;
		rec->feeder_misses++;
	}
}
/* Folds one view into the record: progress clock, episodes, and their edge events. */
static __always_inline void kv_commit(struct kv_sock_record *rec, const struct kv_tcp_view *view,
				      __u64 now)
{
	bool was_pending = rec->write_seq != rec->snd_una;
	bool pending = view->write_seq != view->snd_una;
	bool zero_window = view->peer_rwnd == 0;
	/* A new record holds no sequence numbers yet: its first view is not progress. */
	bool fresh = !rec->snd_una && !rec->snd_nxt && !rec->write_seq;
	bool advanced = !fresh && kv_seq_after(view->snd_una, rec->snd_una);

	if (advanced || (pending && !was_pending))
		rec->progress_ns = now;
	if (advanced && rec->first_send_ns && !rec->first_acked_ns)
		rec->first_acked_ns = now;
	rec->bytes_acked = view->bytes_acked;
	rec->snd_una = view->snd_una;
	rec->snd_nxt = view->snd_nxt;
	rec->write_seq = view->write_seq;
	rec->peer_rwnd = view->peer_rwnd;
	rec->peer_rwnd_max = view->peer_rwnd_max > view->peer_rwnd ? view->peer_rwnd_max
								 : view->peer_rwnd;
	rec->srtt_us = view->srtt_us;
	rec->rttvar_us = view->rttvar_us;
	rec->probe_backoff = view->probe_backoff;
	rec->snd_cwnd = view->snd_cwnd;
	rec->wmem_queued = view->wmem_queued;
	rec->sndbuf = view->sndbuf;

	if (zero_window && !rec->zero_window_since_ns) {
		rec->zero_window_since_ns = now;
		rec->zero_window_episodes++;
		kv_emit(rec, KV_EVENT_ZERO_WINDOW_START, now);
	} else if (!zero_window && rec->zero_window_since_ns) {
		rec->zero_window_total_ns += now - rec->zero_window_since_ns;
		rec->zero_window_since_ns = 0;
		rec->last_zero_window_end_ns = now;
		kv_emit(rec, KV_EVENT_ZERO_WINDOW_END, now);
	}
	if (view->sndbuf_full && !rec->sndbuf_full_since_ns) {
		rec->sndbuf_full_since_ns = now;
		rec->sndbuf_full_episodes++;
		kv_emit(rec, KV_EVENT_SNDBUF_FULL_START, now);
	} else if (!view->sndbuf_full && rec->sndbuf_full_since_ns) {
		rec->sndbuf_full_total_ns += now - rec->sndbuf_full_since_ns;
		rec->sndbuf_full_since_ns = 0;
		kv_emit(rec, KV_EVENT_SNDBUF_FULL_END, now);
	}
}
#endif /* KVWATCH_SOCKET_H */

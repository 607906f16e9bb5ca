/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The per-socket logic of kvwatch, shared by every hook and by every build of the programs.
 * The includer supplies the toolchain-specific primitives first:
 *   KV_READ(dst, ptr, field)        read ptr->field (a path inside one struct) into *dst
 *   KV_READ_BITFIELD(ptr, field)    value of an integer or bitfield member
 *   KV_SETTING(name)                a load-time setting of struct kv_settings
 *   KV_SOCKETS_LOOKUP(key), KV_SOCKETS_INSERT(key, rec), KV_SOCKETS_DELETE(key)
 *   KV_EVENT_RESERVE(), KV_EVENT_SUBMIT(ev), KV_STAT_ADD(index)
 */
#ifndef KVWATCH_SOCKET_H
#define KVWATCH_SOCKET_H

#include "kvwatch.h"

#define KV_AF_INET 2
#define KV_AF_INET6 10
#define KV_IPPROTO_TCP 6
#define KV_TCP_ESTABLISHED 1
#define KV_TCP_CLOSE 7
#define KV_EEXIST 17

/* A socket's send side as one hook sees it, before it is folded into the record. */
struct kv_tcp_view {
	__u64 bytes_acked;
	__u32 snd_una;
	__u32 snd_nxt;
	__u32 write_seq;
	__u32 peer_rwnd;
	__u32 srtt_us;
	__u32 snd_cwnd;
	__u32 wmem_queued;
	__u32 sndbuf;
	bool sndbuf_full;
};

/* The 8 bytes of a TCP header kvwatch needs (seq, ack, flags, window), in wire order. */
struct kv_tcp_header {
	__be16 source;
	__be16 dest;
	__be32 seq;
	__be32 ack_seq;
	__u8 data_offset;
	__u8 flags;
	__be16 window;
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

/* Filters run before any map work, so unrelated sockets cost a few instructions. */
static __always_inline bool kv_port_allowed(struct sock *sk)
{
	__u32 count = KV_SETTING(filter_port_count);
	__u16 port = 0;

	if (count == 0)
		return true;
	KV_READ(&port, sk, __sk_common.skc_num);
	for (__u32 i = 0; i < KV_MAX_FILTER_PORTS; i++) {
		if (i >= count)
			break;
		if (KV_SETTING(filter_ports[i]) == port)
			return true;
	}
	return false;
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

static __always_inline __u64 kv_read_inode(struct sock *sk)
{
	struct socket *sock = NULL;
	struct file *file = NULL;
	struct inode *inode = NULL;
	unsigned long ino = 0;

	KV_READ(&sock, sk, sk_socket);
	if (!sock)
		return 0;
	KV_READ(&file, sock, file);
	if (!file)
		return 0;
	KV_READ(&inode, file, f_inode);
	if (!inode)
		return 0;
	KV_READ(&ino, inode, i_ino);
	return ino;
}

/* Identity of a new record: addresses, ports, namespace. Counters start at zero. */
static __always_inline void kv_record_init(struct kv_sock_record *rec, struct sock *sk, __u64 now)
{
	struct net *net = NULL;
	__be16 dport = 0;

	rec->sk = (__u64)sk;
	rec->first_seen_ns = now;
	rec->progress_ns = now;
	KV_READ(&rec->family, sk, __sk_common.skc_family);
	KV_READ(&rec->sport, sk, __sk_common.skc_num);
	KV_READ(&dport, sk, __sk_common.skc_dport);
	rec->dport = bpf_ntohs(dport);
	KV_READ(&rec->tcp_state, sk, __sk_common.skc_state);
	if (rec->family == KV_AF_INET6) {
		KV_READ(&rec->saddr, sk, __sk_common.skc_v6_rcv_saddr);
		KV_READ(&rec->daddr, sk, __sk_common.skc_v6_daddr);
	} else {
		KV_READ((__be32 *)rec->saddr, sk, __sk_common.skc_rcv_saddr);
		KV_READ((__be32 *)rec->daddr, sk, __sk_common.skc_daddr);
	}
	KV_READ(&net, sk, __sk_common.skc_net.net);
	if (net)
		KV_READ(&rec->netns, net, ns.inum);
	rec->inode = kv_read_inode(sk);
}

static __always_inline struct kv_sock_record *kv_record_create(struct sock *sk, __u64 now)
{
	struct kv_sock_record rec = {};
	__u64 key = (__u64)sk;
	long err;

	kv_record_init(&rec, sk, now);
	err = KV_SOCKETS_INSERT(&key, &rec);
	if (err == 0)
		KV_STAT_ADD(KV_STAT_RECORDS_CREATED);
	else if (err != -KV_EEXIST)
		KV_STAT_ADD(KV_STAT_RECORDS_FAILED);
	return KV_SOCKETS_LOOKUP(&key);
}

static __always_inline void kv_read_view(struct sock *sk, struct kv_tcp_view *view)
{
	struct tcp_sock *tp = (struct tcp_sock *)sk;
	int wmem_queued = 0, sndbuf = 0;

	KV_READ(&view->bytes_acked, tp, bytes_acked);
	KV_READ(&view->snd_una, tp, snd_una);
	KV_READ(&view->snd_nxt, tp, snd_nxt);
	KV_READ(&view->write_seq, tp, write_seq);
	KV_READ(&view->peer_rwnd, tp, snd_wnd);
	KV_READ(&view->srtt_us, tp, srtt_us);
	view->srtt_us >>= 3;
	KV_READ(&view->snd_cwnd, tp, snd_cwnd);
	KV_READ(&wmem_queued, sk, sk_wmem_queued);
	KV_READ(&sndbuf, sk, sk_sndbuf);
	view->wmem_queued = wmem_queued > 0 ? wmem_queued : 0;
	view->sndbuf = sndbuf > 0 ? sndbuf : 0;
}

/*
 * tcp_probe fires before tcp_rcv_established processes the segment, so the socket still shows
 * the previous ACK. Apply this segment's ACK and window the way tcp_ack() is about to, so the
 * end of a zero-window episode is seen on the window update itself. Returns true when the
 * segment acknowledges new data.
 */
static __always_inline bool kv_apply_segment(struct sock *sk, struct sk_buff *skb,
					     struct kv_tcp_view *view)
{
	struct tcp_sock *tp = (struct tcp_sock *)sk;
	struct kv_tcp_header th = {};
	unsigned char *data = NULL;
	__u32 ack, seq, snd_wl1 = 0, window;
	bool acked_new;

	KV_READ(&data, skb, data);
	if (!data || bpf_probe_read_kernel(&th, sizeof(th), data))
		return false;
	if (!(th.flags & KV_TCP_FLAG_ACK))
		return false;
	ack = bpf_ntohl(th.ack_seq);
	seq = bpf_ntohl(th.seq);
	window = bpf_ntohs(th.window);
	if (!(th.flags & KV_TCP_FLAG_SYN))
		window <<= KV_READ_BITFIELD(&tp->rx_opt, snd_wscale);
	KV_READ(&snd_wl1, tp, snd_wl1);

	acked_new = kv_seq_after(ack, view->snd_una) && !kv_seq_after(ack, view->snd_nxt);
	if (acked_new || kv_seq_after(seq, snd_wl1) ||
	    (seq == snd_wl1 && (window > view->peer_rwnd || window == 0)))
		view->peer_rwnd = window;
	if (acked_new) {
		view->bytes_acked += ack - view->snd_una;
		view->snd_una = ack;
	}
	return acked_new;
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

/* Folds one view into the record: progress clock, episodes, and their edge events. */
static __always_inline void kv_commit(struct kv_sock_record *rec, const struct kv_tcp_view *view,
				      __u64 now)
{
	bool was_pending = rec->write_seq != rec->snd_una;
	bool pending = view->write_seq != view->snd_una;
	bool zero_window = view->peer_rwnd == 0;

	if (kv_seq_after(view->snd_una, rec->snd_una) || (pending && !was_pending))
		rec->progress_ns = now;
	rec->bytes_acked = view->bytes_acked;
	rec->snd_una = view->snd_una;
	rec->snd_nxt = view->snd_nxt;
	rec->write_seq = view->write_seq;
	rec->peer_rwnd = view->peer_rwnd;
	rec->srtt_us = view->srtt_us;
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

/*
 * Send path. At entry (fentry, kprobe) `bytes` is what the caller asks to write and counts as
 * queued already; at exit (sock_send_length) `bytes` is what was written.
 */
static __always_inline int kv_on_send(struct sock *sk, long bytes, bool at_entry)
{
	struct kv_sock_record *rec;
	struct kv_tcp_view view;
	__u64 key = (__u64)sk;
	__u64 now;
	__u32 tgid;
	bool idle_before;

	if (!kv_process_allowed() || !kv_port_allowed(sk))
		return 0;
	now = bpf_ktime_get_ns();
	rec = KV_SOCKETS_LOOKUP(&key);
	if (!rec)
		rec = kv_record_create(sk, now);
	if (!rec)
		return 0;
	kv_read_view(sk, &view);
	idle_before = view.write_seq == view.snd_una;
	view.sndbuf_full = kv_sndbuf_full(view.wmem_queued + (at_entry && bytes > 0 ? bytes : 0),
					  view.sndbuf);
	tgid = bpf_get_current_pid_tgid() >> 32;
	if (rec->tgid != tgid) {
		rec->tgid = tgid;
		bpf_get_current_comm(&rec->comm, sizeof(rec->comm));
	}
	rec->last_send_ns = now;
	rec->send_calls++;
	if (bytes > 0)
		rec->send_bytes += bytes;
	if (!rec->inode)
		rec->inode = kv_read_inode(sk);
	kv_commit(rec, &view, now);
	if (at_entry && bytes > 0 && idle_before)
		rec->progress_ns = now;
	return 0;
}

/* ACK path (tcp_probe): every segment an established socket receives. */
static __always_inline int kv_on_segment(struct sock *sk, struct sk_buff *skb)
{
	struct kv_sock_record *rec;
	struct kv_tcp_view view;
	__u64 key = (__u64)sk;
	__u64 now;
	bool acked_new;

	if (!kv_port_allowed(sk))
		return 0;
	now = bpf_ktime_get_ns();
	rec = KV_SOCKETS_LOOKUP(&key);
	if (!rec && !kv_process_filter_on())
		rec = kv_record_create(sk, now);
	if (!rec)
		return 0;
	kv_read_view(sk, &view);
	acked_new = kv_apply_segment(sk, skb, &view);
	view.sndbuf_full = !acked_new && kv_sndbuf_full(view.wmem_queued, view.sndbuf);
	rec->acks++;
	rec->last_ack_ns = now;
	kv_commit(rec, &view, now);
	return 0;
}

/*
 * Lifecycle: records are created when a connection is established and removed at close.
 * Filters decide only what starts being tracked: by the time a socket closes the kernel may
 * already have released its local port (skc_num reads 0), so a tracked socket is followed by
 * its key alone.
 */
static __always_inline int kv_on_state(struct sock *sk, int new_state)
{
	struct kv_sock_record *rec;
	__u64 key = (__u64)sk;
	__u64 now;

	if (KV_READ_BITFIELD(sk, sk_protocol) != KV_IPPROTO_TCP)
		return 0;
	now = bpf_ktime_get_ns();
	rec = KV_SOCKETS_LOOKUP(&key);
	if (!rec && new_state == KV_TCP_ESTABLISHED && !kv_process_filter_on() &&
	    kv_port_allowed(sk))
		rec = kv_record_create(sk, now);
	if (!rec)
		return 0;
	rec->tcp_state = new_state;
	if (new_state != KV_TCP_CLOSE)
		return 0;
	kv_emit(rec, KV_EVENT_CLOSE, now);
	if (KV_SOCKETS_DELETE(&key) == 0)
		KV_STAT_ADD(KV_STAT_RECORDS_DELETED);
	return 0;
}

static __always_inline int kv_on_retransmit(struct sock *sk)
{
	__u64 key = (__u64)sk;
	struct kv_sock_record *rec;

	if (!kv_port_allowed(sk))
		return 0;
	rec = KV_SOCKETS_LOOKUP(&key);
	if (rec)
		rec->retransmits++;
	return 0;
}

static __always_inline int kv_on_zero_window_probe(struct sock *sk)
{
	__u64 key = (__u64)sk;
	struct kv_sock_record *rec;

	if (!kv_port_allowed(sk))
		return 0;
	rec = KV_SOCKETS_LOOKUP(&key);
	if (rec)
		rec->zero_window_probes++;
	return 0;
}

#endif /* KVWATCH_SOCKET_H */

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * kvwatch's handlers, one per attach point, written once and compiled once per way of reading kernel memory.
 * No include guard: the includer defines, then includes this file, for each flavour:
 *   KV_FN(name)                     the flavour's name for a handler (e.g. name##_btf)
 *   KV_READ(dst, ptr, field)        read ptr->field (a path inside one struct) into *dst
 *   KV_READ_BYTES(dst, ptr, field)  copy an array or struct member into the array dst
 *                                   (dst is the array itself, not a pointer to it)
 *   KV_SK_PROTOCOL(sk)              sk->sk_protocol (a bitfield before Linux 5.6)
 *   KV_SND_WSCALE(tp)               tp->rx_opt.snd_wscale (a 4-bit bitfield)
 *   KV_TCP_SOCK(sk)                 sk as struct tcp_sock *, or NULL when it is not TCP
 * The CO-RE build (kvwatch.bpf.c) has two flavours: BTF-typed programs (fentry, tp_btf) read
 * with plain loads, kprobe and raw_tp programs through bpf_probe_read_kernel; both relocate
 * every field with CO-RE. The BCC build (kvwatch_bcc.c) reads through bpf_probe_read_kernel
 * at offsets its compiler took from the running kernel's headers.
 */

/* Filters run before any map work, so unrelated sockets cost a few instructions. */
static __always_inline bool KV_FN(kv_port_allowed)(struct sock *sk)
{
	__u32 count = KV_SETTING(filter_port_count);
	__u16 port = 0;

	if (count == 0)
		return true;
	KV_READ(&port, sk, __sk_common.skc_num);
	/* A constant trip count, unrolled: where the settings live in a map (BCC) the verifier
	 * could not bound a loop that exits at `count`. */
#pragma unroll
	for (__u32 i = 0; i < KV_MAX_FILTER_PORTS; i++) {
		if (i < count && KV_SETTING(filter_ports[i]) == port)
			return true;
	}
	return false;
}
static __always_inline __u64 KV_FN(kv_read_inode)(struct sock *sk)
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
static __always_inline void KV_FN(kv_read_endpoints)(struct sock *sk, struct kv_endpoints *ep)
{
	__be16 dport = 0;

	KV_READ(&ep->family, sk, __sk_common.skc_family);
	KV_READ(&ep->sport, sk, __sk_common.skc_num);
	KV_READ(&dport, sk, __sk_common.skc_dport);
	ep->dport = bpf_ntohs(dport);
	if (ep->family == KV_AF_INET6) {
		KV_READ_BYTES(ep->saddr, sk, __sk_common.skc_v6_rcv_saddr);
		KV_READ_BYTES(ep->daddr, sk, __sk_common.skc_v6_daddr);
	} else {
		KV_READ((__be32 *)ep->saddr, sk, __sk_common.skc_rcv_saddr);
		KV_READ((__be32 *)ep->daddr, sk, __sk_common.skc_daddr);
	}
}
/* Identity of a new record: addresses, ports, namespace. Counters start at zero. */
static __always_inline void KV_FN(kv_record_init)(struct kv_sock_record *rec, struct sock *sk, __u64 now)
{
	struct kv_endpoints ep = {};
	struct net *net = NULL;

	rec->sk = (__u64)sk;
	rec->first_seen_ns = now;
	rec->progress_ns = now;
	KV_FN(kv_read_endpoints)(sk, &ep);
	__builtin_memcpy(rec->saddr, ep.saddr, sizeof(rec->saddr));
	__builtin_memcpy(rec->daddr, ep.daddr, sizeof(rec->daddr));
	rec->sport = ep.sport;
	rec->dport = ep.dport;
	rec->family = ep.family;
	KV_READ(&rec->tcp_state, sk, __sk_common.skc_state);
	KV_READ(&net, sk, __sk_common.skc_net.net);
	if (net)
		KV_READ(&rec->netns, net, ns.inum);
	rec->inode = KV_FN(kv_read_inode)(sk);
}
static __always_inline struct kv_sock_record *KV_FN(kv_record_create)(struct sock *sk, __u64 now)
{
	struct kv_sock_record rec = {};
	__u64 key = (__u64)sk;
	long err;

	KV_FN(kv_record_init)(&rec, sk, now);
	err = KV_SOCKETS_INSERT(&key, &rec);
	if (err == 0)
		KV_STAT_ADD(KV_STAT_RECORDS_CREATED);
	else if (err != -KV_EEXIST)
		KV_STAT_ADD(KV_STAT_RECORDS_FAILED);
	return KV_SOCKETS_LOOKUP(&key);
}
/* The send side of `sk`, read through `tp` (KV_TCP_SOCK(sk), which each handler gets once). */
static __always_inline bool KV_FN(kv_read_view)(struct sock *sk, struct tcp_sock *tp,
						struct kv_tcp_view *view)
{
	int wmem_queued = 0, sndbuf = 0;

	if (!tp)
		return false;
	KV_READ(&view->bytes_acked, tp, bytes_acked);
	KV_READ(&view->snd_una, tp, snd_una);
	KV_READ(&view->snd_nxt, tp, snd_nxt);
	KV_READ(&view->write_seq, tp, write_seq);
	KV_READ(&view->peer_rwnd, tp, snd_wnd);
	KV_READ(&view->peer_rwnd_max, tp, max_window);
	KV_READ(&view->srtt_us, tp, srtt_us);
	view->srtt_us >>= 3;
	KV_READ(&view->rttvar_us, tp, rttvar_us);
	KV_READ(&view->probe_backoff, tp, inet_conn.icsk_backoff);
	KV_READ(&view->snd_cwnd, tp, snd_cwnd);
	KV_READ(&wmem_queued, sk, sk_wmem_queued);
	KV_READ(&sndbuf, sk, sk_sndbuf);
	view->wmem_queued = wmem_queued > 0 ? wmem_queued : 0;
	view->sndbuf = sndbuf > 0 ? sndbuf : 0;
	return true;
}
/* The ACK, sequence and window of a segment; false when it carries no ACK (or is unreadable). */
static __always_inline bool KV_FN(kv_read_segment)(struct tcp_sock *tp, struct sk_buff *skb,
						   struct kv_segment *seg)
{
	struct kv_tcp_header th = {};
	unsigned char *data = NULL;

	KV_READ(&data, skb, data);
	if (!data || bpf_probe_read_kernel(&th, sizeof(th), data))
		return false;
	if (!(th.flags & KV_TCP_FLAG_ACK))
		return false;
	seg->ack = bpf_ntohl(th.ack_seq);
	seg->seq = bpf_ntohl(th.seq);
	seg->window = bpf_ntohs(th.window);
	if (!(th.flags & KV_TCP_FLAG_SYN))
		seg->window <<= KV_SND_WSCALE(tp);
	return true;
}
/*
 * tcp_probe fires before tcp_rcv_established processes the segment, so the socket still shows
 * the previous ACK. Apply this segment's ACK and window the way tcp_ack() is about to, so the
 * end of a zero-window episode is seen on the window update itself. Returns true when the
 * segment acknowledges new data.
 */
static __always_inline bool KV_FN(kv_apply_segment)(struct tcp_sock *tp, const struct kv_segment *seg,
						    struct kv_tcp_view *view)
{
	__u32 snd_wl1 = 0;
	bool acked_new;

	KV_READ(&snd_wl1, tp, snd_wl1);
	acked_new = kv_seq_after(seg->ack, view->snd_una) && !kv_seq_after(seg->ack, view->snd_nxt);
	if (acked_new || kv_seq_after(seg->seq, snd_wl1) ||
	    (seg->seq == snd_wl1 && (seg->window > view->peer_rwnd || seg->window == 0)))
		view->peer_rwnd = seg->window;
	if (acked_new) {
		view->bytes_acked += seg->ack - view->snd_una;
		view->snd_una = seg->ack;
	}
	return acked_new;
}
/*
 * Send path. At entry (fentry, kprobe) `bytes` is what the caller asks to write and counts as
 * queued already; at exit (sock_send_length) `bytes` is what was written.
 */
static __always_inline int KV_FN(kv_on_send)(struct sock *sk, long bytes, bool at_entry)
{
	struct kv_sock_record *rec;
	struct kv_tcp_view view;
	__u64 key = (__u64)sk;
	__u64 now, thread;
	__u32 tgid;
	__u8 state = 0;
	bool idle_before;

	if (!kv_process_allowed() || !KV_FN(kv_port_allowed)(sk))
		return 0;
	now = KV_NOW();
	rec = KV_SOCKETS_LOOKUP(&key);
	if (!rec) {
		/* Only a socket that can send gets a record: a write after close must not revive one. */
		KV_READ(&state, sk, __sk_common.skc_state);
		if (state != KV_TCP_ESTABLISHED && state != KV_TCP_CLOSE_WAIT)
			return 0;
		rec = KV_FN(kv_record_create)(sk, now);
	}
	if (!rec)
		return 0;
	if (!KV_FN(kv_read_view)(sk, KV_TCP_SOCK(sk), &view))
		return 0;
	idle_before = view.write_seq == view.snd_una;
	view.sndbuf_full = kv_sndbuf_full(view.wmem_queued + (at_entry && bytes > 0 ? bytes : 0),
					  view.sndbuf);
	thread = bpf_get_current_pid_tgid();
	tgid = thread >> 32;
	kv_mark_writer(tgid);
	if (rec->tgid != tgid) {
		rec->tgid = tgid;
		bpf_get_current_comm(&rec->comm, sizeof(rec->comm));
	}
	if (!rec->first_send_ns)
		rec->first_send_ns = now;
	rec->last_send_ns = now;
	rec->send_calls++;
	if (bytes > 0)
		rec->send_bytes += bytes;
	if (!rec->inode)
		rec->inode = KV_FN(kv_read_inode)(sk);
	kv_note_feeder(rec, thread, now);
	kv_commit(rec, &view, now);
	if (at_entry && bytes > 0 && idle_before)
		rec->progress_ns = now;
	return 0;
}
/* Send path at sock_send_length, which fires for every socket type: TCP over IP only. */
static __always_inline int KV_FN(kv_on_send_tracepoint)(struct sock *sk, int ret)
{
	unsigned short family = 0;

	KV_READ(&family, sk, __sk_common.skc_family);
	if ((family != KV_AF_INET && family != KV_AF_INET6) ||
	    KV_SK_PROTOCOL(sk) != KV_IPPROTO_TCP)
		return 0;
	return KV_FN(kv_on_send)(sk, ret, false);
}
/*
 * ACK path (tcp_probe): every segment an ESTABLISHED socket receives, and only those:
 * tcp_probe fires in tcp_rcv_established, and segments in any other state (CLOSE_WAIT,
 * FIN_WAIT1, LAST_ACK, ...) go through tcp_rcv_state_process, where no tracepoint fires per
 * segment. The agent reads such sockets from tcp_info instead (kvwatch.collect.diag.kernel_view).
 * A segment that comes
 * while the window is shut, acknowledges nothing new and leaves it shut is the peer's
 * answer to a zero-window probe: the agent's proof that a stalled reader did not move, so
 * it is sent as an event (at most one per KV_ZERO_WINDOW_ANSWER_GAP_NS). Every segment
 * refreshes the whole view: skipping the ones that move neither the ACK point nor the
 * window could leave the queue, RTT and buffer fields as old as the last write, and two
 * programs on the same socket were seen to drift apart.
 */
static __always_inline int KV_FN(kv_on_segment)(struct sock *sk, struct sk_buff *skb)
{
	struct kv_sock_record *rec;
	struct tcp_sock *tp;
	struct kv_tcp_view view;
	struct kv_segment seg = {};
	__u64 key = (__u64)sk;
	__u64 now;
	bool has_ack, acked_new, answer;

	if (!KV_FN(kv_port_allowed)(sk))
		return 0;
	tp = KV_TCP_SOCK(sk);
	if (!tp)
		return 0;
	rec = KV_SOCKETS_LOOKUP(&key);
	now = KV_NOW();
	if (!rec && !kv_process_filter_on())
		rec = KV_FN(kv_record_create)(sk, now);
	if (!rec)
		return 0;
	has_ack = KV_FN(kv_read_segment)(tp, skb, &seg);
	if (!KV_FN(kv_read_view)(sk, tp, &view))
		return 0;
	acked_new = has_ack && KV_FN(kv_apply_segment)(tp, &seg, &view);
	view.sndbuf_full = !acked_new && kv_sndbuf_full(view.wmem_queued, view.sndbuf);
	answer = rec->zero_window_since_ns && view.peer_rwnd == 0 && !acked_new &&
		 now - rec->last_ack_ns >= KV_ZERO_WINDOW_ANSWER_GAP_NS;
	rec->acks++;
	rec->last_ack_ns = now;
	kv_commit(rec, &view, now);
	if (answer)
		kv_emit(rec, KV_EVENT_ZERO_WINDOW_ANSWER, now);
	return 0;
}
/*
 * Read path (tcp_rcv_space_adjust): fires in the reading thread each time TCP data was copied
 * to it. For a process that writes to tracked sockets (kv_is_writer), remembers per thread
 * the socket read last and its addresses (read only when the socket changes), for
 * kv_note_feeder on the thread's next write.
 */
static __always_inline int KV_FN(kv_on_read)(struct sock *sk)
{
	__u64 thread = bpf_get_current_pid_tgid();
	struct kv_thread_read *last;
	struct kv_thread_read fresh = {};
	__u64 now;

	if (!kv_is_writer(thread >> 32))
		return 0;
	last = KV_READS_LOOKUP(&thread);
	now = KV_NOW();
	if (last && last->sk == (__u64)sk) {
		last->read_ns = now;
		return 0;
	}
	fresh.sk = (__u64)sk;
	fresh.read_ns = now;
	KV_FN(kv_read_endpoints)(sk, &fresh.endpoints);
	KV_READS_UPDATE(&thread, &fresh);
	return 0;
}
/*
 * Lifecycle: records are created when a connection is established and removed at close.
 * Filters decide only what starts being tracked: by the time a socket closes the kernel may
 * already have released its local port (skc_num reads 0), so a tracked socket is followed by
 * its key alone.
 */
static __always_inline int KV_FN(kv_on_state)(struct sock *sk, int new_state)
{
	struct kv_sock_record *rec;
	__u64 key = (__u64)sk;
	__u64 now;

	if (KV_SK_PROTOCOL(sk) != KV_IPPROTO_TCP)
		return 0;
	now = KV_NOW();
	rec = KV_SOCKETS_LOOKUP(&key);
	if (!rec && new_state == KV_TCP_ESTABLISHED && !kv_process_filter_on() &&
	    KV_FN(kv_port_allowed)(sk))
		rec = KV_FN(kv_record_create)(sk, now);
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

/* The record of a tracked socket, for handlers that only count (NULL when untracked). */
static __always_inline struct kv_sock_record *KV_FN(kv_tracked)(struct sock *sk)
{
	__u64 key = (__u64)sk;

	if (!KV_FN(kv_port_allowed)(sk))
		return NULL;
	return KV_SOCKETS_LOOKUP(&key);
}

static __always_inline int KV_FN(kv_on_retransmit)(struct sock *sk)
{
	struct kv_sock_record *rec = KV_FN(kv_tracked)(sk);

	if (rec)
		rec->retransmits++;
	return 0;
}

static __always_inline int KV_FN(kv_on_zero_window_probe)(struct sock *sk)
{
	struct kv_sock_record *rec = KV_FN(kv_tracked)(sk);

	if (rec)
		rec->zero_window_probes++;
	return 0;
}

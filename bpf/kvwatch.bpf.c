// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * kvwatch: per-socket send backpressure (CO-RE build for libbpf).
 * The logic lives in kvwatch_socket.h; this file holds the maps, the load-time settings and
 * thin wrappers, one per attach point and mode. The send path has three variants (fentry, kprobe, sock_send_length raw
 * tracepoint); userspace autoloads exactly one of them.
 * Records live in one of two tables, chosen at load time for every attach point together: socket-local
 * storage when every attached program is BTF-typed (fentry, tp_btf), else the LRU hash.
 */
#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/in6.h>
#include <asm/ptrace.h>
#include <stdbool.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_endian.h>
#include "kvwatch_types.h"
#include "kvwatch.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, KV_DEFAULT_MAX_SOCKETS);
	__type(key, __u64);
	__type(value, struct kv_sock_record);
} kv_sockets SEC(".maps");

/* The same records in socket-local storage: found through the socket itself, freed with it. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct kv_sock_record);
} kv_socket_storage SEC(".maps");

/* Per thread (pid_tgid): the socket it read from last, for relay pairing. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, KV_DEFAULT_MAX_THREADS);
	__type(key, __u64);
	__type(value, struct kv_thread_read);
} kv_reads SEC(".maps");

/* One bit per tgid: the process wrote to a tracked socket, so its reads matter (pairing). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, KV_WRITER_WORDS);
	__type(key, __u32);
	__type(value, __u64);
} kv_writers SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, KV_EVENTS_BYTES);
} kv_events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, KV_STAT_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} kv_stats SEC(".maps");

const volatile struct kv_settings kv_settings = {};

/* Set by the loader when every program is BTF-typed: records go to kv_socket_storage. */
const volatile bool kv_use_sk_storage = false;

/* Typed, never written: keeps struct kv_event in the object's BTF for the layout check. */
const volatile struct kv_event kv_event_layout = {};

static __always_inline void kv_stat_add(__u32 index)
{
	__u64 *value = bpf_map_lookup_elem(&kv_stats, &index);

	if (value)
		*value += 1;
}

#define KV_NOW() bpf_ktime_get_ns()
#define KV_SETTING(name) (kv_settings.name)
/* The LRU table, keyed by the socket's address (key points to it). */
#define KV_LRU_LOOKUP(key) bpf_map_lookup_elem(&kv_sockets, key)
#define KV_LRU_INSERT(key, rec) bpf_map_update_elem(&kv_sockets, key, rec, BPF_NOEXIST)
#define KV_LRU_DELETE(key) bpf_map_delete_elem(&kv_sockets, key)
#define KV_READS_LOOKUP(thread) bpf_map_lookup_elem(&kv_reads, thread)
#define KV_READS_UPDATE(thread, value) bpf_map_update_elem(&kv_reads, thread, value, BPF_ANY)
#define KV_WRITERS_WORD(index) bpf_map_lookup_elem(&kv_writers, index)
#define KV_EVENT_RESERVE() bpf_ringbuf_reserve(&kv_events, sizeof(struct kv_event), 0)
#define KV_EVENT_SUBMIT(ev) bpf_ringbuf_submit(ev, 0)
#define KV_STAT_ADD(index) kv_stat_add(index)

#include "kvwatch_socket.h"

/*
 * Flavour 1, for BTF-typed programs (fentry, tp_btf): plain loads, checked by the verifier.
 * The key holds the socket's BTF-typed pointer, so socket-local storage can be used.
 */
#define KV_SK(key) ((struct sock *)*(key))
#define KV_SOCKETS_LOOKUP(key) (kv_use_sk_storage ?					\
	bpf_sk_storage_get(&kv_socket_storage, KV_SK(key), 0, 0) : KV_LRU_LOOKUP(key))
#define KV_SOCKETS_INSERT(key, rec) (kv_use_sk_storage ?				\
	(bpf_sk_storage_get(&kv_socket_storage, KV_SK(key), rec,			\
			    BPF_SK_STORAGE_GET_F_CREATE) ? 0 : -KV_ENOMEM) :		\
	KV_LRU_INSERT(key, rec))
#define KV_SOCKETS_DELETE(key) (kv_use_sk_storage ?					\
	bpf_sk_storage_delete(&kv_socket_storage, KV_SK(key)) : KV_LRU_DELETE(key))
#define KV_FN(name) name##_btf
#define KV_READ(dst, ptr, field) (*(dst) = (ptr)->field)
#define KV_READ_BYTES(dst, ptr, field) __builtin_memcpy(dst, &(ptr)->field, sizeof((ptr)->field))
#define KV_SK_PROTOCOL(sk) BPF_CORE_READ_BITFIELD(sk, sk_protocol)
#define KV_SND_WSCALE(tp) BPF_CORE_READ_BITFIELD(tp, rx_opt.snd_wscale)
#define KV_TCP_SOCK(sk) bpf_skc_to_tcp_sock(sk)
#include "kvwatch_handlers.h"
#undef KV_FN
#undef KV_READ
#undef KV_READ_BYTES
#undef KV_SK_PROTOCOL
#undef KV_SND_WSCALE
#undef KV_TCP_SOCK
#undef KV_SOCKETS_LOOKUP
#undef KV_SOCKETS_INSERT
#undef KV_SOCKETS_DELETE

/* Flavour 2, for kprobe and raw_tp programs: every read through bpf_probe_read_kernel. */
#define KV_SOCKETS_LOOKUP(key) KV_LRU_LOOKUP(key)
#define KV_SOCKETS_INSERT(key, rec) KV_LRU_INSERT(key, rec)
#define KV_SOCKETS_DELETE(key) KV_LRU_DELETE(key)
#define KV_FN(name) name##_probed
#define KV_READ(dst, ptr, field) BPF_CORE_READ_INTO(dst, ptr, field)
#define KV_READ_BYTES(dst, ptr, field) BPF_CORE_READ_INTO(&(dst), ptr, field)
#define KV_SK_PROTOCOL(sk) BPF_CORE_READ_BITFIELD_PROBED(sk, sk_protocol)
#define KV_SND_WSCALE(tp) BPF_CORE_READ_BITFIELD_PROBED(tp, rx_opt.snd_wscale)
#define KV_TCP_SOCK(sk) ((struct tcp_sock *)(sk))
#include "kvwatch_handlers.h"

/* Send path: fentry (BPF trampoline), else kprobe, else the sock_send_length tracepoint. */
SEC("fentry/tcp_sendmsg")
int BPF_PROG(kv_send_fentry, struct sock *sk, void *msg, __u64 size)
{
	return kv_on_send_btf(sk, size, true);
}

SEC("kprobe/tcp_sendmsg")
int BPF_KPROBE(kv_send_kprobe, struct sock *sk, void *msg, __u64 size)
{
	return kv_on_send_probed(sk, size, true);
}

/* sock_send_length(sk, ret, flags) fires after the write returns, for every socket type. */
SEC("tp_btf/sock_send_length")
int BPF_PROG(kv_send_tp_btf, struct sock *sk, int ret, int flags)
{
	return kv_on_send_tracepoint_btf(sk, ret);
}

SEC("raw_tp/sock_send_length")
int kv_send_raw_tp(struct bpf_raw_tracepoint_args *ctx)
{
	return kv_on_send_tracepoint_probed((struct sock *)ctx->args[0], (int)ctx->args[1]);
}

/* ACK path: tcp_probe(sk, skb) at the entry of tcp_rcv_established. */
SEC("tp_btf/tcp_probe")
int BPF_PROG(kv_segment_tp_btf, struct sock *sk, struct sk_buff *skb)
{
	return kv_on_segment_btf(sk, skb);
}

SEC("raw_tp/tcp_probe")
int kv_segment_raw_tp(struct bpf_raw_tracepoint_args *ctx)
{
	return kv_on_segment_probed((struct sock *)ctx->args[0], (struct sk_buff *)ctx->args[1]);
}

/* Read path: tcp_rcv_space_adjust(sk), after data was copied to the reading thread. */
SEC("tp_btf/tcp_rcv_space_adjust")
int BPF_PROG(kv_read_tp_btf, struct sock *sk)
{
	return kv_on_read_btf(sk);
}

SEC("raw_tp/tcp_rcv_space_adjust")
int kv_read_raw_tp(struct bpf_raw_tracepoint_args *ctx)
{
	return kv_on_read_probed((struct sock *)ctx->args[0]);
}

/* Lifecycle: inet_sock_set_state(sk, oldstate, newstate). */
SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(kv_state_tp_btf, struct sock *sk, int old_state, int new_state)
{
	return kv_on_state_btf(sk, new_state);
}

SEC("raw_tp/inet_sock_set_state")
int kv_state_raw_tp(struct bpf_raw_tracepoint_args *ctx)
{
	return kv_on_state_probed((struct sock *)ctx->args[0], (int)ctx->args[2]);
}

/* Retransmits: tcp_retransmit_skb(sk, skb[, err]). */
SEC("tp_btf/tcp_retransmit_skb")
int BPF_PROG(kv_retransmit_tp_btf, struct sock *sk)
{
	return kv_on_retransmit_btf(sk);
}

SEC("raw_tp/tcp_retransmit_skb")
int kv_retransmit_raw_tp(struct bpf_raw_tracepoint_args *ctx)
{
	return kv_on_retransmit_probed((struct sock *)ctx->args[0]);
}

/* Zero-window probes: only where the send path got fentry or kprobe. */
SEC("fentry/tcp_send_probe0")
int BPF_PROG(kv_probe0_fentry, struct sock *sk)
{
	return kv_on_zero_window_probe_btf(sk);
}

SEC("kprobe/tcp_send_probe0")
int BPF_KPROBE(kv_probe0_kprobe, struct sock *sk)
{
	return kv_on_zero_window_probe_probed(sk);
}

/* The socket-local table, read by userspace: every record, in one read() of the iterator. */
SEC("iter/bpf_sk_storage_map")
int kv_dump_sockets(struct bpf_iter__bpf_sk_storage_map *ctx)
{
	struct kv_sock_record *rec = ctx->value;

	if (rec && ctx->sk)
		bpf_seq_write(ctx->meta->seq, rec, sizeof(*rec));
	return 0;
}

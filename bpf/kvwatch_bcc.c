// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * kvwatch: per-socket send backpressure (BCC build, for kernels without BTF).
 * BCC compiles this file at start-up against the running kernel's headers, so every field
 * offset is that kernel's own. The logic is kvwatch_socket.h and kvwatch_handlers.h, the same
 * text the CO-RE build compiles; this file holds BCC's maps and thin wrappers, one per attach point.
 * Userspace (kvwatch/collect/bpf/bcc.py) passes -DKV_MAX_SOCKETS and the include path, writes
 * kv_settings before attaching, and attaches one send program: kprobe, else the
 * sock_send_length raw tracepoint.
 */
#include <linux/skbuff.h>
#include <linux/tcp.h>
#include <net/sock.h>
#include <net/net_namespace.h>
#include <linux/fs.h>

#include "kvwatch.h"

BPF_TABLE("lru_hash", __u64, struct kv_sock_record, kv_sockets, KV_MAX_SOCKETS);
BPF_TABLE("lru_hash", __u64, struct kv_thread_read, kv_reads, KV_DEFAULT_MAX_THREADS);
BPF_ARRAY(kv_writers, __u64, KV_WRITER_WORDS);
BPF_RINGBUF_OUTPUT(kv_events, KV_EVENTS_BYTES / 4096);
BPF_PERCPU_ARRAY(kv_stats, __u64, KV_STAT_COUNT);
/* One entry, written by userspace before any program is attached. */
BPF_ARRAY(kv_settings, struct kv_settings, 1);

/* BCC rewrites map method calls only outside macros: each one gets a function here. */
static __always_inline const struct kv_settings *kv_bcc_settings(void)
{
	int zero = 0;

	return kv_settings.lookup(&zero);
}
static __always_inline struct kv_sock_record *kv_bcc_sockets_lookup(__u64 *key)
{
	return kv_sockets.lookup(key);
}
static __always_inline long kv_bcc_sockets_insert(__u64 *key, struct kv_sock_record *rec)
{
	return kv_sockets.insert(key, rec);
}
static __always_inline long kv_bcc_sockets_delete(__u64 *key)
{
	return kv_sockets.delete(key);
}
static __always_inline struct kv_thread_read *kv_bcc_reads_lookup(__u64 *thread)
{
	return kv_reads.lookup(thread);
}
static __always_inline long kv_bcc_reads_update(__u64 *thread, struct kv_thread_read *value)
{
	return kv_reads.update(thread, value);
}
static __always_inline __u64 *kv_bcc_writers_word(__u32 *index)
{
	return kv_writers.lookup(index);
}
static __always_inline struct kv_event *kv_bcc_event_reserve(void)
{
	return kv_events.ringbuf_reserve(sizeof(struct kv_event));
}
static __always_inline void kv_bcc_event_submit(struct kv_event *ev)
{
	kv_events.ringbuf_submit(ev, 0);
}
static __always_inline void kv_bcc_stat_add(__u32 index)
{
	__u64 *value = kv_stats.lookup(&index);

	if (value)
		*value += 1;
}

#define KV_NOW() bpf_ktime_get_ns()
#define KV_SETTING(name) \
	({ const struct kv_settings *__s = kv_bcc_settings(); __s ? __s->name : 0; })
#define KV_SOCKETS_LOOKUP(key) kv_bcc_sockets_lookup(key)
#define KV_SOCKETS_INSERT(key, rec) kv_bcc_sockets_insert(key, rec)
#define KV_SOCKETS_DELETE(key) kv_bcc_sockets_delete(key)
#define KV_READS_LOOKUP(thread) kv_bcc_reads_lookup(thread)
#define KV_READS_UPDATE(thread, value) kv_bcc_reads_update(thread, value)
#define KV_WRITERS_WORD(index) kv_bcc_writers_word(index)
#define KV_EVENT_RESERVE() kv_bcc_event_reserve()
#define KV_EVENT_SUBMIT(ev) kv_bcc_event_submit(ev)
#define KV_STAT_ADD(index) kv_bcc_stat_add(index)
#define bpf_ntohs(x) be16_to_cpu(x)
#define bpf_ntohl(x) be32_to_cpu(x)

#include "kvwatch_socket.h"

/* BCC's single flavour: every read through bpf_probe_read_kernel, at the headers' offsets. */
#define KV_FN(name) name##_bcc
#define KV_READ(dst, ptr, field) bpf_probe_read_kernel(dst, sizeof(*(dst)), (const void *)&(ptr)->field)
#define KV_READ_BYTES(dst, ptr, field) \
	bpf_probe_read_kernel(&(dst), sizeof(dst), &(ptr)->field)
#define KV_TCP_SOCK(sk) ((struct tcp_sock *)(sk))
/* Bitfields have no address: copy the enclosing storage, then read the field from the copy. */
#define KV_SND_WSCALE(tp) \
	({ struct tcp_options_received __opt = {}; \
	   bpf_probe_read_kernel(&__opt, sizeof(__opt), &(tp)->rx_opt); __opt.snd_wscale; })
#ifdef SK_FL_PROTO_SHIFT
/* Before Linux 5.6, sk_protocol is 8 bits of the flags word at __sk_flags_offset. */
#define KV_SK_PROTOCOL(sk) \
	({ unsigned int __flags = 0; \
	   bpf_probe_read_kernel(&__flags, sizeof(__flags), &(sk)->__sk_flags_offset); \
	   (__flags & SK_FL_PROTO_MASK) >> SK_FL_PROTO_SHIFT; })
#else
#define KV_SK_PROTOCOL(sk) \
	({ __u16 __protocol = 0; KV_READ(&__protocol, sk, sk_protocol); __protocol; })
#endif
#include "kvwatch_handlers.h"

int kv_send_kprobe(struct pt_regs *ctx)
{
	return kv_on_send_bcc((struct sock *)PT_REGS_PARM1(ctx), PT_REGS_PARM3(ctx), true);
}

int kv_send_raw_tp(struct bpf_raw_tracepoint_args *ctx)
{
	return kv_on_send_tracepoint_bcc((struct sock *)ctx->args[0], (int)ctx->args[1]);
}

int kv_segment_raw_tp(struct bpf_raw_tracepoint_args *ctx)
{
	return kv_on_segment_bcc((struct sock *)ctx->args[0], (struct sk_buff *)ctx->args[1]);
}

int kv_read_raw_tp(struct bpf_raw_tracepoint_args *ctx)
{
	return kv_on_read_bcc((struct sock *)ctx->args[0]);
}

int kv_state_raw_tp(struct bpf_raw_tracepoint_args *ctx)
{
	return kv_on_state_bcc((struct sock *)ctx->args[0], (int)ctx->args[2]);
}

int kv_retransmit_raw_tp(struct bpf_raw_tracepoint_args *ctx)
{
	return kv_on_retransmit_bcc((struct sock *)ctx->args[0]);
}

int kv_probe0_kprobe(struct pt_regs *ctx)
{
	return kv_on_zero_window_probe_bcc((struct sock *)PT_REGS_PARM1(ctx));
}

// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Reference programs for bench_collector: what the cheapest possible handlers cost on the
 * machine under test, measured the same way as kvwatch's (kernel.bpf_stats_enabled), on the
 * same tracepoint and traffic, each group alone (handler_costs.py). Never shipped.
 */
#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

struct sock_common {
	__u16 skc_num;
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
} __attribute__((preserve_access_index));

/* The port kvwatch's programs watch in the same run (set before load): the lookup+clock
 * references do their work only for its sockets and leave others at once, as a handler does. */
const volatile __u16 calibrate_port = 0;

char LICENSE[] SEC("license") = "Dual BSD/GPL";

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u64);
} calibrate_map SEC(".maps");

/* Nothing at all: the cost of being attached and measured. */
SEC("tp_btf/tcp_probe")
int BPF_PROG(calibrate_empty, void *sk)
{
	return 0;
}

/* One clock read, as every kvwatch handler does. */
SEC("tp_btf/tcp_probe")
int BPF_PROG(calibrate_clock, void *sk)
{
	return bpf_ktime_get_ns() == 0;
}

/* One LRU hash lookup by socket, as every kvwatch handler does. */
SEC("tp_btf/tcp_probe")
int BPF_PROG(calibrate_lookup, void *sk)
{
	__u64 key = (__u64)sk, zero = 0;
	__u64 *value = bpf_map_lookup_elem(&calibrate_map, &key);

	if (!value)
		bpf_map_update_elem(&calibrate_map, &key, &zero, BPF_NOEXIST);
	return 0;
}

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u64);
} calibrate_storage_map SEC(".maps");

/* One socket-local storage lookup (created on first use), as kvwatch's BTF-typed handlers do. */
SEC("tp_btf/tcp_probe")
int BPF_PROG(calibrate_storage, struct sock *sk)
{
	return bpf_sk_storage_get(&calibrate_storage_map, sk, 0, BPF_SK_STORAGE_GET_F_CREATE) == 0;
}

/* Nothing at all, on the send path's tracepoint (Linux 6.3+). */
SEC("tp_btf/sock_send_length")
int BPF_PROG(calibrate_empty_send, void *sk)
{
	return 0;
}

/* Nothing at all, on the read path's tracepoint. */
SEC("tp_btf/tcp_rcv_space_adjust")
int BPF_PROG(calibrate_empty_read, void *sk)
{
	return 0;
}

/*
 * The least a kvwatch handler can do on each attach point: leave other ports' sockets at
 * once, and for a watched one find its record and date the event (one lookup, one clock
 * read). The handler target is this plus 50 ns, on the same tracepoint in the same run:
 * socket-local storage for that layout's handlers, the LRU hash for the other's.
 */
static __always_inline int calibrate_storage_and_clock(struct sock *sk)
{
	if (sk->__sk_common.skc_num != calibrate_port)
		return 0;
	return bpf_sk_storage_get(&calibrate_storage_map, sk, 0, BPF_SK_STORAGE_GET_F_CREATE) == 0 ||
	       bpf_ktime_get_ns() == 0;
}

static __always_inline int calibrate_lookup_and_clock(struct sock *sk)
{
	__u64 key = (__u64)sk, zero = 0;
	__u64 *value;

	if (sk->__sk_common.skc_num != calibrate_port)
		return 0;
	value = bpf_map_lookup_elem(&calibrate_map, &key);
	if (!value)
		bpf_map_update_elem(&calibrate_map, &key, &zero, BPF_NOEXIST);
	return bpf_ktime_get_ns() == 0;
}

SEC("tp_btf/sock_send_length")
int BPF_PROG(calibrate_storage_clock_send, struct sock *sk)
{
	return calibrate_storage_and_clock(sk);
}

SEC("tp_btf/tcp_probe")
int BPF_PROG(calibrate_storage_clock_ack, struct sock *sk)
{
	return calibrate_storage_and_clock(sk);
}

SEC("tp_btf/tcp_rcv_space_adjust")
int BPF_PROG(calibrate_storage_clock_read, struct sock *sk)
{
	return calibrate_storage_and_clock(sk);
}

SEC("tp_btf/sock_send_length")
int BPF_PROG(calibrate_lookup_clock_send, struct sock *sk)
{
	return calibrate_lookup_and_clock(sk);
}

SEC("tp_btf/tcp_probe")
int BPF_PROG(calibrate_lookup_clock_ack, struct sock *sk)
{
	return calibrate_lookup_and_clock(sk);
}

SEC("tp_btf/tcp_rcv_space_adjust")
int BPF_PROG(calibrate_lookup_clock_read, struct sock *sk)
{
	return calibrate_lookup_and_clock(sk);
}

/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The few kernel types kvwatch reads, declared for CO-RE. Only the fields used are listed;
 * libbpf relocates each access against the running kernel's BTF at load time (anonymous
 * unions and structs in the kernel's layout are matched by field name), so no vmlinux.h or
 * kernel headers are needed to build or to run.
 */
#ifndef KVWATCH_TYPES_H
#define KVWATCH_TYPES_H

#define KV_CORE __attribute__((preserve_access_index))

struct ns_common {
	unsigned int inum;
} KV_CORE;

struct net {
	struct ns_common ns;
} KV_CORE;

typedef struct {
	struct net *net;
} possible_net_t;

struct inode {
	unsigned long i_ino;
} KV_CORE;

struct file {
	struct inode *f_inode;
} KV_CORE;

struct socket {
	struct file *file;
} KV_CORE;

struct sock_common {
	__be32 skc_daddr;
	__be32 skc_rcv_saddr;
	__be16 skc_dport;
	__u16 skc_num;
	unsigned short skc_family;
	volatile unsigned char skc_state;
	possible_net_t skc_net;
	struct in6_addr skc_v6_daddr;
	struct in6_addr skc_v6_rcv_saddr;
} KV_CORE;

struct sock {
	struct sock_common __sk_common;
	struct socket *sk_socket;
	int sk_wmem_queued;
	int sk_sndbuf;
	__u16 sk_protocol;	/* an 8-bit bitfield before 5.6: always read with the BITFIELD macro */
} KV_CORE;

struct tcp_options_received {
	__u16 snd_wscale : 4;
} KV_CORE;

struct inet_connection_sock {
	__u8 icsk_backoff;
} KV_CORE;

struct tcp_sock {
	struct inet_connection_sock inet_conn;
	__u32 snd_una;
	__u32 snd_nxt;
	__u32 snd_wl1;
	__u32 snd_wnd;
	__u32 max_window;
	__u32 write_seq;
	__u32 srtt_us;
	__u32 rttvar_us;
	__u32 snd_cwnd;
	struct tcp_options_received rx_opt;
	__u64 bytes_acked;
} KV_CORE;

struct sk_buff {
	unsigned char *data;
} KV_CORE;

/* What a BPF iterator over a socket-storage map hands each program run. */
struct seq_file;
struct bpf_map;

struct bpf_iter_meta {
	struct seq_file *seq;
} KV_CORE;

struct bpf_iter__bpf_sk_storage_map {
	struct bpf_iter_meta *meta;
	struct bpf_map *map;
	struct sock *sk;
	void *value;
} KV_CORE;

#endif /* KVWATCH_TYPES_H */

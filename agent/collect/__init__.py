"""Stage 1, the kernel and the node: BPF records and edge events (CO-RE or BCC), sock_diag,
procfs, network namespaces, NVML, and the socket table every sample passes through."""

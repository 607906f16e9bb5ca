"""The BPF side of the collector benchmark: reference programs (calibrate.bpf.c) and the
per-event cost of kvwatch's handlers next to them (handler_costs.py)."""

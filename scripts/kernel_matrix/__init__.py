"""kvwatch's kernel matrix: the BPF scenarios on other kernels, booted in VMs (issue 7).

`python -m scripts.kernel_matrix` (or `make kernel-matrix`) runs every row and rewrites
docs/kernel-matrix.md; tests/kernel/test_matrix.py runs the same rows under `make test`.
"""

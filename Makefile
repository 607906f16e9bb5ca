# kvwatch — build, test and demo targets. `make demo` and `make test` work on a fresh
# Debian 12 machine as root: they install what they need first (idempotent).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
BPF_OBJ := agent/collect/bpf/kvwatch.bpf.o
BPF_SRC := $(wildcard bpf/*.c bpf/*.h)
# The CO-RE object, and the sources BCC compiles at start-up (package data, kvwatch/collect/bpf/csrc).
BPF_BUILT := $(BPF_OBJ) agent/collect/bpf/csrc/kvwatch_bcc.c
# Two set-ups: what `make demo` needs, and everything (tests, benchmarks, lint). The full one
# includes the demo's.
STAMP := $(VENV)/.kvwatch-installed
DEMO_STAMP := $(VENV)/.kvwatch-demo-installed

.PHONY: setup setup-demo bpf test test-fast demo bench lint clean kernel-matrix hook-wheel

setup: $(STAMP) $(BPF_BUILT)

setup-demo: $(DEMO_STAMP) $(BPF_BUILT)

$(STAMP): $(DEMO_STAMP) pyproject.toml scripts/setup.sh
	bash scripts/setup.sh test
	touch $@

$(DEMO_STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh demo
	touch $@

bpf: $(BPF_BUILT)

# Built once the demo's set-up (the part of the full one it needs) has run.
$(BPF_BUILT) &: $(BPF_SRC) | $(DEMO_STAMP)
	$(MAKE) -C bpf OUT=$(abspath $(BPF_OBJ)) BCC_DIR=$(abspath agent/collect/bpf/csrc)

# The whole suite on TEST_WORKERS pytest-xdist workers: the kernel matrix's VMs start first, one
# after the other, and the rest fills in around them; tests that time a real server's stream run
# one at a time in their group (tests/conftest.py). No two tests share a port, a hook socket, a
# network namespace or a lab's server port, so any test may run beside any other.
TEST_WORKERS ?= 4
test: setup
	$(PY) -m pytest -ra -n $(TEST_WORKERS) --dist loadgroup --durations=20 $(PYTEST_ARGS)

# The fast tier, for every change (about 1.5 minutes on 2 cores): no BPF, no engine, no VM, nothing slow;
# the fuzz tests at a tenth of their cases.
test-fast: setup
	KVWATCH_FUZZ_CASES=1000 KVWATCH_INPUT_FUZZ_SCALE=0.1 \
		$(PY) -m pytest -q -n 2 -m "not slow and not bpf and not engine" $(PYTEST_ARGS)

# Boot other kernels in VMs, run the BPF scenarios in each attach mode, rewrite docs/kernel-matrix.md.
kernel-matrix: setup
	$(PY) -m scripts.kernel_matrix

demo: setup-demo
	$(VENV)/bin/kvwatch demo

bench: setup
	$(MAKE) -C bench/bpf
	$(PY) -m bench.bench_collector
	$(PY) -m bench.bench_engine
	$(PY) -m bench.bench_stall_to_free
	$(PY) -m bench.bench_paced
	$(PY) -m bench.bench_park
	$(PY) -m bench.bench_rescue
	$(PY) -m bench.bench_proxy
	$(PY) -m bench.bench_footprint
	$(PY) -m bench.bench_backends
	$(PY) -m bench.bench_egress
	$(PY) -m bench.bench_soak

# The engine side alone, standard library only, for engine images (docs/engines.md): builds
# dist/kvwatch_hook-*.whl offline with this venv's setuptools, else python3's (70.1 or newer).
HOOK_PY := $(if $(wildcard $(PY)),$(PY),python3)
hook-wheel:
	$(HOOK_PY) scripts/build_hook_wheel.py dist

# mypy cannot follow setuptools' package-dir mapping through an editable install, so it
# reads the package through a small tree of links that spells the import names.
TYPECHECK := build/typecheck
lint: setup
	$(VENV)/bin/ruff check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/kvwatch
	for entry in agent/*; do ln -s ../../../$$entry $(TYPECHECK)/kvwatch/; done
	MYPYPATH=$(TYPECHECK) $(VENV)/bin/mypy -p kvwatch -p tests -p bench

clean:
	rm -rf $(VENV) $(BPF_OBJ) build dist *.egg-info

# The vLLM integration (integrations/vllm, docs/engines.md): its own venv, .venv-vllm, with the
# pinned vLLM (never the project's .venv: vLLM pins its own torch), and its own tests. About
# 8 minutes and 9.5 GB the first time; seconds after that (the hook wheel is rebuilt each run).
# The agent-driven test runs `kvwatch run` from the project's venv (and BPF: root), hence
# `setup`; then about 2 minutes (docs/engines.md, "Measured").
.PHONY: setup-vllm test-vllm
setup-vllm:
	bash scripts/setup_vllm.sh

test-vllm: setup setup-vllm
	cd integrations/vllm && ../../.venv-vllm/bin/python -m pytest -ra $(PYTEST_ARGS)

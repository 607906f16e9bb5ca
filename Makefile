# kvwatch — build, test and demo targets. `make demo` and `make test` work on a fresh
# Debian 12 machine as root: they install what they need first (idempotent).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
BPF_OBJ := agent/bpf/kvwatch.bpf.o
BPF_SRC := $(wildcard bpf/*.c bpf/*.h)
# What BCC compiles at start-up, shipped with the package (kvwatch/bpf/csrc).
BCC_SRC := $(addprefix agent/bpf/csrc/,kvwatch_bcc.c kvwatch.h kvwatch_socket.h kvwatch_hooks.h)
STAMP := $(VENV)/.kvwatch-installed

.PHONY: setup bpf test demo bench lint clean kernel-matrix

setup: $(STAMP) $(BPF_OBJ) $(BCC_SRC)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

bpf: $(BPF_OBJ) $(BCC_SRC)

$(BPF_OBJ): $(BPF_SRC) | $(STAMP)
	$(MAKE) -C bpf OUT=$(abspath $@)

agent/bpf/csrc/%: bpf/%
	install -D -m 0644 $< $@

test: setup
	$(PY) -m pytest -ra $(PYTEST_ARGS)

# Boot other kernels in VMs, run the BPF scenarios in each attach mode, rewrite docs/kernel-matrix.md.
kernel-matrix: setup
	$(PY) -m scripts.kernel_matrix

demo: setup
	$(VENV)/bin/kvwatch demo

bench: setup
	$(MAKE) -C bench/bpf
	$(PY) -m bench.bench_collector
	$(PY) -m bench.bench_engine
	$(PY) -m bench.bench_stall_to_free
	$(PY) -m bench.bench_rescue
	$(PY) -m bench.bench_footprint

# mypy cannot follow setuptools' package-dir mapping through an editable install, so it
# reads the package through a small tree of links that spells the import names.
TYPECHECK := build/typecheck
lint: setup
	$(VENV)/bin/ruff check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/kvwatch
	for entry in agent/*; do ln -s ../../../$$entry $(TYPECHECK)/kvwatch/; done
	ln -s ../../../exporters $(TYPECHECK)/kvwatch/exporters
	MYPYPATH=$(TYPECHECK) $(VENV)/bin/mypy -p kvwatch -p tests -p bench

clean:
	rm -rf $(VENV) $(BPF_OBJ) build *.egg-info

#!/usr/bin/env bash
# Installs kvwatch's build (and, unless `demo`, test) dependencies and its virtualenv.
# Idempotent: packages already present are not fetched again. Run as root on Debian/Ubuntu
# (`make setup` and `make setup-demo` do).
set -euo pipefail
cd "$(dirname "$0")/.."

# What to set up: `demo` (what `make demo` needs: the BPF build, the agent and the reference
# engine) or `test` (everything: also what the tests, the benchmarks and `make lint` use).
FOR=${1:-test}
case "$FOR" in demo|test) ;; *) echo "setup: usage: $0 [demo|test]" >&2; exit 2 ;; esac

# clang/libbpf-dev build the BPF object; iproute2 and procps are what the agent and the demo
# drive. For the tests: prometheus (promtool) and systemd (systemd-analyze) check the exporter
# and the unit; tmux drives `kvwatch top` in a real terminal; qemu, udev, busybox-static and
# kmod boot other kernels for the kernel matrix (virtme-ng); python3-bpfcc is BCC, tested there
# against CO-RE (kvwatch imports it from the system's Python directory: it is not on PyPI);
# cmake and g++ build llama-cpp-python (below); nginx and haproxy are the proxies the
# behind-a-proxy tests put in front of the engine.
APT_PACKAGES=(clang llvm libbpf-dev libbpf1 bpftool iproute2 procps)
if [ "$FOR" = test ]; then
  APT_PACKAGES+=(tmux util-linux prometheus systemd qemu-system-x86 udev busybox-static kmod
                 python3-bpfcc cmake g++ nginx-light haproxy)
fi

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing Debian packages: ${missing[*]}; run as root or install them first" >&2
    exit 3
  fi
  echo "setup: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# The CPU build of torch first: a bare torch requirement would pull a multi-GB CUDA build.
"$VENV/bin/pip" install -q "torch==2.13.0"
if [ "$FOR" = demo ]; then
  "$VENV/bin/pip" install -q -e ".[engine]"
  exit 0
fi
"$VENV/bin/pip" install -q -e ".[engine,dev]"

# llama-cpp-python's server, built from its sdist for the CPU (the ASGI middleware's end-to-end
# test runs it). Only what the Python binding needs is compiled: about 5 minutes on 2 cores.
LLAMA_CPP_PYTHON_VERSION=0.3.16
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama_cpp_python') != '$LLAMA_CPP_PYTHON_VERSION')" 2>/dev/null; then
  echo "setup: building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (CPU)"
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=2 \
    "$VENV/bin/pip" install -q "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION"
fi

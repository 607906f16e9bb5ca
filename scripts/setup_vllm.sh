#!/usr/bin/env bash
# Creates the vLLM integration's own virtualenv, .venv-vllm (idempotent): the pinned vLLM, the
# test runner, the light kvwatch hook wheel built from this checkout, and kvwatch-vllm
# (integrations/vllm) in editable mode. Never touches the project's .venv: vLLM pins its own
# torch (a CUDA build), which must not meet the project's CPU torch.
#
#   bash scripts/setup_vllm.sh          # `make setup-vllm` runs it
#
# On a fresh machine the vLLM install downloads about 9.5 GB (docs/engines.md has the time);
# run again, it only re-installs the hook wheel and kvwatch-vllm (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

# The newest vLLM on the package index that works here (docs/engines.md says why this one).
VLLM_VERSION=0.33.0
VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

installed() {  # installed NAME VERSION: is that exact version in the venv?
  "$VENV/bin/python" - "$1" "$2" <<'EOF' 2>/dev/null
import importlib.metadata as metadata
import sys
sys.exit(metadata.version(sys.argv[1]) != sys.argv[2])
EOF
}

if ! installed vllm "$VLLM_VERSION"; then
  echo "setup-vllm: installing vllm $VLLM_VERSION into $VENV (about 9.5 GB on a fresh machine)"
  "${PIP[@]}" install -q "vllm==$VLLM_VERSION"
fi
# The tests' runner; setuptools 70.1+ builds the hook wheel and kvwatch-vllm without isolation.
"${PIP[@]}" install -q "pytest>=8" "pytest-timeout>=2.3" "setuptools>=70.1"

# The engine side of kvwatch, as an engine image gets it (docs/engines.md), rebuilt each run so
# the venv follows this checkout's agent/hook and agent/hookwire.
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"$VENV/bin/python" scripts/build_hook_wheel.py "$WHEELS" >/dev/null
"${PIP[@]}" install -q --no-deps --force-reinstall "$WHEELS"/kvwatch_hook-*.whl
"${PIP[@]}" install -q --no-deps --no-build-isolation -e integrations/vllm
echo "setup-vllm: $VENV has vllm $VLLM_VERSION, kvwatch-hook and kvwatch-vllm"

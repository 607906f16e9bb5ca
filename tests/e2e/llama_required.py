"""llama-cpp-python is built by scripts/setup.sh; where it is not, its tests skip, except in
CI (KVWATCH_REQUIRE_BPF=1), where that is a failure."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_llama_cpp() -> None:
    """Skips the calling test module where llama-cpp-python is not built (scripts/setup.sh
    builds it), except in CI (which sets KVWATCH_REQUIRE_BPF=1): there it is a failure."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return
    if os.environ.get("KVWATCH_REQUIRE_BPF") == "1":
        raise ImportError("llama-cpp-python is not installed: scripts/setup.sh builds it")
    pytest.skip("scripts/setup.sh builds llama-cpp-python", allow_module_level=True)

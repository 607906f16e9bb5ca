"""vLLM on a machine without a GPU: the CPU platform, offline (no hub); set before vLLM is
imported (docs/engines.md, "vLLM: pause, park and resume")."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from tests.support.offline import write_model_dir

    yield write_model_dir(tmp_path_factory.mktemp("tiny-llama"))

"""vLLM on a machine without a GPU: the CPU platform, offline (no hub); set before vLLM is
imported (docs/engines.md, "vLLM: pause, park and resume"). One real `vllm serve` for the
session, started by the first test that needs it (it takes ~35 s), its hook socket where
the agent-driven tests start `kvwatch run`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import VllmServer, vllm_server

# The server's pace and size: a step of the deterministic executor takes STEP_SECONDS (a
# stream of ~150 tokens/s, ~35 KB/s of SSE, alone); 1024 blocks of 16 tokens hold answers
# of up to MAX_MODEL_LEN tokens for a few clients at once.
STEP_SECONDS = 0.005
KV_BLOCKS = 1024
MAX_MODEL_LEN = 4096

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from tests.support.offline import write_model_dir

    yield write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def serve_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="session")
def server(model_dir: Path, serve_dir: Path) -> Iterator[VllmServer]:
    """`vllm serve` with kvwatch's scheduler and middleware and the deterministic executor;
    its engine hook connects to `serve_dir/engine.sock`, where an agent may listen."""
    with vllm_server(
        model_dir,
        serve_dir,
        step_seconds=STEP_SECONDS,
        hook_socket=serve_dir / "engine.sock",
        kv_blocks=KV_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
    ) as running:
        yield running

"""The deterministic executor's settings (tests.support.executor), read from the environment of
`vllm serve`; here, with nothing heavy imported, so the server helper can set them."""

from __future__ import annotations

# KV blocks the executor offers vLLM (default 256: 4096 tokens of the tiny model).
KV_BLOCKS_ENV = "KVWATCH_TEST_KV_BLOCKS"
DEFAULT_KV_BLOCKS = 256
# Seconds each batch takes, so a test can act on a request while it is generating.
STEP_SECONDS_ENV = "KVWATCH_TEST_STEP_SECONDS"

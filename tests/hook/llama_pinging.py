"""llama-cpp-python's server app with sse-starlette pinging every $KVWATCH_TEST_PING_SECONDS
(its server takes sse-starlette's default, 15 s): the factory KVWATCH_WRAP_FACTORY names in
the hook's llama-cpp-python test."""

from __future__ import annotations

import os
from typing import Any

PING_SECONDS_ENV = "KVWATCH_TEST_PING_SECONDS"


def create_app() -> Any:
    from llama_cpp.server.app import create_app as create_llama_app
    from sse_starlette.sse import EventSourceResponse

    # Annotated int, but its `ping_interval` setter, which reads it, takes seconds as a float.
    EventSourceResponse.DEFAULT_PING_INTERVAL = float(os.environ[PING_SECONDS_ENV])  # type: ignore[assignment]
    return create_llama_app()

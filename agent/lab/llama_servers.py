"""llama-cpp-python's real server app in this process, wrapped by the middleware, under
uvicorn or hypercorn (agent/lab/asgi_servers.py) with the tiny test model; and its
streaming requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvwatch.hook.asgi import Middleware
from kvwatch.lab.asgi_servers import ServerThread, serving
from kvwatch.lab.tiny_gguf import TinyLlama, ascii_forever_bias

MODEL = TinyLlama(context_length=4096)
# A fixed 64 KB send buffer per connection stands in for a long generation: the kernel's
# autotuned loopback buffers (up to 4 MB) would take this tiny model's whole answer at once.
SERVER_SNDBUF_BYTES = 64 * 1024


def llama_completion(port: int, max_tokens: int, *, greedy: bool = False) -> bytes:
    """A streaming completion with no X-Request-Id (the id is the engine's own) that never
    ends early; `greedy` makes its text the same on every run."""
    body: dict[str, Any] = {
        "prompt": "abc",
        "max_tokens": max_tokens,
        "stream": True,
        "logit_bias": ascii_forever_bias(),
    }
    if greedy:
        body["temperature"] = 0.0
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


@contextmanager
def serving_llama(
    kind: str, model_path: Path, socket_path: str, **options: Any
) -> Iterator[tuple[ServerThread, Middleware]]:
    """llama-cpp-python's app (one generation lock held until a stream ends:
    interrupt_requests off) in the middleware (`options`: its keyword arguments), served by
    `kind` with SERVER_SNDBUF_BYTES send buffers; the hook's agent socket is `socket_path`.
    The app keeps its model in a module global, where the middleware reads the KV geometry
    from: it is dropped on the way out, so no later app in this process looks like llama's."""
    import llama_cpp.server.app as llama_app
    from llama_cpp.server.settings import Settings

    settings = Settings(
        model=str(model_path),
        n_ctx=MODEL.context_length,
        n_threads=1,
        interrupt_requests=False,
        verbose=False,
    )
    options.setdefault("reconnect_seconds", 0.2)
    app = llama_app.create_app(settings=settings)
    middleware = Middleware(app, socket_path=socket_path, **options)
    try:
        with serving(kind, middleware, sndbuf=SERVER_SNDBUF_BYTES) as server:
            yield server, middleware
    finally:
        middleware.close()
        llama_app._llama_proxy = None

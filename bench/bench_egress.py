"""Decoupled egress on llama-cpp-python: does a slow reader still hold the generation lock?

llama-cpp-python's server generates for one request at a time (one lock), and with
`interrupt_requests` off the stream that holds the lock keeps it until its generation ends.
Coupled (the middleware's default), generation advances only as fast as the client reads
once the socket buffers are full, so a slow-but-alive reader makes every other request wait
for it. Decoupled (`egress_buffer_bytes` > 0), the middleware's buffer takes the output, the
generation ends at full speed, the lock is released and the slow reader drains from host memory.

One run per mode, same model and load: a tiny random-weight model (tests/e2e/tiny_gguf.py)
under uvicorn in this process (64 KB socket send buffers), a slow reader (4 KB receive
buffer, `READ_BYTES_PER_SECOND`) asking for `SLOW_TOKENS` tokens, and
`WAITING_AFTER_SECONDS` later a waiting request for
`WAITING_TOKENS` tokens read at full speed. Measured: how long the waiting request took
(sent to [DONE]), when the slow reader got its [DONE], and the most bytes the middleware
buffered at once. No agent runs: this measures egress only. Measured here (2 shared cores):
off, the waiting request was served after 43.2 s; on, after 18.0 s (the time the 2000
tokens take to generate), with at most 223 KB buffered; the slow reader finished in ~61 s
either way.

Run: `python -m bench.bench_egress` (or `make bench`). Writes bench/results/egress.json and
egress.png.
"""

from __future__ import annotations

import json
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_result
from kvwatch.hook.asgi import Middleware
from tests.e2e.tiny_gguf import TinyLlama, ascii_forever_bias, write_tiny_llama
from tests.hook.asgi_servers import serving

MODEL = TinyLlama(context_length=8192)
SLOW_TOKENS = 2000
WAITING_TOKENS = 50
READ_BYTES_PER_SECOND = 8 * 1024
READ_CHUNK_BYTES = 1024
WAITING_AFTER_SECONDS = 1.0
EGRESS_BUFFER_BYTES = 64 * 1024 * 1024
EGRESS_TOTAL_BYTES = 256 * 1024 * 1024
READ_TIMEOUT_SECONDS = 300.0
# A fixed 64 KB send buffer per connection stands in for a long generation: the kernel's
# autotuned loopback buffers (up to 4 MB) would take this tiny model's whole answer at once.
SERVER_SNDBUF_BYTES = 64 * 1024


def request(tokens: int) -> bytes:
    body = json.dumps(
        {"prompt": "abc", "max_tokens": tokens, "stream": True, "logit_bias": ascii_forever_bias()}
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def read_stream(port: int, tokens: int, *, slow: bool, started: float) -> float:
    """Seconds from `started` until this client read the stream's [DONE]."""
    with socket.socket() as client:
        if slow:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.settimeout(READ_TIMEOUT_SECONDS)
        client.connect(("127.0.0.1", port))
        client.sendall(request(tokens))
        data = bytearray()
        while b"data: [DONE]" not in data[-64:]:
            chunk = client.recv(READ_CHUNK_BYTES if slow else 65536)
            if not chunk:
                raise RuntimeError("the server closed the stream before [DONE]")
            data += chunk
            if slow:
                time.sleep(len(chunk) / READ_BYTES_PER_SECOND)
    return time.monotonic() - started


def run_mode(model_path: Path, egress_buffer_bytes: int) -> dict[str, Any]:
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import Settings

    settings = Settings(
        model=str(model_path),
        n_ctx=MODEL.context_length,
        n_threads=1,
        interrupt_requests=False,
        verbose=False,
    )
    middleware = Middleware(
        create_app(settings=settings),
        socket_path=str(model_path.parent / "no-agent.sock"),
        egress_buffer_bytes=egress_buffer_bytes,
        egress_total_bytes=EGRESS_TOTAL_BYTES,
    )
    results: dict[str, float] = {}
    with serving("uvicorn", middleware, sndbuf=SERVER_SNDBUF_BYTES) as server:
        started = time.monotonic()

        def slow() -> None:
            results["slow_reader_done_seconds"] = read_stream(
                server.port, SLOW_TOKENS, slow=True, started=started
            )

        reader = threading.Thread(target=slow, daemon=True)
        reader.start()
        time.sleep(WAITING_AFTER_SECONDS)
        asked = time.monotonic()
        results["waiting_served_seconds"] = read_stream(
            server.port, WAITING_TOKENS, slow=False, started=asked
        )
        reader.join(READ_TIMEOUT_SECONDS)
    middleware.close()
    budget = middleware.egress_budget
    return {
        "egress_buffer_bytes": egress_buffer_bytes,
        **{name: round(value, 2) for name, value in results.items()},
        "peak_buffered_bytes": budget.peak_bytes if budget is not None else 0,
    }


def plot(modes: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(modes)
    figure, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for axis, key, title in (
        (axes[0], "waiting_served_seconds", "waiting request served after (s)"),
        (axes[1], "peak_buffered_bytes", "peak middleware buffer (KB)"),
    ):
        values = [modes[n][key] / (1024 if key.endswith("bytes") else 1) for n in names]
        axis.bar(names, values, color=["#c44", "#4a4"])
        axis.set_title(title, fontsize=9)
        for index, value in enumerate(values):
            axis.annotate(f"{value:.1f}", (index, value), ha="center", va="bottom", fontsize=8)
    figure.suptitle(
        f"llama-cpp-python, a {READ_BYTES_PER_SECOND // 1024} KB/s reader of {SLOW_TOKENS} "
        "tokens and one waiting request",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvw-egress-") as workdir:
        model_path = write_tiny_llama(Path(workdir) / "tiny.gguf", MODEL)
        modes = {
            "coupled (off)": run_mode(model_path, 0),
            "decoupled (on)": run_mode(model_path, EGRESS_BUFFER_BYTES),
        }
    payload = {
        "engine": "llama-cpp-python",
        "slow_tokens": SLOW_TOKENS,
        "waiting_tokens": WAITING_TOKENS,
        "read_bytes_per_second": READ_BYTES_PER_SECOND,
        "waiting_after_seconds": WAITING_AFTER_SECONDS,
        "server_sndbuf_bytes": SERVER_SNDBUF_BYTES,
        "modes": modes,
    }
    print(write_result("egress", payload))
    plot(modes, RESULTS / "egress.png")


if __name__ == "__main__":
    main()

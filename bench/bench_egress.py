"""Egress on llama-cpp-python: does a slow reader still hold the generation lock?

llama-cpp-python's server generates for one request at a time (one lock), and with
`interrupt_requests` off the stream that holds the lock keeps it until its generation ends.
Three ways the middleware can send a response:

- coupled (the default, no agent action): once the socket buffers are full, generation
  advances only as fast as the client reads, so a slow-but-alive reader makes every other
  request wait for it;
- decoupled (`egress_buffer_bytes` > 0): every response goes through a host buffer from its
  start, the generation runs at full speed and releases the lock; every response pays for it;
- detach on demand (the default settings, and an agent): the response is coupled until the
  agent sends `detach`, then it goes through a host buffer (docs/protocol.md, "Detach").
  The detach is sent by kvwatch's real HookServer. The agent's trigger is emulated: the
  bench watches the holder's server socket through kvwatch's own sock_diag reader
  (`take_snapshot`) and sends the detach once its send buffer has been full
  (`kvwatch.sockets.sndbuf_full`, the collector's test) for BACKED_UP_SECONDS.

Each mode runs REPETITIONS times, same model and load: a tiny random-weight model
(agent/lab/tiny_gguf.py) under uvicorn in this process (64 KB server send buffers standing in
for a long answer), a reader with the kernel's default receive buffer taking
`READ_BYTES_PER_SECOND` of a `SLOW_TOKENS`-token stream, and `WAITING_AFTER_SECONDS` later a
waiting request for `WAITING_TOKENS` tokens (default buffers too) read at full speed.
Measured, from the slow request's start: when its generation ended (the lock was released),
when the waiting request got its [DONE] (counted from its own start), when the detach went
out, and the most bytes the middleware held in host buffers. A run ends once the waiting
request is served; the slow reader is then dropped (tests/hook/test_asgi_detach.py checks
that a detached stream is delivered whole).

Run: `python -m bench.bench_egress` (or `make bench`). Writes bench/results/egress.json and
egress.png.
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, spread, write_result
from kvwatch.collect.diag.snapshot import take_snapshot
from kvwatch.hookserver.registry import EngineStream
from kvwatch.lab.agent_thread import HookServerThread
from kvwatch.lab.llama_servers import MODEL, SERVER_SNDBUF_BYTES, llama_completion, serving_llama
from kvwatch.lab.tiny_gguf import write_tiny_llama
from kvwatch.sockets import sndbuf_full

SLOW_TOKENS = 2000
WAITING_TOKENS = 50
READ_BYTES_PER_SECOND = 8 * 1024
READ_CHUNK_BYTES = 1024
WAITING_AFTER_SECONDS = 1.0
BUFFER_BYTES = 64 * 1024 * 1024
BACKED_UP_SECONDS = 2.0
DIAG_POLL_SECONDS = 0.1
REPETITIONS = 3
RUN_TIMEOUT_SECONDS = 180.0
MODES: dict[str, dict[str, int]] = {
    "coupled": {"detach_buffer_bytes": 0},
    "decoupled": {"egress_buffer_bytes": BUFFER_BYTES},
    "detach on demand": {"detach_buffer_bytes": BUFFER_BYTES},
}
FIGURES = ("lock_released_seconds", "waiting_served_seconds", "peak_buffered_bytes")


def read_slowly(client: socket.socket, stop: threading.Event) -> None:
    """Reads READ_BYTES_PER_SECOND until the stream ends or `stop` is set."""
    client.settimeout(RUN_TIMEOUT_SECONDS)
    while not stop.is_set():
        chunk = client.recv(READ_CHUNK_BYTES)
        if not chunk or chunk.endswith(b"0\r\n\r\n"):
            return
        time.sleep(len(chunk) / READ_BYTES_PER_SECOND)


def read_whole(port: int, tokens: int) -> None:
    """A request read at full speed, to the end of its chunked body."""
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.settimeout(RUN_TIMEOUT_SECONDS)
        client.sendall(llama_completion(port, tokens))
        data = bytearray()
        while not data.endswith(b"0\r\n\r\n"):
            chunk = client.recv(65536)
            if not chunk:
                raise RuntimeError("the server closed the waiting request before its end")
            data += chunk


class GenerationEnds:
    """The hook server's change callback: the first stream announced (the slow one: the
    waiting one is announced at its first token, once it has the lock) and when each
    stream's generation ended (the hook said it holds no KV, or closed it)."""

    def __init__(self) -> None:
        self.first: str | None = None
        self.at: dict[str, float] = {}

    def __call__(self, request_id: str, stream: EngineStream | None) -> None:
        self.first = self.first or request_id
        if stream is None or stream.kv_blocks == 0:
            self.at.setdefault(request_id, time.monotonic())


def detach_when_backed_up(
    agent: HookServerThread, server_port: int, client_port: int, stop: threading.Event
) -> float | None:
    """The agent's trigger, emulated: once the server socket to `client_port` has had a full
    send buffer for BACKED_UP_SECONDS, detach its stream; when the detach went out."""
    full_since: float | None = None
    while not stop.wait(DIAG_POLL_SECONDS):
        entries = take_snapshot([server_port]).entries
        mine = [e for e in entries if e.local.port == server_port and e.remote.port == client_port]
        now = time.monotonic()
        if not mine or not sndbuf_full(mine[0].wmem_queued, mine[0].sndbuf):
            full_since = None
            continue
        full_since = full_since or now
        stream = agent.stream()
        if stream is not None and now - full_since >= BACKED_UP_SECONDS:
            outcome = agent.command("detach", stream.request_id)
            if outcome.status != "detached":
                raise RuntimeError(f"detach {outcome.status}: {outcome.detail}")
            return now
    return None


def run_once(model_path: Path, mode: str) -> dict[str, float]:
    ends = GenerationEnds()
    socket_path = str(model_path.parent / f"agent-{time.monotonic_ns()}.sock")
    agent = HookServerThread(socket_path, on_change=ends)
    stop = threading.Event()
    detached: list[float | None] = []
    try:
        with serving_llama("uvicorn", model_path, socket_path, **MODES[mode]) as (server, mw):
            started = time.monotonic()
            slow = socket.create_connection(("127.0.0.1", server.port))
            slow.sendall(llama_completion(server.port, SLOW_TOKENS))
            reader = threading.Thread(target=read_slowly, args=(slow, stop), daemon=True)
            reader.start()
            if mode == "detach on demand":
                client_port = slow.getsockname()[1]
                trigger = threading.Thread(
                    target=lambda: detached.append(
                        detach_when_backed_up(agent, server.port, client_port, stop)
                    ),
                    daemon=True,
                )
                trigger.start()
            time.sleep(WAITING_AFTER_SECONDS)  # the waiting request comes a second later
            asked = time.monotonic()
            read_whole(server.port, WAITING_TOKENS)
            served = time.monotonic() - asked
            stop.set()
            slow.close()
            reader.join(RUN_TIMEOUT_SECONDS)
            peak = mw.egress_budget.peak_bytes
    finally:
        stop.set()
        agent.close()
    assert ends.first is not None, "the slow stream was announced"
    result = {
        "lock_released_seconds": round(ends.at[ends.first] - started, 2),
        "waiting_served_seconds": round(served, 2),
        "peak_buffered_bytes": peak,
    }
    if detached and detached[0] is not None:
        result["detached_at_seconds"] = round(detached[0] - started, 2)
    return result


def summarise(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "runs": runs,
        **{figure: spread([run[figure] for run in runs]) for figure in FIGURES},
    }


def plot(modes: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(modes)
    figure, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for axis, key, title, scale in (
        (axes[0], "lock_released_seconds", "generation lock released after (s)", 1),
        (axes[1], "waiting_served_seconds", "waiting request served after (s)", 1),
        (axes[2], "peak_buffered_bytes", "most bytes buffered (KB)", 1024),
    ):
        medians = [modes[n][key]["median"] / scale for n in names]
        low = [m - modes[n][key]["min"] / scale for m, n in zip(medians, names, strict=True)]
        high = [modes[n][key]["max"] / scale - m for m, n in zip(medians, names, strict=True)]
        axis.bar(names, medians, yerr=[low, high], color=["#c44", "#48c", "#4a4"], capsize=4)
        axis.set_title(title, fontsize=9)
        axis.tick_params(axis="x", labelsize=8)
        for index, value in enumerate(medians):
            axis.annotate(f"{value:.1f}", (index, value), ha="center", va="bottom", fontsize=8)
    figure.suptitle(
        f"llama-cpp-python, a {READ_BYTES_PER_SECOND // 1024} KB/s reader of {SLOW_TOKENS} "
        f"tokens and one waiting request (median and range of {REPETITIONS} runs)",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvw-egress-") as workdir:
        model_path = write_tiny_llama(Path(workdir) / "tiny.gguf", MODEL)
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for _ in range(REPETITIONS):  # modes interleaved: a noisy neighbour hits them all
            for mode in MODES:
                runs[mode].append(run_once(model_path, mode))
                print(mode, runs[mode][-1], flush=True)
    modes = {mode: summarise(mode_runs) for mode, mode_runs in runs.items()}
    payload = {
        "engine": "llama-cpp-python",
        "slow_tokens": SLOW_TOKENS,
        "waiting_tokens": WAITING_TOKENS,
        "read_bytes_per_second": READ_BYTES_PER_SECOND,
        "client_receive_buffer": "kernel default",
        "waiting_after_seconds": WAITING_AFTER_SECONDS,
        "server_sndbuf_bytes": SERVER_SNDBUF_BYTES,
        "buffer_bytes": BUFFER_BYTES,
        "detach_trigger": (
            f"the holder's server socket send buffer full (sock_diag) for {BACKED_UP_SECONDS} s"
        ),
        "repetitions": REPETITIONS,
        "modes": modes,
    }
    print(write_result("egress", payload))
    plot(modes, RESULTS / "egress.png")


if __name__ == "__main__":
    main()

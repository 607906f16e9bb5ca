"""The real `vllm serve` (vLLM's OpenAI API server and its EngineCore process) with kvwatch's
scheduler and middleware and the deterministic executor, as a subprocess the tests start and
end; a streaming client; and the middleware's control socket."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.knobs import KV_BLOCKS_ENV, STEP_SECONDS_ENV

INTEGRATION_DIR = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
START_TIMEOUT_SECONDS = 180.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class VllmServer:
    port: int
    control_path: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def vllm_server(
    model_dir: Path,
    work_dir: Path,
    *,
    step_seconds: float,
    hook_socket: Path | None = None,
    kv_blocks: int | None = None,
    max_model_len: int = 1024,
    extra_args: tuple[str, ...] = (),
) -> Iterator[VllmServer]:
    """Starts `vllm serve`, waits until it answers /health, yields, then ends the process
    group it started (the API server and its EngineCore). The middleware's hook connects to
    `hook_socket` (None: a path no agent listens on), the executor offers `kv_blocks` blocks
    (None: its default)."""
    port = free_port()
    control_path = work_dir / "control.sock"
    log_path = work_dir / "vllm-serve.log"
    env = {
        **os.environ,
        "PYTHONPATH": str(INTEGRATION_DIR),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "KVWATCH_ENGINE_SOCKET": str(hook_socket or work_dir / "no-agent.sock"),
        "KVWATCH_VLLM_CONTROL_SOCKET": str(control_path),
        STEP_SECONDS_ENV: str(step_seconds),
    }
    if kv_blocks is not None:
        env[KV_BLOCKS_ENV] = str(kv_blocks)
    command = [
        str(VENV_BIN / "vllm"),
        "serve",
        str(model_dir),
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--load-format",
        "dummy",
        "--max-model-len",
        str(max_model_len),
        "--served-model-name",
        "tiny",
        "--distributed-executor-backend",
        "tests.support.executor.DeterministicExecutor",
        "--scheduler-cls",
        "kvwatch_vllm.scheduler.KvwatchScheduler",
        "--middleware",
        "kvwatch_vllm.middleware.Middleware",
        *extra_args,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=work_dir,
        )
    server = VllmServer(port, control_path, process, log_path)
    started = time.monotonic()
    try:
        _wait_healthy(server)
        print(f"\nvllm serve healthy in {time.monotonic() - started:.1f} s")
        yield server
    finally:
        _end(process)


def _wait_healthy(server: VllmServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    delay = 0.2
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"vllm serve exited:\n{server.log_tail()}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)
    raise AssertionError(
        f"vllm serve not healthy in {START_TIMEOUT_SECONDS} s:\n{server.log_tail()}"
    )


def _end(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group this test started, SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


@dataclass
class Stream:
    """A streaming completion read on a thread: the raw body, the token ids of each chunk, and
    events for the first chunk and the end."""

    body: bytearray = field(default_factory=bytearray)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_chunk: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    chunk_times: list[float] = field(default_factory=list)
    error: BaseException | None = None


def stream_completion(port: int, request_id: str, prompt: list[int], max_tokens: int) -> Stream:
    stream = Stream()
    payload = json.dumps(
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "return_token_ids": True,
            "ignore_eos": True,
        }
    )

    def read() -> None:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            connection.request(
                "POST",
                "/v1/completions",
                body=payload,
                headers={"Content-Type": "application/json", "X-Request-Id": request_id},
            )
            response = connection.getresponse()
            assert response.status == 200, response.read()
            while line := response.readline():
                stream.body += line
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                choice = json.loads(text[len("data: ") :])["choices"][0]
                stream.token_ids += choice.get("token_ids") or []
                stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
                stream.chunk_times.append(time.monotonic())
                stream.first_chunk.set()
        except BaseException as exc:  # reported by the test
            stream.error = exc
        finally:
            stream.first_chunk.set()
            stream.done.set()

    threading.Thread(target=read, name=f"client-{request_id}", daemon=True).start()
    return stream


def control(path: Path, command: str, request_id: str) -> dict[str, Any]:
    """One command over the middleware's control socket (kvwatch_vllm.control)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(30)
        connection.connect(str(path))
        with connection.makefile("rwb") as channel:
            channel.write(
                json.dumps({"command": command, "request_id": request_id}).encode() + b"\n"
            )
            channel.flush()
            answer: dict[str, Any] = json.loads(channel.readline())
            return answer

"""Labs of network namespaces with a server in them (kvwatch.lab.netlab): a token server
(`Lab`, `start_token_lab`) or the reference engine (`EngineLab`), the agent watching their port
from the host (`Agent`), and what a client of the engine received, parsed (`parse_stream`).
Used by the verdict tests (tests/verdicts) and the benchmarks."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvwatch.lab.harness import stack as processes
from kvwatch.lab.loadgen.http import (
    ResponseParser,
    SseParser,
    Target,
    build_request,
    completion_body,
    parse_chunk,
)
from kvwatch.lab.netlab import Link, NetLab
from kvwatch.lab.readers import Reader
from kvwatch.lab.waiting import wait_until
from kvwatch.tools.client import get_json

FIRST_SERVER_PORT = 18080
PROCESS_SLOTS = 64


def _claim_slot() -> tuple[int, socket.socket]:
    """A slot no other live process on this machine holds, claimed by binding an abstract
    socket's name (released when the process ends): the labs of tests that run side by side
    (pytest-xdist workers) each get their own server port, so an agent watching one process's
    port never sees another's labs, although every namespace is in the kernel's view."""
    for slot in range(PROCESS_SLOTS):
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            claim.bind(f"\0kvwatch-lab-slot-{slot}")
        except OSError:
            claim.close()
            continue
        return slot, claim
    raise RuntimeError(f"{PROCESS_SLOTS} processes already run labs on this machine")


_SLOT, _SLOT_CLAIM = _claim_slot()
# The port every lab of this process serves on, in its own namespace.
SERVER_PORT = FIRST_SERVER_PORT + _SLOT
# A fast model's stream: 80 events of ~200 bytes a second; every reader below is slower.
SERVER_BYTES_PER_SECOND = 16384


@dataclass
class Lab:
    """A NetLab with a token server listening in its server namespace, and its readers."""

    net: NetLab
    server: subprocess.Popen[bytes]
    readers: list[Reader] = field(default_factory=list)

    def connect(self, reader: Reader, request: bytes = b"stream\n") -> Reader:
        reader.connect(self.net.client_socket(), self.net.server_ip, SERVER_PORT, request)
        self.readers.append(reader)
        return reader

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.server.terminate()
        self.server.wait(timeout=10)
        self.net.close()


def start_token_lab(workdir: Path, link: Link) -> Lab:
    """A NetLab over `link` with the token server listening in its server namespace."""
    net = NetLab(link)
    try:
        log = workdir / f"server-{net.server_ns}.log"
        server = net.spawn_server(
            "kvwatch.lab.token_server",
            net.server_ip,
            str(SERVER_PORT),
            str(SERVER_BYTES_PER_SECOND),
            log=log,
        )
        deadline = time.monotonic() + 10
        while "listening" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    except BaseException:
        net.close()
        raise
    return Lab(net, server)


class Agent(processes.Stack):
    """`kvwatch run` in enforce mode with the reset action on the labs' server port."""

    def start(self, *args: str, env: dict[str, str] | None = None) -> processes.Service:
        return self.start_agent(
            "--mode", "enforce", "--action", "reset", "--grace-seconds", "0",
            "--max-cancels-per-minute", "1000", *args,
            port=SERVER_PORT, audit=f"audit-{len(self.services)}.jsonl", env=env,
        )  # fmt: skip

    def acts(self) -> list[dict[str, Any]]:
        return [e for e in self.audit_entries("decision") if e["verdict"] == "act"]

    @staticmethod
    def cli(*args: str) -> str:
        """A kvwatch command as a user runs it; its standard output."""
        done = subprocess.run(
            [*processes.kvwatch_command(), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return done.stdout

    def sockets_json(self, *args: str) -> list[dict[str, Any]]:
        """`kvwatch sockets --json` on the server port."""
        rows: list[dict[str, Any]] = json.loads(
            self.cli("sockets", "--port", str(SERVER_PORT), "--json", *args)
        )
        return rows

    def streams(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = get_json(self.agent_url, "/api/v1/streams")
        return rows

    def metrics(self) -> str:
        return httpx.get(f"{self.agent_url}/metrics", timeout=5).text


MODEL = "kvwatch-reference-tiny"
PROMPT = "Tell me a story about a lighthouse keeper."
# ~207 bytes of SSE a token. A client with a default receive buffer, the server's autotuned
# send buffer and the engine's write buffer hold ~300 KB between them (~1450 tokens: measured,
# a 1500-token answer to a client that stopped reading finished unblocked over this link), so
# a long answer (a reasoning model's) pins its KV once they are full: 1900 tokens, ~390 KB,
# as long as the tiny model's context (2048) allows after the prompt.
MAX_TOKENS = 1900
ENGINE_ARGS = (
    "--model-size", "tiny", "--egress", "coupled", "--kv-blocks", "256",
    "--max-tokens-limit", "4000",
)  # fmt: skip


@dataclass(frozen=True)
class Stream:
    """What a client received: the text, the token events, whether `[DONE]` came."""

    text: str
    tokens: int
    done: bool
    finish_reason: str | None


def parse_stream(raw: bytes | bytearray) -> Stream:
    response, sse = ResponseParser(), SseParser()
    text: list[str] = []
    tokens, done, finish = 0, False, None
    for data in sse.feed(response.feed(bytes(raw))):
        if data == "[DONE]":
            done = True
            continue
        piece, reason = parse_chunk(data, "completions")
        text.append(piece)
        tokens += bool(piece)
        finish = reason or finish
    return Stream("".join(text), tokens, done, finish)


class EngineLab(Lab):
    """A Lab (tests/verdicts/conftest.py) whose server is the reference engine, with its hook
    socket in the test's directory (the agent on the host reaches it through the file
    system)."""

    def __init__(self, workdir: Path, link: Link, *engine_args: str) -> None:
        net = NetLab(link)
        self.hook_socket = workdir / "engine.sock"
        try:
            engine = net.spawn_server(
                "kvwatch.cli", "engine", "--host", net.server_ip, "--port", str(SERVER_PORT),
                "--kvwatch-socket", str(self.hook_socket), *ENGINE_ARGS, *engine_args,
                log=workdir / "engine.log",
            )  # fmt: skip
        except BaseException:
            net.close()
            raise
        super().__init__(net, engine)
        try:
            wait_until(self._up, timeout_seconds=60, poll_seconds=0.2)
        except BaseException:
            self.close()
            raise

    def engine_request(self, request_id: str) -> dict[str, Any]:
        """The engine's own account of one request (GET /v1/requests): its state, the tokens
        it generated and those its writer took."""
        report: dict[str, Any] = self.get(f"/v1/requests/{request_id}").json()
        return report

    @property
    def url(self) -> str:
        return f"http://{self.net.server_ip}:{SERVER_PORT}"

    def _up(self) -> bool:
        assert self.server.poll() is None, "the engine exited"
        try:
            return self.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def get(self, path: str) -> httpx.Response:
        """A GET from inside the client namespace (the engine is reachable only there)."""
        return self.net.run_in(
            self.net.client_ns, lambda: httpx.get(f"{self.url}{path}", timeout=5)
        )

    def request(self, reader: Reader, request_id: str, max_tokens: int = MAX_TOKENS) -> Reader:
        """`reader` streams a completion of `max_tokens` under `request_id` to its end."""
        body = completion_body("completions", MODEL, PROMPT, max_tokens)
        request = build_request(Target.parse(self.url), "POST", "/v1/completions", body, request_id)
        reader.eof_ends = True
        return self.connect(reader, request)

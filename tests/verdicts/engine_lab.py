"""The reference engine in a test network (tests/verdicts/netlab.py): its server namespace
holds the engine, the client namespace the readers, the hook socket is in a directory the
agent on the host reaches; and what a client received, parsed. Used by the park tests and
bench/bench_time_to_free.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvwatch.loadgen.http import (
    ResponseParser,
    SseParser,
    Target,
    build_request,
    completion_body,
    parse_chunk,
)
from tests.waiting import wait_until

from .conftest import SERVER_PORT, Lab
from .netlab import Link, NetLab
from .readers import Reader

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


@pytest.fixture
def engine_lab(tmp_path: Path) -> Iterator[Any]:
    made: list[EngineLab] = []

    def make(link: Link, *engine_args: str) -> EngineLab:
        lab = EngineLab(tmp_path, link, *engine_args)
        made.append(lab)
        return lab

    yield make
    for lab in made:
        lab.close()

"""The reference engine and the agent as the end-to-end tests of the cut run them
(kvwatch.lab.harness.stack), and their clients: a labelled small-buffer variant in which a
stall and its proof come after a few hundred tokens. Requests carry X-Request-Id `<class>-…`,
so the engine's request IDs (`cmpl-stalled-…`) tell which client a decision was about."""

from __future__ import annotations

import asyncio
import socket

from kvwatch.lab.harness import demo
from kvwatch.lab.harness import stack as processes
from kvwatch.lab.loadgen import LoadPlan, LoadReport, run_load
from kvwatch.lab.loadgen.http import Target, build_request, completion_body

# The demo's engine with room for the tests' long generations. These tests are about the
# cut, so they run a labelled variant: an 8 KiB send buffer and 4 KB clients, with which a
# stall and its proof come after a few hundred tokens (pausing and parking at default
# buffers are tests/verdicts/test_reader_paced.py's).
ENGINE_ARGS = (*demo.ENGINE_ARGS, "--sndbuf-bytes", "8192", "--max-tokens-limit", "4000")
STALL_SECONDS = 2.0


class CutStack(processes.Stack):
    """kvwatch.lab.harness.stack.Stack with the tests' engine, a 2 s stall threshold, no grace
    period, pause and park off (these tests are about the cut; a test of holding passes
    `--pause on`, which wins, being later), plus the test clients."""

    def start_engine(self, *args: str) -> processes.Service:
        return super().start_engine(*ENGINE_ARGS, *args)

    def start_agent(
        self,
        *args: str,
        port: int | None = None,
        audit: str = "",
        env: dict[str, str] | None = None,
    ) -> processes.Service:
        return super().start_agent(
            "--stall-seconds",
            str(STALL_SECONDS),
            "--grace-seconds",
            "0",
            "--pause",
            "off",
            "--park",
            "off",
            *args,
            port=port,
            audit=audit,
            env=env,
        )

    def load(
        self,
        seconds: float,
        healthy: int = 2,
        slow: int = 1,
        stalled: int = 2,
        max_tokens: int = 1500,
    ) -> LoadReport:
        plan = LoadPlan(
            url=self.engine_url,
            healthy=healthy,
            slow=slow,
            stalled=stalled,
            duration_seconds=seconds,
            max_tokens=max_tokens,
            slow_bytes_per_second=demo.SLOW_BYTES_PER_SECOND,
            rcvbuf_bytes=4096,
        )
        return asyncio.run(run_load(plan))

    def spawn_stalled_client(self, request_id: str = "held-1") -> socket.socket:
        """A client that asks for a long stream, reads its first bytes, then stops reading."""
        body = completion_body("completions", "kvwatch-reference-tiny", "Tell me a story.", 1500)
        request = build_request(
            Target.parse(self.engine_url), "POST", "/v1/completions", body, request_id
        )
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", self.engine_port))
        client.sendall(request)
        assert client.recv(256), "the stream started"
        return client

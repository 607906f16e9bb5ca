"""A local control socket in the API server process: the same pause, park and resume the
agent's commands run, by stream id (the X-Request-Id), for an operator or a test, without the
agent. Off unless KVWATCH_VLLM_CONTROL_SOCKET names a path; the socket is created mode 0600.

One JSON object per line each way:

    → {"command": "pause" | "park" | "resume", "request_id": "<X-Request-Id>"}
    ← {"request_id": ..., "status": ..., "freed_blocks": n, "freed_bytes": n, "detail": ...}
    → {"command": "kv_state", "request_id": "<X-Request-Id>"}
    ← {"free_blocks": n, "total_blocks": n, "held": {...}, "blocks": {...}, "engine_ids": [...]}
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

CONTROL_SOCKET_ENV = "KVWATCH_VLLM_CONTROL_SOCKET"
MAX_LINE_BYTES = 4096

_log = logging.getLogger("kvwatch_vllm.control")

Handler = Callable[[str], dict[str, Any]]


class ControlServer:
    """Serves the control socket on daemon threads; `handlers` maps a command to a function
    of the request id that returns the JSON answer."""

    def __init__(self, path: str, handlers: dict[str, Handler]) -> None:
        self.path = path
        self._handlers = handlers
        self._listener: socket.socket | None = None

    def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(self.path)
        finally:
            os.umask(old_umask)
        listener.listen(8)
        self._listener = listener
        threading.Thread(target=self._accept, name="kvwatch-vllm-control", daemon=True).start()
        _log.info("kvwatch-vllm control socket at %s", self.path)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve,
                args=(connection,),
                name="kvwatch-vllm-control-conn",
                daemon=True,
            ).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection, connection.makefile("rwb") as stream:
            for line in stream:
                if len(line) > MAX_LINE_BYTES:
                    answer: dict[str, Any] = {"error": "line too long"}
                else:
                    answer = self._answer(line)
                stream.write(json.dumps(answer).encode() + b"\n")
                stream.flush()

    def _answer(self, line: bytes) -> dict[str, Any]:
        try:
            message = json.loads(line)
            command, request_id = message["command"], message["request_id"]
        except (ValueError, KeyError, TypeError) as exc:
            return {"error": f"not a command line: {exc}"}
        handler = self._handlers.get(command) if isinstance(command, str) else None
        if handler is None or not isinstance(request_id, str):
            return {"error": f"unknown command {command!r}; one of {sorted(self._handlers)}"}
        try:
            return handler(request_id)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

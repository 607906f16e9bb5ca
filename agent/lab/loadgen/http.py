"""Just enough HTTP/1.1 and SSE for the load generator, parsed incrementally from raw bytes.

The load generator reads sockets itself (to read slowly, or to stop reading), so it cannot use
an HTTP client library; these parsers turn whatever bytes arrived into body bytes and events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from kvwatch.errors import ConfigError, quoted

Endpoint = Literal["completions", "chat"]
MAX_HEAD_BYTES = 64 * 1024
ABORT_FINISH_REASONS = ("abort", "cancelled")


class ResponseError(Exception):
    """The server's bytes are not a valid HTTP/1.1 response or OpenAI stream."""


@dataclass(frozen=True)
class Target:
    """Where to send requests: `http://host:port[/prefix]`; the API lives under prefix + /v1."""

    host: str
    port: int
    api_prefix: str

    @classmethod
    def parse(cls, url: str) -> Target:
        try:
            parts = urlsplit(url)
        except ValueError as exc:  # "Invalid IPv6 URL"
            raise ConfigError(
                f"not a URL: {quoted(url)} ({exc})",
                "pass the server's base URL as http://HOST:PORT",
            ) from exc
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(
                f"unsupported URL {url!r}",
                "pass the server's base URL as http://HOST:PORT (https is not supported)",
            )
        try:
            port = parts.port or 80
        except ValueError as exc:
            raise ConfigError(f"bad port in URL {url!r}", "use http://HOST:PORT") from exc
        prefix = parts.path.rstrip("/")
        if not prefix.endswith("/v1"):
            prefix += "/v1"
        return cls(parts.hostname, port, prefix)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.host_header}"

    def path(self, endpoint: Endpoint) -> str:
        return f"{self.api_prefix}/{'chat/completions' if endpoint == 'chat' else 'completions'}"


def build_request(
    target: Target,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    request_id: str | None = None,
) -> bytes:
    """One HTTP/1.1 request that asks the server to close the connection after the response.
    `request_id` goes out as X-Request-Id, so server-side logs name the client class."""
    payload = json.dumps(body).encode() if body is not None else b""
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: {target.host_header}",
        "User-Agent: kvwatch-loadgen",
        "Accept: text/event-stream, application/json",
        "Connection: close",
    ]
    if request_id is not None:
        lines.append(f"X-Request-Id: {request_id}")
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def completion_body(endpoint: Endpoint, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


class ResponseParser:
    """Parses one HTTP/1.1 response: head, then a chunked, sized or close-delimited body.

    Owned by one connection's reader. `feed` returns the body bytes decoded from the data;
    `complete` turns true once the whole body was received.
    """

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.complete = False
        self._buffer = bytearray()
        self._mode: Literal["head", "chunk_size", "chunk_data", "chunk_end", "trailer", "sized"]
        self._mode = "head"
        self._remaining = 0
        self._until_close = False

    def feed(self, data: bytes) -> bytes:
        self._buffer += data
        body = bytearray()
        while self._buffer and not self.complete and self._step(body):
            pass
        return bytes(body)

    def eof(self) -> None:
        """The peer closed; a close-delimited body is complete now."""
        if self._until_close:
            self.complete = True

    def _step(self, body: bytearray) -> bool:
        """Consumes one element of the buffer; False when it needs more data."""
        if self._mode == "head":
            return self._parse_head()
        if self._mode in ("sized", "chunk_data"):
            count = len(self._buffer)
            if not self._until_close:
                count = min(count, self._remaining)
                self._remaining -= count
            body += self._buffer[:count]
            del self._buffer[:count]
            if not self._until_close and self._remaining == 0:
                self.complete = self._mode == "sized"
                self._mode = "chunk_end" if self._mode == "chunk_data" else "sized"
            return True
        line = self._take_line()
        if line is None:
            return False
        if self._mode == "chunk_size":
            self._start_chunk(line)
        elif self._mode == "chunk_end":
            self._mode = "chunk_size"
        elif not line:  # an empty line ends the trailer
            self.complete = True
        return True

    def _take_line(self) -> bytes | None:
        end = self._buffer.find(b"\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise ResponseError("chunk framing line too long")
            return None
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return line

    def _parse_head(self) -> bool:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise ResponseError("response head larger than 64 KiB")
            return False
        status_line, *header_lines = self._buffer[:end].decode("latin-1").split("\r\n")
        del self._buffer[: end + 4]
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ResponseError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        self.status = int(parts[1])
        for header in header_lines:
            name, _, value = header.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self._choose_body_mode()
        return True

    def _choose_body_mode(self) -> None:
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._mode = "chunk_size"
            return
        self._mode = "sized"
        length = self.headers.get("content-length")
        if length is None:
            self._until_close = True
        elif length.isdigit():
            self._remaining = int(length)
            self.complete = self._remaining == 0
        else:
            raise ResponseError(f"bad Content-Length {length!r}")

    def _start_chunk(self, line: bytes) -> None:
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError as exc:
            raise ResponseError(f"bad chunk size {size_text[:20]!r}") from exc
        self._remaining = size
        self._mode = "chunk_data" if size else "trailer"


class SseParser:
    """Splits a text/event-stream body into the `data` of each event (multi-line data joined)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: list[str] = []

    def feed(self, body: bytes) -> list[str]:
        self._buffer += body
        *lines, rest = self._buffer.split(b"\n")
        self._buffer = bytearray(rest)
        events: list[str] = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events


def parse_chunk(payload: str, endpoint: Endpoint) -> tuple[str, str | None]:
    """(generated text, finish_reason) of one streamed OpenAI chunk."""
    try:
        chunk = json.loads(payload)
    except ValueError as exc:
        raise ResponseError(f"stream chunk is not JSON: {payload[:80]!r}") from exc
    if not isinstance(chunk, dict):
        raise ResponseError(f"stream chunk is not an object: {payload[:80]!r}")
    if "error" in chunk:
        raise ResponseError(f"server error in stream: {str(chunk['error'])[:200]}")
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "", None  # e.g. a usage-only chunk
    choice = choices[0]
    source = choice.get("delta") if endpoint == "chat" else choice
    text = (
        source.get("content" if endpoint == "chat" else "text") if isinstance(source, dict) else ""
    )
    reason = choice.get("finish_reason")
    return (text if isinstance(text, str) else ""), (reason if isinstance(reason, str) else None)

"""A client of the agent's HTTP API, for the commands that read a running daemon.

Whatever is at the other end, a caller gets what it asked for or one KvwatchError naming the
URL: `AgentUnreachableError` when nothing answers there, a KvwatchError when something answers that
is not a kvwatch agent (not JSON, the wrong shape, a body without end). A request takes at most
its timeout twice over and reads at most MAX_ANSWER_BYTES. URLs and stream ids are checked
before they are used (ConfigError: bad input); an id travels percent-encoded, dots too, so `..`
is an id and never a step up the path.
"""

from __future__ import annotations

import json
import time
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import httpx

from kvwatch.errors import ConfigError, KvwatchError, quoted
from kvwatch.hookwire.protocol import MAX_ID_CHARS

MAX_URL_CHARS = 2048
# A /api/v1/sockets answer of a node at collector.max_sockets' default is a few MB.
MAX_ANSWER_BYTES = 256 << 20
EXPLAIN_PATH = "/api/v1/explain/"
_SHAPE_NAMES: dict[type[Any], str] = {dict: "a JSON object", list: "a JSON array", object: "JSON"}
_URL_FIX = "pass --url the agent's HTTP address, e.g. http://127.0.0.1:9431"
_NOT_AN_AGENT_FIX = "check --url: is a kvwatch agent (of this version) listening there?"


class AgentUnreachableError(KvwatchError):
    """Nothing answers at the agent's URL (refused, unreachable, timed out)."""


def _unprintable(text: str) -> str | None:
    """What in `text` cannot be part of a URL or an id typed on a command line, or None."""
    categories = {unicodedata.category(char) for char in text}
    if "Cs" in categories:
        return "bytes that are not UTF-8"
    if categories & {"Cc", "Zl", "Zp"}:
        return "a control character"
    return None


def agent_url(text: str) -> str:
    """`text` as the base URL of an agent (http or https, a host, maybe a port and a path
    prefix), without its trailing slash; ConfigError, quoting a short prefix of it, otherwise."""
    shown = quoted(text)
    problem = _unprintable(text)
    if problem is not None:
        raise ConfigError(f"--url {shown} is not a URL: it holds {problem}", _URL_FIX)
    if len(text) > MAX_URL_CHARS:
        raise ConfigError(f"--url {shown} is longer than {MAX_URL_CHARS} characters", _URL_FIX)
    try:
        url = httpx.URL(text)
    except (httpx.InvalidURL, ValueError) as exc:  # ValueError: IDNA, an odd port
        raise ConfigError(f"--url {shown} is not a URL: {quoted(str(exc))}", _URL_FIX) from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"--url {shown} is not an http:// or https:// address", _URL_FIX)
    return text.rstrip("/")


def explain_path(stream: str) -> str:
    """The API path that explains `stream` (a request id or an ip:port), the id percent-
    encoded; ConfigError for what no agent can hold (empty, over MAX_ID_CHARS, control
    characters, bytes that are not UTF-8)."""
    fix = "pass a request id or an ip:port (`kvwatch streams` lists them)"
    shown = quoted(stream)
    if not stream:
        raise ConfigError("the stream id is empty", fix)
    if len(stream) > MAX_ID_CHARS:
        raise ConfigError(
            f"the stream id {shown} is longer than {MAX_ID_CHARS} characters, the longest "
            "request id an engine can announce",
            fix,
        )
    problem = _unprintable(stream)
    if problem is not None:
        raise ConfigError(f"the stream id {shown} holds {problem}", fix)
    return EXPLAIN_PATH + quote(stream, safe="").replace(".", "%2E")


def _read_body(response: httpx.Response, url: str, deadline: float) -> bytes:
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > MAX_ANSWER_BYTES:
            raise KvwatchError(
                f"{quoted(url)} answered more than {MAX_ANSWER_BYTES} bytes", _NOT_AN_AGENT_FIX
            )
        if time.monotonic() > deadline:
            raise KvwatchError(f"{quoted(url)} answers too slowly", _NOT_AN_AGENT_FIX)
    return bytes(body)


def fetch(base_url: str, path: str, timeout_seconds: float) -> tuple[int, bytes]:
    """GET base_url + path: its status and body. AgentUnreachableError when nothing answers."""
    url = agent_url(base_url) + path
    deadline = time.monotonic() + timeout_seconds
    try:
        with httpx.stream("GET", url, timeout=timeout_seconds) as response:
            return response.status_code, _read_body(response, url, deadline)
    except httpx.HTTPError as exc:
        reason = quoted(str(exc) or type(exc).__name__)
        raise AgentUnreachableError(
            f"no kvwatch agent answers at {quoted(base_url)} ({reason})",
            "start it with `kvwatch run`, or point --url at it",
        ) from exc


def _decoded(body: bytes, url: str) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # ValueError: not JSON, not UTF-8
        raise KvwatchError(
            f"the answer from {quoted(url)} is not JSON: not a kvwatch agent", _NOT_AN_AGENT_FIX
        ) from exc


def _not_found(body: bytes, url: str) -> KvwatchError:
    """The agent's own 404 message (`explain` of an unknown stream), or what it means when
    the answer is not the agent's."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, RecursionError, AttributeError):
        error = None
    if not isinstance(error, str):
        return KvwatchError(f"{quoted(url)}: not found: not a kvwatch agent", _NOT_AN_AGENT_FIX)
    return KvwatchError(
        quoted(error, 400), "check the request id (`kvwatch streams` lists live ones)"
    )


def get_json(
    base_url: str, path: str, timeout_seconds: float = 5.0, shape: type[Any] = object
) -> Any:
    """GET base_url + path as JSON of `shape` (dict, list; object: any). AgentUnreachableError when
    nothing answers; KvwatchError naming the URL for an error status or an answer that is not
    JSON of that shape."""
    url = base_url.rstrip("/") + path
    status, body = fetch(base_url, path, timeout_seconds)
    if status == 404:
        raise _not_found(body, url)
    if status != 200:
        raise KvwatchError(
            f"{quoted(url)} answered HTTP {status}", "see the agent's log, and check --url"
        )
    document = _decoded(body, url)
    if not isinstance(document, shape):
        raise KvwatchError(
            f"the answer from {quoted(url)} is JSON but not {_SHAPE_NAMES[shape]}: not a "
            "kvwatch agent",
            _NOT_AN_AGENT_FIX,
        )
    return document


def get_text(base_url: str, path: str, timeout_seconds: float = 5.0) -> str:
    """GET base_url + path as text (for /metrics); the errors of `get_json`."""
    url = base_url.rstrip("/") + path
    status, body = fetch(base_url, path, timeout_seconds)
    if status != 200:
        raise KvwatchError(
            f"{quoted(url)} answered HTTP {status}", "see the agent's log, and check --url"
        )
    return body.decode("utf-8", "replace")


@contextmanager
def reading_answer(url: str) -> Iterator[None]:
    """Around code that reads an agent's answer: what a malformed answer makes it raise (a
    missing key, a value of the wrong type or an unknown state) becomes one KvwatchError
    naming `url`."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise KvwatchError(
            f"the answer from {quoted(url)} is not what a kvwatch agent sends "
            f"({type(exc).__name__}: {quoted(str(exc))})",
            _NOT_AN_AGENT_FIX,
        ) from exc

"""The OpenAI-compatible surface: request parsing and validation, response and chunk bodies.

Pure functions on JSON values; the HTTP plumbing is in `kvwatch.lab.engine.engine_server`.
Deliberate differences from OpenAI: temperature defaults to 0 (greedy, deterministic with the
engine's seed), `n` must be 1, and unknown fields are ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvwatch.lab.engine.output import Finish

DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256
MAX_REQUEST_ID_CHARS = 128
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A request the API refuses, as OpenAI reports it: HTTP status, message, type, param, code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion or chat request. `chat` selects the response format."""

    chat: bool
    prompt: str
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    include_usage: bool


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def parse_request(
    body: dict[str, Any], *, chat: bool, model: str, max_tokens_limit: int
) -> ParsedRequest:
    """Validates an OpenAI completion (`chat=False`) or chat completion body."""
    requested_model = _optional(body, "model", str)
    if requested_model is not None and requested_model != model:
        raise ApiError(
            404,
            f"the model {requested_model!r} does not exist; this engine serves {model!r}",
            param="model",
            code="model_not_found",
        )
    prompt = _chat_prompt(body) if chat else _completion_prompt(body)
    default_max = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
    max_tokens = _max_tokens(body, chat, min(default_max, max_tokens_limit), max_tokens_limit)
    temperature = _optional(body, "temperature", (int, float))
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise ApiError(400, "temperature must be in [0, 2]", param="temperature")
    n = _optional(body, "n", int)
    if n is not None and n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    stream = bool(_optional(body, "stream", bool))
    options = _optional(body, "stream_options", dict)
    if options is not None and not stream:
        raise ApiError(400, "stream_options needs stream: true", param="stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError(400, "include_usage must be a boolean", param="stream_options")
    return ParsedRequest(
        chat=chat,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=float(temperature or 0.0),
        seed=_optional(body, "seed", int),
        stream=stream,
        include_usage=include_usage,
    )


def _optional(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and kind in (int, (int, float)):
        raise ApiError(400, f"{name} must be a number, not a boolean", param=name)
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "number"
        raise ApiError(400, f"{name} must be of type {names}", param=name)
    return value


def _max_tokens(body: dict[str, Any], chat: bool, default: int, limit: int) -> int:
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    value = _optional(body, name, int)
    if value is None:
        return default
    if not 1 <= value <= limit:
        raise ApiError(400, f"{name} must be in [1, {limit}], got {value}", param=name)
    return int(value)


def _completion_prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string", param="prompt")
    return prompt


def _chat_prompt(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array", param="messages")
    lines: list[str] = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in CHAT_ROLES:
            raise ApiError(
                400,
                f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}",
                param=f"messages[{index}].role",
            )
        lines.append(f"<|{role}|>\n{_message_text(message.get('content'), index)}\n")
    return "".join(lines) + "<|assistant|>\n"


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise ApiError(
        400,
        f"messages[{index}].content must be a string or an array of text parts",
        param=f"messages[{index}].content",
    )


def request_id(chat: bool, header_value: str | None) -> str:
    """`cmpl-…` or `chatcmpl-…`, after the client's X-Request-Id when it sent one."""
    prefix = "chatcmpl-" if chat else "cmpl-"
    if header_value is None:
        return prefix + uuid.uuid4().hex
    if (
        not header_value
        or len(header_value) > MAX_REQUEST_ID_CHARS
        or not header_value.isprintable()
    ):
        raise ApiError(
            400,
            f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} printable characters",
            param="X-Request-Id",
        )
    return prefix + header_value


class ResponseFormat:
    """Builds the response bodies of one request, completion or chat, streamed or not."""

    def __init__(self, chat: bool, request_id: str, model: str) -> None:
        self.chat = chat
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _choice(
        self, text: str | None, finish_reason: str | None, *, chunk: bool
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if not self.chat:
            choice["text"] = text or ""
        elif chunk:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text or ""}
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        return choice

    def full(self, text: str, finish: Finish) -> dict[str, Any]:
        """The non-streaming response."""
        return {
            **self._envelope(chunk=False),
            "choices": [self._choice(text, finish.reason, chunk=False)],
            "usage": _usage(finish),
        }

    def role_event(self) -> bytes:
        """The first chunk of a chat stream: the assistant role, empty content."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return _event(
            {**self._envelope(chunk=True), "choices": [{**choice, "finish_reason": None}]}
        )

    def token_event(self, text: str) -> bytes:
        return _event(
            {**self._envelope(chunk=True), "choices": [self._choice(text, None, chunk=True)]}
        )

    def final_events(self, finish: Finish, include_usage: bool) -> bytes:
        """The chunk with the finish reason, the usage chunk if asked, then `[DONE]`."""
        last = {
            **self._envelope(chunk=True),
            "choices": [self._choice(None, finish.reason, chunk=True)],
        }
        events = _event(last)
        if include_usage:
            events += _event({**self._envelope(chunk=True), "choices": [], "usage": _usage(finish)})
        return events + b"data: [DONE]\n\n"


def _usage(finish: Finish) -> dict[str, int]:
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
    }


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

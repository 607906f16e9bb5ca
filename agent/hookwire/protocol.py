"""The engine-hook wire protocol: versioned JSON lines over a unix stream socket.

Every message is one JSON object on one line of UTF-8 ending in "\\n", carrying the protocol
version `v` and its `type`. The engine hook (`kvwatch.hook`) speaks the engine side, the agent
daemon the server side; both use this codec. docs/protocol.md is the specification.

Decoding is strict about what it knows (types, required fields, ranges) and lenient about what
it does not (unknown extra fields are ignored so a newer peer can add fields). Anything that does
not decode raises `ProtocolError`: bytes that are not UTF-8, text that is not (a lone UTF-16
surrogate written as an escape), JSON nested deeper than MAX_NESTING; callers count and drop such
messages, never die of them. A message that decodes holds only text that encodes as UTF-8.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Literal, get_type_hints

from kvwatch.errors import ProtocolError
from kvwatch.hookwire.types import CommandOutcome
from kvwatch.sockets import Endpoint


class LineTooLongError(ProtocolError):
    """A line over MAX_LINE_BYTES: counted and dropped by both sides."""


class UnsupportedVersionError(ProtocolError):
    """A message in a protocol version this side does not speak."""


PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 64 * 1024
MAX_ID_CHARS = 256
# Arrays and objects inside arrays and objects: a message is an object (1) whose `evidence`
# object (2) may hold small lists or objects (3, 4). Deeper lines are malformed.
MAX_NESTING = 4
CANCEL_STATUSES = ("cancelled", "unknown_request", "already_finished", "failed")
PARK_STATUSES = ("parked", "unknown_request", "already_finished", "declined", "failed")
DETACH_STATUSES = ("detached", "unknown_request", "already_finished", "declined", "failed")
PAUSE_STATUSES = ("paused", "unknown_request", "already_finished", "declined", "failed")
RELEASE_STATUSES = ("released", "unknown_request", "already_finished", "not_held", "failed")
# What an engine can do besides cancel, as it says in `hello.features`.
FEATURE_PARK = "park"
FEATURE_DETACH = "detach"
FEATURE_PAUSE = "pause"  # pause and release
MAX_FEATURES = 16

Sender = Literal["engine", "agent"]

_RECEIVED_HINT = "the message was dropped; check that both sides run the same kvwatch version"


@dataclass(frozen=True)
class Message:
    """Base of every protocol message; subclasses validate their fields on construction.

    Invariant: an instance always encodes to a valid line (types and ranges checked in
    `__post_init__`), so a message that exists can be sent.
    """

    TYPE: ClassVar[str] = ""
    SENDER: ClassVar[Sender] = "engine"

    def __post_init__(self) -> None:
        for name, expected in _field_types(type(self)):
            _check_field(self.TYPE, name, expected, getattr(self, name))


@dataclass(frozen=True)
class EngineInfo(Message):
    """Engine → agent, first on every connection (the "hello"): who the engine is, its KV
    geometry and device. Starts a new session. An engine builds one and hands it to
    `kvwatch.hook.EngineHook`; a bad field fails here, at construction."""

    TYPE: ClassVar[str] = "hello"
    engine: str
    model: str
    pid: int
    bytes_per_block: int
    device: str
    kv_blocks_total: int
    features: tuple[str, ...] = ()

    def can(self, feature: str) -> bool:
        """Whether the engine said it can do `feature` (FEATURE_PARK, FEATURE_DETACH)."""
        return feature in self.features


@dataclass(frozen=True)
class Welcome(Message):
    """Agent → engine, optional answer to hello: the agent's name and version."""

    TYPE: ClassVar[str] = "welcome"
    SENDER: ClassVar[Sender] = "agent"
    agent: str


@dataclass(frozen=True)
class ErrorMessage(Message):
    """Agent → engine: why the agent refuses the connection or a message (then may close)."""

    TYPE: ClassVar[str] = "error"
    SENDER: ClassVar[Sender] = "agent"
    message: str
    hint: str = ""


@dataclass(frozen=True)
class Open(Message):
    """Engine → agent: a streaming request and the client connection it writes to.

    `local` is the server socket's own address, `remote` the client's, as the server sees them;
    `pid` is the process that owns that socket. `kv_estimated` (optional) says the KV numbers
    are the engine hook's estimate, not the engine's block table; `age_ms` (optional) how long
    ago the request's stream began, so a re-announced stream keeps its age; `parked` and
    `detached` (optional) that the request is parked, or detached from its client, now (a
    re-announce keeps the state).
    """

    TYPE: ClassVar[str] = "open"
    request_id: str
    local: Endpoint
    remote: Endpoint
    pid: int
    kv_blocks: int
    bytes_per_block: int
    device: str
    tokens_out: int = 0
    kv_estimated: bool = False
    age_ms: int = 0
    parked: bool = False
    detached: bool = False
    paused: bool = False


@dataclass(frozen=True)
class Update(Message):
    """Engine → agent: the request's current KV blocks and tokens streamed so far.

    Optional: `kv_estimated` as in `Open`; `egress_buffer_full` when the engine's per-request
    output buffer is at its cap because the client does not read (evidence of a stall);
    `paused` whether the request is paused now (an engine with the "pause" feature sends it:
    a pause whose lease ran out ends without a word from the agent).
    """

    TYPE: ClassVar[str] = "update"
    request_id: str
    kv_blocks: int
    tokens_out: int
    kv_estimated: bool = False
    egress_buffer_full: bool = False
    paused: bool = False


@dataclass(frozen=True)
class Close(Message):
    """Engine → agent: the request ended (`reason`: finished, aborted, cancelled, ...)."""

    TYPE: ClassVar[str] = "close"
    request_id: str
    reason: str


@dataclass(frozen=True)
class Answer(Message):
    """Engine → agent: the outcome of one command, sent once it took effect (blocks really
    free); `status` is one of the type's `STATUSES`. Both sides speak of it as a
    `CommandOutcome` (the engine's handler returns one, the agent's command call gets one):
    the answer's fields but the correlation id."""

    STATUSES: ClassVar[tuple[str, ...]] = ()
    COMMAND: ClassVar[str] = ""  # the type of the command it answers
    request_id: str
    status: str
    freed_blocks: int
    freed_bytes: int
    correlation_id: str
    detail: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.status not in self.STATUSES:
            raise ProtocolError(
                f"'{self.TYPE}' message has status {self.status!r}",
                f"use one of {', '.join(self.STATUSES)}",
            )

    @classmethod
    def of(cls, outcome: CommandOutcome, correlation_id: str) -> Answer:
        """The answer that carries a handler's `outcome`; ProtocolError if a field is out of
        range. Outcome fields this answer type lacks are left out."""
        names = {f.name for f in fields(cls)}
        values = {f.name: getattr(outcome, f.name) for f in fields(outcome) if f.name in names}
        return cls(correlation_id=correlation_id, **values)

    def outcome(self) -> CommandOutcome:
        """This answer as a `CommandOutcome`, for whoever waits on the command."""
        names = {f.name for f in fields(self)}
        return CommandOutcome(
            **{f.name: getattr(self, f.name) for f in fields(CommandOutcome) if f.name in names}
        )


def plural(command: str) -> str:
    """A command's name as the counters spell it: cancels, parks, detaches."""
    return f"{command}es" if command.endswith("ch") else f"{command}s"


@dataclass(frozen=True)
class Command(Message):
    """Agent → engine: do something to one request; answered by exactly one message of the
    command's `ANSWER` type with the same `correlation_id`."""

    SENDER: ClassVar[Sender] = "agent"
    ANSWER: ClassVar[type[Answer]]
    request_id: str
    reason: str
    correlation_id: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Cancelled(Answer):
    """Engine → agent: the outcome of a cancel, sent after the blocks are really free."""

    TYPE: ClassVar[str] = "cancelled"
    COMMAND: ClassVar[str] = "cancel"
    STATUSES: ClassVar[tuple[str, ...]] = CANCEL_STATUSES


@dataclass(frozen=True)
class Parked(Answer):
    """Engine → agent: the outcome of a park, sent after the blocks are really free; the
    request and its connection live on (docs/protocol.md, "Park and resume")."""

    TYPE: ClassVar[str] = "parked"
    COMMAND: ClassVar[str] = "park"
    STATUSES: ClassVar[tuple[str, ...]] = PARK_STATUSES


@dataclass(frozen=True)
class Detached(Answer):
    """Engine → agent: the outcome of a detach. Nothing is freed at once (`freed_blocks` 0):
    the request's generation no longer waits for its client and frees its KV when it ends;
    `buffered_bytes` is what the stream's host buffer held as it detached (docs/protocol.md,
    "Detach")."""

    TYPE: ClassVar[str] = "detached"
    COMMAND: ClassVar[str] = "detach"
    STATUSES: ClassVar[tuple[str, ...]] = DETACH_STATUSES
    buffered_bytes: int = 0


@dataclass(frozen=True)
class Cancel(Command):
    """Agent → engine: free this request's KV and end it; answered by one `Cancelled`."""

    TYPE: ClassVar[str] = "cancel"
    ANSWER: ClassVar[type[Answer]] = Cancelled


@dataclass(frozen=True)
class Park(Command):
    """Agent → engine: free this request's KV now but keep the request and its connection,
    until a `release` (an engine without FEATURE_PAUSE resumes it once its client reads
    again). The hold's lease is a pause's (`lease_ms`). Answered by one `Parked`; sent only
    to an engine whose hello lists FEATURE_PARK."""

    TYPE: ClassVar[str] = "park"
    ANSWER: ClassVar[type[Answer]] = Parked
    lease_ms: int = 0


@dataclass(frozen=True)
class Detach(Command):
    """Agent → engine: from now on, send this request's output through a bounded host buffer
    so its generation runs to its end whatever its client reads; the stream is coupled again
    when the buffer reaches its cap (reported by `egress_buffer_full`). Answered by one
    `Detached`; sent only to an engine whose hello lists FEATURE_DETACH."""

    TYPE: ClassVar[str] = "detach"
    ANSWER: ClassVar[type[Answer]] = Detached


@dataclass(frozen=True)
class Paused(Answer):
    """Engine → agent: the outcome of a pause: the request gets no more decode steps and
    keeps its KV and its place, until released (docs/protocol.md, "Pause and release")."""

    TYPE: ClassVar[str] = "paused"
    COMMAND: ClassVar[str] = "pause"
    STATUSES: ClassVar[tuple[str, ...]] = PAUSE_STATUSES


@dataclass(frozen=True)
class Released(Answer):
    """Engine → agent: the outcome of a release: a paused request is scheduled again; a
    parked one goes to the head of the queue and sends `resumed` once its KV is back."""

    TYPE: ClassVar[str] = "released"
    COMMAND: ClassVar[str] = "release"
    STATUSES: ClassVar[tuple[str, ...]] = RELEASE_STATUSES


@dataclass(frozen=True)
class Pause(Command):
    """Agent → engine: schedule no more decode steps for this request, keeping its KV and
    its place, until a `release` (its reader is behind). The hold lasts `lease_ms` (0: the
    engine hook's default) unless another pause or park of the request renews it; when it
    runs out, or the agent's connection ends, the engine hook releases the request itself.
    Answered by one `Paused`; sent only to an engine whose hello lists FEATURE_PAUSE."""

    TYPE: ClassVar[str] = "pause"
    ANSWER: ClassVar[type[Answer]] = Paused
    lease_ms: int = 0


@dataclass(frozen=True)
class Release(Command):
    """Agent → engine: end this request's pause or park (its reader caught up): it is
    scheduled again. Answered by one `Released`; sent only to an engine whose hello lists
    FEATURE_PAUSE."""

    TYPE: ClassVar[str] = "release"
    ANSWER: ClassVar[type[Answer]] = Released


@dataclass(frozen=True)
class Resumed(Message):
    """Engine → agent: a parked request runs again (its client read what was queued);
    `kv_blocks` it holds now, `recomputed_tokens` whose KV had to be computed again (0 when
    it came back from a host-memory copy)."""

    TYPE: ClassVar[str] = "resumed"
    request_id: str
    kv_blocks: int
    recomputed_tokens: int


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        EngineInfo,
        Welcome,
        ErrorMessage,
        Open,
        Update,
        Close,
        Cancel,
        Cancelled,
        Park,
        Parked,
        Resumed,
        Detach,
        Detached,
        Pause,
        Paused,
        Release,
        Released,
    )
}


_FIELD_TYPES: dict[str, tuple[tuple[str, Any], ...]] = {}


def _field_types(cls: type[Message]) -> tuple[tuple[str, Any], ...]:
    """(name, type) of each field of `cls`, resolved once per message type."""
    cached = _FIELD_TYPES.get(cls.TYPE)
    if cached is None:
        hints = get_type_hints(cls)
        cached = _FIELD_TYPES[cls.TYPE] = tuple((f.name, hints[f.name]) for f in fields(cls))
    return cached


def _check_field(kind: str, name: str, expected: Any, value: Any) -> None:
    """Raises ProtocolError unless `value` is a valid `expected` for field `name`."""
    if expected is bool:
        ok = isinstance(value, bool)
        wanted = "true or false"
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        wanted = "a non-negative integer"
    elif expected is str and name.endswith("_id"):
        ok = isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS and _is_text(value)
        wanted = f"a non-empty string of at most {MAX_ID_CHARS} characters of Unicode text"
    elif expected is str:
        ok = isinstance(value, str) and _is_text(value)
        wanted = "a string of Unicode text (no lone surrogates)"
    elif expected is Endpoint:
        ok = isinstance(value, Endpoint)
        wanted = 'an "ip:port" string'
    elif expected == tuple[str, ...]:
        ok = (
            isinstance(value, tuple)
            and len(value) <= MAX_FEATURES
            and all(isinstance(item, str) and 0 < len(item) <= 64 for item in value)
            and all(_is_text(item) for item in value)
        )
        wanted = f"a list of at most {MAX_FEATURES} short non-empty strings"
    else:
        ok = isinstance(value, dict) and all(isinstance(key, str) for key in value)
        wanted = "a JSON object"
    if not ok:
        raise ProtocolError(
            f"'{kind}' message field '{name}' must be {wanted}, got {_preview(value)}",
            _RECEIVED_HINT,
        )


def _is_text(value: str) -> bool:
    """True when `value` encodes as UTF-8 (JSON's "\\ud800" decodes to a str that does not)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def encode(message: Message) -> bytes:
    """One line of UTF-8 JSON ending in "\\n"; raises ProtocolError if it would be oversized."""
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": message.TYPE}
    for f in fields(message):
        value = getattr(message, f.name)
        if isinstance(value, Endpoint):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        body[f.name] = value
    problem = _shape_problem(body)
    try:
        if problem is not None:
            raise ValueError(problem)
        text = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(
            f"'{message.TYPE}' message cannot be encoded as JSON: {exc}",
            "pass only JSON values (no NaN, no objects, no lone surrogates, at most "
            f"{MAX_NESTING} levels of nesting) in evidence",
        ) from exc
    line = text.encode() + b"\n"
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(
            f"'{message.TYPE}' message is {len(line)} bytes, over the {MAX_LINE_BYTES} byte limit",
            "send less evidence or shorter strings",
        )
    return line


def decode(line: bytes | str, sender: Sender | None = None) -> Message:
    """Parses one line; with `sender`, also refuses messages the other side never sends."""
    raw = line.encode() if isinstance(line, str) else line
    if len(raw) > MAX_LINE_BYTES:
        raise LineTooLongError(
            f"message of {len(raw)} bytes is over the {MAX_LINE_BYTES} byte line limit",
            _RECEIVED_HINT,
        )
    body = _parse_json(raw)
    cls = _message_class(body)
    if sender is not None and sender != cls.SENDER:
        raise ProtocolError(
            f"'{cls.TYPE}' messages are sent by the {cls.SENDER}, but this came from the {sender}",
            _RECEIVED_HINT,
        )
    return cls(**_field_values(cls, body))


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError as exc:  # thousands of levels: the parser gives up before we look
        raise ProtocolError(
            f"message nests arrays or objects deeper than {MAX_NESTING} levels", _RECEIVED_HINT
        ) from exc
    except ValueError as exc:  # also UnicodeDecodeError
        raise ProtocolError(f"message is not a line of UTF-8 JSON: {exc}", _RECEIVED_HINT) from exc
    problem = _shape_problem(body)
    if problem is not None:
        raise ProtocolError(f"message {problem}", _RECEIVED_HINT)
    if not isinstance(body, dict):
        raise ProtocolError(
            f"message must be a JSON object, got {type(body).__name__}", _RECEIVED_HINT
        )
    return body


def _shape_problem(body: Any) -> str | None:
    """What makes decoded JSON unfit for a message (a string that is not UTF-8 text, nesting
    deeper than MAX_NESTING), or None. Walks without recursion; a line is at most
    MAX_LINE_BYTES, so the walk is bounded."""
    pending: list[tuple[Any, int]] = [(body, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return f"holds a string that is not Unicode text: {_preview(value)}"
            continue
        if isinstance(value, dict):
            items: list[Any] = [*value.keys(), *value.values()]
        elif isinstance(value, list):
            items = value
        else:
            continue
        if depth > MAX_NESTING:
            return f"nests arrays or objects deeper than {MAX_NESTING} levels"
        pending.extend((item, depth + 1) for item in items)
    return None


def _message_class(body: dict[str, Any]) -> type[Message]:
    version = body.get("v")
    if version is None:
        raise ProtocolError("message has no protocol version field 'v'", _RECEIVED_HINT)
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise UnsupportedVersionError(
            f"protocol version {_preview(version)} is not supported; "
            f"this side speaks version {PROTOCOL_VERSION}",
            "run the same kvwatch version for the agent and the engine hook",
        )
    kind = body.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(
            f"unknown message type {_preview(kind)} (known: {', '.join(MESSAGE_TYPES)})",
            _RECEIVED_HINT,
        )
    return cls


def _field_values(cls: type[Message], body: dict[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in body:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ProtocolError(
                    f"'{cls.TYPE}' message lacks required field '{f.name}'", _RECEIVED_HINT
                )
            continue
        value = body[f.name]
        if f.name in ("local", "remote"):
            value = _parse_endpoint(cls.TYPE, f.name, value)
        elif isinstance(value, list):
            value = tuple(value)  # checked as a field of tuple type, refused by any other
        values[f.name] = value
    return values


def _parse_endpoint(kind: str, name: str, value: Any) -> Endpoint:
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        return Endpoint.parse(value)
    except ValueError as exc:
        raise ProtocolError(
            f"'{kind}' message field '{name}' must be an \"ip:port\" string "
            f'("[ipv6]:port" for IPv6), got {_preview(value)}',
            _RECEIVED_HINT,
        ) from exc


class LineFramer:
    """Splits a byte stream into decoded messages, one per line.

    Owned by one reader. Invariant: the buffer never holds more than `MAX_LINE_BYTES` of an
    unfinished line; an oversized line is reported once as a ProtocolError and its remainder is
    discarded up to the next newline, after which decoding resumes. Empty lines are ignored.
    """

    def __init__(self, sender: Sender | None = None) -> None:
        self._sender = sender
        self._buffer = bytearray()
        self._discarding = False

    def feed(self, data: bytes) -> list[Message | ProtocolError]:
        """Returns the messages (or the errors) of every line completed by `data`."""
        self._buffer += data
        *lines, rest = self._buffer.split(b"\n")
        results: list[Message | ProtocolError] = []
        for line in lines:
            if self._discarding:
                self._discarding = False
            elif line.strip():
                results.append(self._decode(bytes(line)))
        self._buffer = bytearray(rest)
        if len(self._buffer) > MAX_LINE_BYTES:
            if not self._discarding:
                results.append(
                    LineTooLongError(
                        f"line longer than the {MAX_LINE_BYTES} byte limit; discarded",
                        _RECEIVED_HINT,
                    )
                )
            self._discarding = True
            self._buffer.clear()
        return results

    def _decode(self, line: bytes) -> Message | ProtocolError:
        try:
            return decode(line, self._sender)
        except ProtocolError as exc:
            return exc

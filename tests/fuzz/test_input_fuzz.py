"""Issue 25's standing check: whatever a user or a peer hands kvwatch — a config file (TOML or
random bytes), environment variables, a flag, any command's arguments, an answer from
whatever listens at --url, a path and query string for the agent's API — the outcome is a
success or a clean error: an expected exit code or HTTP status, one error line, no traceback,
in at most SECONDS_PER_EXAMPLE and MEMORY_PER_EXAMPLE (tracemalloc's peak).

Commands run in this process (click's CliRunner) against the agent's real API app (over a
fake agent), a server that answers garbage, or a port that refuses. What would start real
work once the arguments are accepted is replaced by a stub: the agent's daemon (`run`), BPF
(`sockets` falls back to the kernel, `doctor`), the engine, the load generator, the demo and
`baseline save` (which writes files). Modes that never end by design are left out: `top`
always gets --once, `sockets` never --watch. The module's examples (EXAMPLES) run in about
25 s on 2 cores; KVWATCH_INPUT_FUZZ_SCALE=10 runs ten times as many.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import time
import tracemalloc
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_from_bytes

import click
import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette

from kvwatch.cli import COMMANDS, main, run_cmd
from kvwatch.config.load import config_keys, env_name, load_config, parse_flag
from kvwatch.config.schema import AgentConfig
from kvwatch.errors import EXIT_PRIVILEGE, ConfigError, KvwatchError, PrivilegeError
from kvwatch.tools import doctor
from tests.fuzz.servers import KNOWN_REQUEST, Answer, agent_app, garbage_server, served_agent

SECONDS_PER_EXAMPLE = 5.0
MEMORY_PER_EXAMPLE = 64 << 20
MAX_ERROR_CHARS = 1000  # an error line, beyond the argument it may quote (click does)
EXIT_CODES = (0, 1, 2, 3)
EXAMPLES = {
    "toml": 250,
    "bytes": 100,
    "env": 150,
    "flags": 250,
    "command": 100,  # per command: 12 of them
    "api": 250,
}
REFUSING_URL = "http://127.0.0.1:1"


SCALE_ENV = "KVWATCH_INPUT_FUZZ_SCALE"  # run EXAMPLES times this, for a deeper search


def fuzz(share: str) -> settings:
    return settings(
        max_examples=max(1, int(EXAMPLES[share] * float(os.environ.get(SCALE_ENV, "1")))),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture(scope="module", autouse=True)
def traced() -> Iterator[None]:
    """tracemalloc for the module, started once every command's module is imported (their
    imports are not an example's memory)."""
    for module in COMMANDS.values():
        importlib.import_module(f"kvwatch.cli.{module}")
    tracemalloc.start()
    yield
    tracemalloc.stop()


@contextmanager
def bounded() -> Iterator[None]:
    """Asserts the block takes at most SECONDS_PER_EXAMPLE and MEMORY_PER_EXAMPLE."""
    before, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    started = time.monotonic()
    yield
    seconds = time.monotonic() - started
    peak = tracemalloc.get_traced_memory()[1] - before
    assert seconds < SECONDS_PER_EXAMPLE, f"took {seconds:.1f} s"
    assert peak < MEMORY_PER_EXAMPLE, f"peaked at {peak >> 20} MiB"


def clean_message(exc: KvwatchError) -> None:
    """A KvwatchError is one short line (and a hint)."""
    for text in (exc.message, exc.hint):
        assert "\n" not in text, text
        assert len(text) < MAX_ERROR_CHARS, text[:200]


# Values: what people and scripts pass, what attackers and accidents pass.
NUMBERS = [
    "0", "1", "-1", "3", "65535", "65536", "4194304", "4294967296", "9" * 400, "1e30",
    "-0.0", "0.0001", "nan", "inf", "-inf", "1_000", "0x10", " 8000 ", "١٢٣", "1e400",
]  # fmt: skip
TEXTS = [
    "", " ", "\n", "\t", "\x00", "\udcff", "a" * 100_000, "é", "🙂", "[/bold]", "..",
    "../../etc/passwd", "%2E%2E", "cmpl-1", KNOWN_REQUEST, "127.0.0.1:8000", "[::1]:9",
    "observe", "enforce", "cancel", "reset", "diag", "auto", "raw_tp", "stalled", "8000,8001",
]  # fmt: skip
values = st.one_of(
    st.sampled_from(NUMBERS + TEXTS),
    st.text(max_size=30),
    st.integers().map(str),
    st.floats().map(str),
)


@dataclass(frozen=True)
class Places:
    """What the commands are pointed at: the fake agent, the garbage server and its next
    answer, files of every kind."""

    agent_url: str
    garbage_url: str
    answer: Answer
    paths: tuple[str, ...]


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Places]:
    directory = tmp_path_factory.mktemp("inputs")
    fifo = directory / "fifo"
    os.mkfifo(fifo)
    files = {
        "good.toml": b'[policy]\nmode = "enforce"\n',
        "random.bin": os.urandom(4096),
        "big.toml": b"#" * ((1 << 20) + 1),
        "deep.toml": b"[policy]\nallow_ports = " + b"[" * 50_000 + b"]" * 50_000,
        "baseline.json": b'{"format": "kvwatch-baseline", "version": 1}',
    }
    for name, data in files.items():
        (directory / name).write_bytes(data)
    paths = (
        *(str(directory / name) for name in files),
        str(fifo),
        str(directory),
        "/dev/zero",
        "/dev/urandom",
        "/dev/full",
        "/proc",
        "/nonexistent",
        "relative/path",
        "",
    )
    with served_agent() as agent_url, garbage_server() as (garbage_url, answer):
        yield Places(agent_url, garbage_url, answer, paths)


@pytest.fixture(scope="module")
def stubbed() -> Iterator[None]:
    """The work past argument handling that cannot run in a test process, replaced."""

    async def no_daemon(_daemon: object, listener: Any) -> None:
        listener.close()

    def no_collector(*_: object) -> None:
        raise PrivilegeError("fuzz: no collector in this process")

    def cheap_checks(procfs_root: str, url: str, hook_socket: str) -> list[doctor.Check]:
        procfs = doctor.check_procfs(procfs_root)
        health, error = doctor.fetch_health(url)
        return [
            procfs,
            *doctor.check_sysctls(procfs_root if procfs.status == "ok" else "/proc"),
            doctor.check_daemon(url, health, error),
            doctor.check_engines(health),
            doctor.check_socket_table(health),
            doctor.check_hook_socket(hook_socket, health is not None),
        ]

    def reached(**_: object) -> None:
        pass

    cli = "kvwatch.cli"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_cmd, "Daemon", lambda config: None)
        patch.setattr(run_cmd, "serve", no_daemon)
        patch.setattr(run_cmd, "one_malloc_arena", lambda: None)
        patch.setattr(f"{cli}.sockets_cmd.open_collector", no_collector)
        patch.setattr(f"{cli}.doctor_cmd.run_checks", cheap_checks)
        for module in ("engine_cmd", "loadgen_cmd", "demo_cmd"):
            patch.setattr(importlib.import_module(f"{cli}.{module}").command, "callback", reached)
        baseline = importlib.import_module(f"{cli}.baseline_cmd").command
        patch.setattr(baseline.commands["save"], "callback", reached)
        yield


# The config loader: files, the environment, flags


SECTIONS = sorted({key.partition(".")[0] for key in config_keys()})
toml_scalars = st.one_of(
    st.sampled_from([n for n in NUMBERS if n.strip() == n]),
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(str),
    st.sampled_from(["true", "false", "1979-05-27", '"\\u0000"', "'a'", '""']),
    st.text(max_size=20).map(json.dumps),
)
toml_values = st.recursive(
    toml_scalars,
    lambda inner: st.lists(inner, max_size=4).map(lambda items: "[" + ", ".join(items) + "]"),
    max_leaves=8,
)
toml_names = st.sampled_from([key.partition(".")[2] for key in config_keys()]) | st.text(
    "abcdefghijklmnopqrstuvwxyz_.-\"' ", min_size=1, max_size=12
)
toml_lines = st.tuples(toml_names, toml_values).map(lambda kv: f"{kv[0]} = {kv[1]}")
toml_headers = st.sampled_from(SECTIONS) | st.text(max_size=12)
toml_documents = st.lists(
    st.tuples(toml_headers, st.lists(toml_lines, max_size=5)).map(
        lambda table: f"[{table[0]}]\n" + "\n".join(table[1])
    ),
    max_size=4,
).map("\n".join)
deep_documents = st.integers(1, 3000).map(
    lambda depth: "[policy]\nallow_ports = " + "[" * depth + "]" * depth
)


def load_file(directory: Path, data: bytes) -> None:
    path = directory / "fuzz.toml"
    path.write_bytes(data)
    with bounded():
        try:
            assert isinstance(load_config(str(path), {}, {}), AgentConfig)
        except ConfigError as exc:
            clean_message(exc)


@fuzz("toml")
@given(toml_documents | deep_documents | st.text(max_size=200))
def test_config_files_of_toml_text(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    load_file(tmp_path_factory.getbasetemp(), text.encode("utf-8", "surrogateescape"))


@fuzz("bytes")
@given(st.binary(max_size=2000))
def test_config_files_of_random_bytes(
    tmp_path_factory: pytest.TempPathFactory, data: bytes
) -> None:
    load_file(tmp_path_factory.getbasetemp(), data)


env_names = st.sampled_from([env_name(key) for key in config_keys()]) | st.builds(
    lambda section, rest: f"KVWATCH_{section.upper()}_{rest}", st.sampled_from(SECTIONS), st.text()
)


@fuzz("env")
@given(st.dictionaries(env_names, values, max_size=4))
def test_environment_variables(env: dict[str, str]) -> None:
    with bounded():
        try:
            assert isinstance(load_config(None, env, {}), AgentConfig)
        except ConfigError as exc:
            clean_message(exc)


@fuzz("flags")
@given(st.sampled_from(config_keys()), values | st.lists(values, max_size=20).map(tuple))
def test_flags_of_every_setting(key: str, raw: str | tuple[str, ...]) -> None:
    with bounded():
        try:
            parse_flag(key, raw, "--flag")
        except ConfigError as exc:
            clean_message(exc)


# Every command's arguments


def command_of(words: tuple[str, ...]) -> click.Command:
    command: click.Command = importlib.import_module(f"kvwatch.cli.{COMMANDS[words[0]]}").command
    for word in words[1:]:
        assert isinstance(command, click.Group)
        command = command.commands[word]
    return command


@dataclass(frozen=True)
class Case:
    """A command as the fuzz test runs it: the words that name it, what it always gets, the
    options never generated, and whether it asks an agent (then it gets a --url first)."""

    words: tuple[str, ...]
    always: tuple[str, ...] = ()
    skipped: frozenset[str] = frozenset()
    asks_agent: bool = False


CASES = {
    "run": Case(("run",), ("--listen", "127.0.0.1:0", "--audit-log", "")),
    "explain": Case(("explain",), asks_agent=True),
    "streams": Case(("streams",), asks_agent=True),
    "sockets": Case(("sockets",), skipped=frozenset({"--watch", "--standalone"}), asks_agent=True),
    "top": Case(("top",), ("--once",), frozenset({"--standalone"}), asks_agent=True),
    "doctor": Case(("doctor",), asks_agent=True),
    "baseline save": Case(("baseline", "save")),
    "baseline diff": Case(("baseline", "diff")),
    "engine": Case(("engine",)),
    "loadgen": Case(("loadgen",)),
    "demo": Case(("demo",)),
    "kvwatch": Case(()),
}
# Command names as stray words: never `top` or `sockets`, which without --once, or with an
# agent at the default URL, would run until interrupted.
STRAY_WORDS = sorted(set(COMMANDS) - {"top", "sockets"})
# Never random text here: a host name would be looked up in DNS.
LISTENS = ["127.0.0.1:0", "[::1]:0", "localhost:0", "9431", "", "127.0.0.1:70000", "[::1"]
PATH_OPTIONS = ("--config", "--path.procfs", "--path.sysfs", "--hook-socket", "--audit-log")


def places_of_agents(places: Places) -> st.SearchStrategy[str]:
    """The three kinds of place an agent's URL leads to: an agent, garbage, nothing."""
    return st.sampled_from([places.agent_url, places.garbage_url, places.garbage_url, REFUSING_URL])


def urls(places: Places) -> st.SearchStrategy[str]:
    """Places of agents, malformed URLs, any text."""
    malformed = ["http://[::1", "ftp://x/", "", "http://127.0.0.1:99999", "h" * 3000]
    return places_of_agents(places) | st.sampled_from(malformed) | st.text(max_size=20)


def option_values(param: click.Parameter, option: str, places: Places) -> st.SearchStrategy[str]:
    """Values for `option`: addresses for --url and --listen, files for paths; else mostly
    values it takes (its choices, small numbers) so that commands get past their parsing,
    and any value."""
    if option == "--url":
        return urls(places)
    if option == "--listen":
        return st.sampled_from(LISTENS)
    if option in PATH_OPTIONS:
        return st.sampled_from(places.paths) | values
    if isinstance(param.type, click.Choice):
        taken = st.sampled_from([str(choice) for choice in param.type.choices])
    elif isinstance(param.type, click.IntRange | click.FloatRange):
        taken = st.just(inside(param.type))
    else:
        taken = st.sampled_from(["1", "2", "8000", "0.5"])
    return st.one_of(taken, taken, taken, values)


def inside(kind: click.IntRange | click.FloatRange) -> str:
    """A number in the middle of a click range."""
    low = kind.min if kind.min is not None else 0
    high = kind.max if kind.max is not None else low + 2
    middle = (low + high) / 2
    return str(int(middle)) if isinstance(kind, click.IntRange) else str(middle)


def option_pieces(command: click.Command, case: Case, places: Places) -> list[Any]:
    """One strategy per option of `command`: [flag] or [option, value]."""
    pieces: list[st.SearchStrategy[list[str]]] = []
    for param in command.params:
        if not isinstance(param, click.Option):
            continue
        for option in (*param.opts, *param.secondary_opts):
            if option in case.skipped:
                continue
            if param.is_flag or param.count:
                pieces.append(st.just([option]))
            else:
                pieces.append(option_values(param, option, places).map(_after(option)))
    return pieces


def _after(option: str) -> Callable[[str], list[str]]:
    """[option, value] for a value."""
    return lambda value: [option, value]


def arguments(name: str, places: Places) -> st.SearchStrategy[list[str]]:
    """Argument lists for command `name`: its words and fixed arguments, a --url when it asks
    an agent, up to 4 of its options with values, a value for each positional argument, and
    now and then a stray word."""
    case = CASES[name]
    command = command_of(case.words) if case.words else main
    pieces = option_pieces(command, case, places) or [st.just([])]
    positionals = [
        (st.sampled_from(places.paths) | values).map(lambda value: [value])
        for param in command.params
        if isinstance(param, click.Argument)
    ]
    stray = (st.sampled_from(STRAY_WORDS) | values).map(lambda word: [word])
    asked = places_of_agents(places)  # a generated --url may come later, and wins
    url = asked.map(lambda value: ["--url", value]) if case.asks_agent else st.just([])
    parts = st.tuples(
        url,
        st.lists(st.one_of(pieces), max_size=4),
        st.tuples(*positionals),
        st.one_of(*[st.just([])] * 5, stray),
    )
    words = parts.map(
        lambda drawn: [
            *case.words,
            *case.always,
            *drawn[0],
            *(word for piece in drawn[1] for word in piece),
            *(word for piece in drawn[2] for word in piece),
            *drawn[3],
        ]
    )
    return words.map(lambda args: [arg.replace("\0", "") for arg in args])  # argv holds no NUL


STATUSES = [200, 200, 200, 404, 500, 204, 301]
garbage_bodies = st.one_of(
    st.binary(max_size=500),
    st.sampled_from(
        [
            b"[]",
            b"{}",
            b"null",
            b'{"error": 5}',
            b'{"error": "x\\ny"}',
            b"9" * 5000,
            b"[" * 5000 + b"]" * 5000,
            b'[{"state": "stalled"}]',
            b'[{"state": "[/x]"}]',
            b'{"live": true, "timeline": 5}',
            b'{"engines": 5, "socket_table": []}',
        ]
    ),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
        max_leaves=10,
    ).map(lambda value: json.dumps(value).encode()),
)


def assert_clean(result: Result, args: list[str]) -> None:
    """An exit code of the contract, no traceback, and on failure one short error line."""
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception),
        result.output[-2000:],
    )
    assert result.exit_code in EXIT_CODES, result.output
    assert "Traceback" not in result.output
    if result.exit_code == 0 or (args[:1] == ["doctor"] and result.exit_code == EXIT_PRIVILEGE):
        return  # doctor's exit 3 comes with its report: a failed check, not an error line
    if result.output.startswith("Usage:") and "Error:" not in result.output:
        return  # a group without its command shows its help (exit 2)
    errors = [
        line for line in result.stderr.splitlines() if line.startswith(("kvwatch:", "Error:"))
    ]
    assert len(errors) == 1, result.stderr[-2000:]
    longest = max((len(arg) for arg in args), default=0)
    assert len(errors[0]) < MAX_ERROR_CHARS + longest, errors[0][:300]


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_commands_arguments(name: str, places: Places, stubbed: None) -> None:
    @fuzz("command")
    @given(arguments(name, places), st.sampled_from(STATUSES), garbage_bodies)
    def check(args: list[str], status: int, body: bytes) -> None:
        places.answer.status, places.answer.body = status, body
        with bounded():
            result = CliRunner().invoke(main, args)
        event(f"exit code {result.exit_code}")
        assert_clean(result, args)

    check()


# The agent's API: paths and query strings


ROUTES = [
    "/api/v1/events",
    "/api/v1/explain/",
    f"/api/v1/explain/{KNOWN_REQUEST}",
    "/api/v1/explain/127.0.0.1:8000",
    "/api/v1/streams",
    "/api/v1/sockets",
    "/healthz",
    "/metrics",
]
JSON_ROUTES = ("/api/", "/healthz")
path_texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
# Query strings as the agent's HTTP server hands them over: ASCII (it answers 400 to a request
# line with other bytes), any bytes percent-encoded, a "%" left bare now and then.
query_strings = st.one_of(
    st.binary(max_size=200).map(lambda raw: quote_from_bytes(raw, safe="=&+;%").encode()),
    values.map(
        lambda value: b"since=" + quote_from_bytes(value.encode("utf-8", "surrogatepass")).encode()
    ),
    st.sampled_from([b"since=" + b"9" * 5000, b"since=-1", b"since=%FF", b"since", b"&&=="]),
)


async def asgi_get(app: Starlette, path: str, query: bytes) -> tuple[int, bytes]:
    """GET `path` (decoded, as uvicorn hands it over) with the raw `query` from the app."""
    sent: list[MutableMapping[str, Any]] = []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": quote(path, safe="/").encode(),
        "root_path": "",
        "query_string": query,
        "headers": [(b"host", b"agent")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 9431),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.fixture(scope="module")
def app() -> Starlette:
    return agent_app()


@fuzz("api")
@given(st.sampled_from(ROUTES), path_texts, query_strings)
def test_api_paths_and_query_strings(app: Starlette, route: str, tail: str, query: bytes) -> None:
    path = route + tail
    with bounded():
        status, body = asyncio.run(asgi_get(app, path, query))
    event(f"HTTP {status}")
    assert status in (200, 307, 400, 404), (path, query, status, body[:300])  # 307: a slash
    # Starlette's path parameters match no line break: such an id is an unknown path.
    explained = path.startswith("/api/v1/explain/") and "\n" not in path
    if explained or (path.startswith(JSON_ROUTES) and status in (200, 400)):
        json.loads(body)

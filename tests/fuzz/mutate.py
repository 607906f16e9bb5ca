"""A mutation fuzzer for the engine-hook protocol: valid lines, mutated, through the codec and
a live hook server, as fast as the machine allows (hypothesis finds the corner cases; this runs
the volume). Every case is one line: decoded locally, then sent to the server in sessions of
SESSION_LINES lines, after which the counters must add up and nothing may be left held.

    KVWATCH_FUZZ_CASES=1000000 python -m tests.fuzz.mutate      # by hand: prints a JSON report
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable

import psutil

from kvwatch.errors import ProtocolError
from kvwatch.hookwire.protocol import (
    Cancelled,
    Close,
    Detached,
    EngineInfo,
    Message,
    Open,
    Update,
    decode,
    encode,
)
from kvwatch.sockets import Endpoint
from tests.fuzz.live import LiveServer

SESSION_LINES = 500
SEED_MESSAGES: list[Message] = [
    EngineInfo(
        engine="fuzz", model="m", pid=1, bytes_per_block=16, device="cpu", kv_blocks_total=8
    ),
    Open(
        request_id="r-1",
        local=Endpoint("127.0.0.1", 8000),
        remote=Endpoint("::1", 40000),
        pid=1,
        kv_blocks=2,
        bytes_per_block=16,
        device="cpu",
    ),
    Update(request_id="r-1", kv_blocks=3, tokens_out=9),
    Close(request_id="r-1", reason="finished"),
    Cancelled(
        request_id="r-1",
        status="cancelled",
        freed_blocks=3,
        freed_bytes=48,
        correlation_id="c-1",
    ),
    Detached(
        request_id="r-1",
        status="detached",
        freed_blocks=0,
        freed_bytes=0,
        correlation_id="d-2",
        buffered_bytes=512,
    ),
]
SEEDS = [encode(message).rstrip(b"\n") for message in SEED_MESSAGES]
NASTY = [
    b'"\\ud800"',
    b'"\\udfff\\ud800"',
    b"\xed\xa0\x80",
    b"\xff",
    b"[" * 5000,
    b"]",
    b'{"a":' * 50,
    b"1e999",
    b"-0",
    b"18446744073709551616",
    b"NaN",
    b"null",
    b"true",
    b'""',
    b"\\",
    b'"',
    b"\x00",
    b"{}",
    b"[]",
]


def _flip(rng: random.Random, line: bytes) -> bytes:
    data = bytearray(line)
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def _insert(rng: random.Random, line: bytes) -> bytes:
    at = rng.randrange(len(line) + 1)
    return line[:at] + rng.choice(NASTY) + line[at:]


def _replace_value(rng: random.Random, line: bytes) -> bytes:
    """One value of the JSON object swapped for a nasty token (keeps the line parseable often)."""
    colons = [i for i, byte in enumerate(line) if byte == ord(":")]
    if not colons:
        return _insert(rng, line)
    start = rng.choice(colons) + 1
    end = start
    while end < len(line) and line[end] not in b",}":
        end += 1
    return line[:start] + rng.choice(NASTY) + line[end:]


def _truncate(rng: random.Random, line: bytes) -> bytes:
    return line[: rng.randrange(len(line))]


def _splice(rng: random.Random, line: bytes) -> bytes:
    other = rng.choice(SEEDS)
    return line[: rng.randrange(len(line))] + other[rng.randrange(len(other)) :]


def _nest(rng: random.Random, line: bytes) -> bytes:
    depth = rng.choice([3, 4, 5, 50, 20_000])
    return line[:-1] + b',"x":' + b"[" * depth + b"]" * depth + b"}"


def _object(line: bytes) -> dict[str, object] | None:
    """The line as a non-empty JSON object, or None (a mutation may have broken it)."""
    try:
        body = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) and body else None


def _drop_field(rng: random.Random, line: bytes) -> bytes:
    body = _object(line)
    if body is None:
        return _insert(rng, line)
    body.pop(rng.choice(sorted(body)))
    return json.dumps(body).encode()


def _retype(rng: random.Random, line: bytes) -> bytes:
    body = _object(line)
    if body is None:
        return _insert(rng, line)
    key = rng.choice(sorted(body))
    body[key] = rng.choice([-1, 2**70, 1.5, True, None, "", "x" * 300, [], {}, "\ud800"])
    return json.dumps(body).encode()


def _valid(rng: random.Random, line: bytes) -> bytes:
    return line


MUTATIONS: list[Callable[[random.Random, bytes], bytes]] = [
    _flip,
    _insert,
    _replace_value,
    _truncate,
    _splice,
    _nest,
    _drop_field,
    _retype,
    _valid,
]


def case(rng: random.Random) -> bytes:
    """One line: a seed with one or two mutations, without a newline inside it."""
    line = rng.choice(SEEDS)
    for _ in range(rng.choice((0, 1, 1, 2))):  # a quarter stay valid
        line = rng.choice(MUTATIONS)(rng, line) or b"{}"
    return line.replace(b"\n", b" ")


def run(cases: int, seed: int) -> dict[str, object]:
    """Fuzzes `cases` lines; raises AssertionError at the first broken property."""
    rng = random.Random(seed)
    process = psutil.Process()
    outcomes: Counter[str] = Counter()
    directory = tempfile.mkdtemp(prefix="kvwm-", dir="/tmp")
    live = LiveServer(f"{directory}/engine.sock")
    start = time.monotonic()
    rss_start = process.memory_info().rss
    rss_peak_after_warmup = 0
    try:
        done = 0
        while done < cases:
            lines = [case(rng) for _ in range(min(SESSION_LINES, cases - done))]
            for line in lines:
                try:
                    outcomes[type(decode(line)).__name__] += 1
                except ProtocolError:
                    outcomes["ProtocolError"] += 1
            first = [SEEDS[0] + b"\n"] if rng.random() < 0.9 else []  # most sessions say hello
            live.check_session(first + [line + b"\n" for line in lines])
            done += len(lines)
            if done >= cases // 10:
                rss_peak_after_warmup = max(rss_peak_after_warmup, process.memory_info().rss)
        counters = live.counters()
    finally:
        live.close()
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "cases": cases,
        "seed": seed,
        "seconds": round(time.monotonic() - start, 1),
        "decoded": dict(sorted(outcomes.items())),
        "server_counters": {name: value for name, value in counters.items() if value},
        "rss_start_mb": round(rss_start / 2**20, 1),
        "rss_peak_after_warmup_mb": round(rss_peak_after_warmup / 2**20, 1),
        "rss_end_mb": round(process.memory_info().rss / 2**20, 1),
    }


def main() -> None:
    logging.basicConfig(level=logging.ERROR)  # the server's per-refusal warnings are expected
    cases = int(os.environ.get("KVWATCH_FUZZ_CASES", "100000"))
    seed = int(os.environ.get("KVWATCH_FUZZ_SEED", str(random.randrange(2**32))))
    json.dump(run(cases, seed), sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()

"""A live hook server under arbitrary engine connections: whatever a connection sends, the
server answers each line with exactly one counted outcome, raises nothing, and holds no
connection or stream once the connection ends."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwatch.hookwire.protocol import EngineInfo, encode
from tests.fuzz.conftest import fuzz_settings, message_bodies
from tests.fuzz.live import LiveServer

HELLO = encode(
    EngineInfo(
        engine="fuzz",
        model="m",
        pid=os.getpid(),
        bytes_per_block=1,
        device="cpu",
        kv_blocks_total=1,
    )
)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    directory = tempfile.mkdtemp(prefix="kvwf-", dir="/tmp")
    server = LiveServer(f"{directory}/engine.sock")
    yield server
    server.close()
    shutil.rmtree(directory, ignore_errors=True)


def _line(body: Any, raw: bool) -> bytes:
    if raw:  # lone surrogates as (invalid) UTF-8 bytes instead of escapes
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"
    return json.dumps(body).encode() + b"\n"


@fuzz_settings(0.2)
@given(
    st.booleans(),
    st.lists(st.tuples(message_bodies(), st.booleans()) | st.binary(max_size=80), max_size=8),
    st.data(),
)
def test_every_line_is_counted_once_and_nothing_is_left_held(
    live: LiveServer, hello_first: bool, items: list[Any], data: st.DataObject
) -> None:
    stream = (HELLO if hello_first else b"") + b"".join(
        item if isinstance(item, bytes) else _line(*item) for item in items
    )
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    live.check_session([chunk for chunk in chunks if chunk])

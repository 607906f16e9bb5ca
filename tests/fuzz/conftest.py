"""Property-based tests (hypothesis) of the engine-hook codec and of a live hook server.

Each test runs `examples(share)` cases: a CI run does tens of thousands in total; set
KVWATCH_FUZZ_CASES to run more (docs/protocol.md, "Fuzzing", gives the million-case command).
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvwatch.hookwire.protocol import MESSAGE_TYPES, PROTOCOL_VERSION

CASES_ENV = "KVWATCH_FUZZ_CASES"
CI_CASES = 10_000


def fuzz_settings(share: float) -> settings:
    """`share` of the run's cases (CI_CASES, or $KVWATCH_FUZZ_CASES), without time limits."""
    total = int(os.environ.get(CASES_ENV, CI_CASES))
    return settings(
        max_examples=max(1, int(total * share)),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# Text as an engine might send it, with lone surrogates and control characters in the mix.
texts = st.text(st.characters(exclude_categories=()), max_size=12) | st.sampled_from(
    ["", "r1", "\ud800", "a\udfffb", "\x00", "\n", "é", "🙂"]
)
numbers = st.integers(-3, 2**64) | st.floats(allow_nan=False) | st.booleans() | st.none()
leaves = texts | numbers
json_values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=12,
)
field_names = st.sampled_from(
    sorted(
        {"v", "type", "request_id", "correlation_id", "status", "engine", "local", "remote"}
        | {name for cls in MESSAGE_TYPES.values() for name in cls.__dataclass_fields__}
    )
)
endpoints = st.sampled_from(["127.0.0.1:8000", "[::1]:9", "10.0.0.1:0", "x:1", "1.2.3.4"])


@st.composite
def message_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A JSON object that is often close to a real message: right version and type, most
    fields present, some values wrong."""
    kind = draw(st.sampled_from(sorted(MESSAGE_TYPES)) | texts)
    body: dict[str, Any] = {"v": draw(st.just(PROTOCOL_VERSION) | numbers), "type": kind}
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    for name in cls.__dataclass_fields__ if cls is not None else ():
        if draw(st.integers(0, 9)) == 0:
            continue  # a required field may be missing
        if name in ("local", "remote"):
            body[name] = draw(endpoints | json_values)
        elif name == "status":
            body[name] = draw(st.sampled_from(["cancelled", "failed", "nope"]))
        else:
            body[name] = draw(st.integers(0, 2**40) | texts | json_values)
    body.update(draw(st.dictionaries(field_names | texts, json_values, max_size=2)))
    return body

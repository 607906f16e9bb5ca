"""From the id kvwatch announced a stream under to vLLM's ids of the requests behind it.

The middleware announces a stream under its request's `X-Request-Id` header, else under the
`id` of its first chunk. vLLM's OpenAI server builds the id it hands its engine from the
header (`_base_request_id`: the header's value, else a random one):

    /v1/completions        cmpl-<X>-<i>     one per prompt i of the request (0 for one prompt)
    /v1/chat/completions   chatcmpl-<X>

and the chunks carry `cmpl-<X>` / `chatcmpl-<X>`. The engine's input processor then appends
`-<8 random characters>` to make the internal id the scheduler knows, and the API server's
output processor keeps the map from the one to the other (`external_req_ids`). So the map is
read there, exactly, never guessed from a prefix.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

COMPLETION_PREFIX = "cmpl-"
CHAT_PREFIX = "chatcmpl-"


def external_ids_of(announced: str, *, from_header: bool, live: Iterable[str]) -> list[str]:
    """The external ids (vLLM's `external_req_id`) among `live` that belong to the stream
    announced as `announced`: the header's value (`from_header`) or its first chunk's id."""
    chat: str | None
    completion: re.Pattern[str] | None
    if from_header:
        chat = CHAT_PREFIX + announced
        completion = re.compile(re.escape(COMPLETION_PREFIX + announced) + r"-\d+")
    else:
        chat = announced if announced.startswith(CHAT_PREFIX) else None
        completion = (
            re.compile(re.escape(announced) + r"-\d+")
            if announced.startswith(COMPLETION_PREFIX)
            else None
        )
    return sorted(
        external
        for external in live
        if external == chat or (completion is not None and completion.fullmatch(external))
    )


def engine_request_ids(
    external_to_internal: Mapping[str, Sequence[str]], announced: str, *, from_header: bool
) -> list[str]:
    """vLLM's internal request ids (what its scheduler knows) of the stream announced as
    `announced`, from the output processor's `external_req_ids` map; [] when vLLM has none
    (the request ended, or never reached the engine)."""
    externals = external_ids_of(announced, from_header=from_header, live=list(external_to_internal))
    return [internal for external in externals for internal in external_to_internal[external]]

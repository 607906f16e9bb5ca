"""The hook's stream book: what it queues for the agent, in order, whatever the timing."""

from __future__ import annotations

from kvwatch.hook.book import COUNTER_NAMES, StreamBook
from kvwatch.hookwire.counters import EventCounters
from kvwatch.hookwire.protocol import Close, Open, Update
from kvwatch.sockets import Endpoint
from tests.hook.hook_agent import ENGINE_INFO

LOCAL = Endpoint.parse("127.0.0.1:8000")
REMOTE = Endpoint.parse("127.0.0.1:51000")


def in_session() -> StreamBook:
    book = StreamBook(ENGINE_INFO, 64, EventCounters(COUNTER_NAMES), wake=lambda: None)
    book.start_session()
    return book


def test_a_stream_closed_before_its_update_is_taken_still_sends_its_last_numbers() -> None:
    """The middleware's last token and its close can both land between two sends: the
    agent still hears the final count, then the close."""
    book = in_session()
    book.opened("req-1", LOCAL, REMOTE, kv_blocks=2)
    for tokens in range(1, 41):
        book.updated("req-1", kv_blocks=2, tokens_out=tokens)
    book.closed("req-1", "finished")
    messages = book.take(10)
    assert [type(m) for m in messages] == [Open, Update, Close]
    assert [m.tokens_out for m in messages if isinstance(m, Update)] == [40]


def test_a_reopened_id_gets_its_own_update_after_the_old_streams_last_one() -> None:
    book = in_session()
    book.opened("req-1", LOCAL, REMOTE, kv_blocks=2)
    book.updated("req-1", kv_blocks=2, tokens_out=5)
    book.closed("req-1", "finished")
    book.opened("req-1", LOCAL, REMOTE, kv_blocks=3)
    book.updated("req-1", kv_blocks=3, tokens_out=1)
    messages = book.take(10)
    updates = [m for m in messages if isinstance(m, Update)]
    assert [(u.kv_blocks, u.tokens_out) for u in updates] == [(2, 5), (3, 1)]
    book.updated("req-1", kv_blocks=3, tokens_out=2)  # the new stream queues again
    assert [m.tokens_out for m in book.take(10) if isinstance(m, Update)] == [2]

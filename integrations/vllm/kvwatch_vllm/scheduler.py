"""kvwatch's schedulers for vLLM, one for each of its scheduling paths:

    vllm serve MODEL --scheduler-cls kvwatch_vllm.scheduler.KvwatchAsyncScheduler
    vllm serve MODEL --no-async-scheduling --scheduler-cls kvwatch_vllm.scheduler.KvwatchScheduler

vLLM keeps async scheduling on for a custom `--scheduler-cls`: the class must match the path
(a plain `Scheduler` under async scheduling runs each request every other step only). Each
class is vLLM's own scheduler with `RequestHolds` (pause, park, resume one request) mixed in,
and adds the engine-core utilities the API server's middleware calls (engine_utility).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from kvwatch_vllm import engine_utility
from kvwatch_vllm.holds import RequestHolds

_log = logging.getLogger("kvwatch_vllm")


class KvwatchScheduler(RequestHolds):
    """vLLM's `Scheduler` (synchronous scheduling: one batch in flight) that obeys kvwatch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        engine_utility.install()
        if self.scheduler_config.async_scheduling:
            _log.warning(
                "kvwatch: KvwatchScheduler runs under async scheduling, where each request "
                "is scheduled only every other step; use "
                "kvwatch_vllm.scheduler.KvwatchAsyncScheduler, or --no-async-scheduling"
            )


class KvwatchAsyncScheduler(RequestHolds, AsyncScheduler):
    """vLLM's `AsyncScheduler` (async scheduling: the next batch is scheduled while one runs)
    that obeys kvwatch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        engine_utility.install()
        if not self.scheduler_config.async_scheduling:
            _log.warning(
                "kvwatch: KvwatchAsyncScheduler runs with async scheduling off; "
                "kvwatch_vllm.scheduler.KvwatchScheduler is the class for that path"
            )

"""One model step for a group of live requests: compute, sample, hand tokens to their queues."""

from __future__ import annotations

import time

from kvwatch.lab.engine.device import DeviceFence
from kvwatch.lab.engine.metrics import EngineMetrics
from kvwatch.lab.engine.model import ByteTokenizer
from kvwatch.lab.engine.requests import LiveRequest
from kvwatch.lab.engine.runner import ModelRunner


class StepExecutor:
    """Runs the model for the requests the scheduler planned and delivers their new tokens.

    Ownership: the engine thread's. After each forward call it records the device fence, so a
    later `DeviceFence.wait` covers every block this step touched.
    """

    def __init__(
        self,
        runner: ModelRunner,
        fence: DeviceFence,
        metrics: EngineMetrics,
        tokenizer: ByteTokenizer,
    ) -> None:
        self._runner = runner
        self._fence = fence
        self._metrics = metrics
        self._tokenizer = tokenizer

    def run(self, lives: list[LiveRequest]) -> list[LiveRequest]:
        """Advances each request by one token; returns those that reached max_tokens."""
        seqs = [live.seq for live in lives]
        tokens = self._runner.step(seqs, [live.sampling for live in lives])
        self._fence.record()
        now = time.monotonic()
        finished: list[LiveRequest] = []
        for live, token in zip(lives, tokens, strict=True):
            seq = live.seq
            seq.num_computed_tokens = len(seq.token_ids)
            seq.token_ids.append(token)
            live.handle.channel.put(token, self._tokenizer.decode_token(token))
            if seq.num_generated == 1:
                self._metrics.time_to_first_token.observe(now - live.arrival_seconds)
            elif live.last_token_seconds:
                self._metrics.inter_token_latency.observe(now - live.last_token_seconds)
            live.last_token_seconds = now
            if seq.num_generated >= seq.max_tokens:
                finished.append(live)
        self._metrics.generation_tokens.inc(len(lives))
        return finished

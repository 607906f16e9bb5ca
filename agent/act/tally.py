"""What the actions did, counted: outcomes by action, reason and result, the KV the engines
freed by cancels and by parks, and the parked requests that resumed (kvwatch_actions_total,
kvwatch_actions_reclaimed_kv_bytes_total, kvwatch_parks_freed_kv_bytes_total,
kvwatch_parks_resumed_total)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ActionTally:
    """Counts of actions by (action, reason, result), the KV bytes reclaimed (cancels and
    the requests a reset ended) and freed by parks, the resumes of parked requests, and the
    renewals of held requests' leases (and those the engine refused: the request was gone)."""

    outcomes: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    reclaimed_kv_bytes: int = 0
    reclaimed_kv_blocks: int = 0
    parked_kv_bytes: int = 0
    parked_kv_blocks: int = 0
    resumes: int = 0
    renewals: int = 0
    renewals_failed: int = 0
    window_probes: int = 0

    def reclaimed(self, blocks: int, nbytes: int) -> None:
        self.reclaimed_kv_blocks += blocks
        self.reclaimed_kv_bytes += nbytes

    def parked(self, blocks: int, nbytes: int) -> None:
        self.parked_kv_blocks += blocks
        self.parked_kv_bytes += nbytes

"""What the actions did, counted: outcomes by action, reason and result, and the KV the
engines freed (kvwatch_actions_total, kvwatch_actions_reclaimed_kv_bytes_total)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ActionTally:
    """Counts of actions by (action, reason, result) and the KV bytes reclaimed."""

    outcomes: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    reclaimed_kv_bytes: int = 0
    reclaimed_kv_blocks: int = 0

    def reclaimed(self, blocks: int, nbytes: int) -> None:
        self.reclaimed_kv_blocks += blocks
        self.reclaimed_kv_bytes += nbytes

"""Bookkeeping of the paged KV cache: a pool of fixed-size blocks and one block table per request.

This module holds no tensors. The KV tensors live in `kvwatch.lab.engine.attention.PagedKVStorage`;
block id `b` names rows `b * block_size ... (b + 1) * block_size - 1` of every layer's K and V.
"""

from __future__ import annotations

from collections import deque

from kvwatch.errors import KvwatchError

_BUG_HINT = "this is a bug in the reference engine; report it with the engine log"


class KvCacheInvariantError(KvwatchError):
    """A block-ownership invariant is broken: a bug, never an expected outcome."""


class BlockPool:
    """A fixed pool of KV blocks with a free list.

    Invariants: every block id in [0, num_blocks) is either on the free list or owned by exactly
    one owner, never both and never neither; so `num_free + owned == num_blocks` at all times.
    Running out of blocks is expected: `allocate` then returns None and changes nothing.
    Freeing a block its caller does not own is a bug and raises `KvCacheInvariantError`.

    Ownership: only `KVCacheManager` calls `allocate` and `free`, and only on the engine thread.
    The caller must make sure no device work still reads or writes a block before freeing it
    (the engine waits on its step fence first), because a freed block may be handed out by the
    very next `allocate`.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise KvCacheInvariantError(f"a block pool needs blocks, got {num_blocks}", _BUG_HINT)
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def owner_of(self, block_id: int) -> str | None:
        return self._owner.get(block_id)

    def allocate(self, owner: str, count: int) -> list[int] | None:
        """Hands `count` free blocks to `owner`, or returns None (and changes nothing)."""
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self._owner[block_id] = owner
        return blocks

    def free(self, owner: str, blocks: list[int]) -> None:
        """Returns `owner`'s blocks to the free list; raises if any is not owned by `owner`."""
        for block_id in blocks:
            if self._owner.get(block_id) != owner:
                raise KvCacheInvariantError(
                    f"block {block_id} freed by {owner!r} but owned by "
                    f"{self._owner.get(block_id)!r}",
                    _BUG_HINT,
                )
        for block_id in blocks:
            del self._owner[block_id]
            self._free.append(block_id)

    def check(self) -> None:
        """Raises `KvCacheInvariantError` unless every block is free xor owned, exactly once."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise KvCacheInvariantError("a block is on the free list twice", _BUG_HINT)
        if free_set & self._owner.keys():
            raise KvCacheInvariantError("a block is both free and owned", _BUG_HINT)
        if len(free_set) + len(self._owner) != self.num_blocks:
            raise KvCacheInvariantError("blocks went missing from the pool", _BUG_HINT)


class KVCacheManager:
    """Block tables: for each request, the ordered list of blocks that hold its KV.

    Invariants: a request's table covers exactly `ceil(tokens / block_size)` blocks for the
    tokens reserved through `ensure_capacity`; every block in a table is owned by that table's
    request in the pool; no block appears in two tables. A request with no blocks has no table.

    Ownership: the engine thread alone calls the mutating methods (`ensure_capacity`, `free`);
    other threads only read the published counters through the engine's stats.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def ensure_capacity(self, request_id: str, num_tokens: int) -> bool:
        """Grows the request's table to hold `num_tokens`; False (nothing changed) if the pool
        has too few free blocks."""
        table = self._tables.get(request_id, [])
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(request_id, missing)
        if blocks is None:
            return False
        self._tables[request_id] = table + blocks
        return True

    def free(self, request_id: str) -> int:
        """Frees every block of the request; returns how many. Unknown requests free nothing."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return 0
        self.pool.free(request_id, table)
        return len(table)

    def check_invariants(self) -> None:
        """Raises `KvCacheInvariantError` if any invariant of this class or the pool is broken."""
        self.pool.check()
        seen: set[int] = set()
        for request_id, table in self._tables.items():
            for block_id in table:
                if block_id in seen:
                    raise KvCacheInvariantError(f"block {block_id} is in two tables", _BUG_HINT)
                seen.add(block_id)
                if self.pool.owner_of(block_id) != request_id:
                    raise KvCacheInvariantError(
                        f"block {block_id} is in {request_id!r}'s table but not owned by it",
                        _BUG_HINT,
                    )
        if len(seen) != self.num_used_blocks:
            raise KvCacheInvariantError("an owned block is in no table", _BUG_HINT)

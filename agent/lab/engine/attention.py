"""Paged KV storage and the attention that reads KV through block tables.

Block `b` of the pool is rows `b * block_size ... (b + 1) * block_size - 1` of every layer's K and
V tensors. Token position `p` of a request lives in block `table[p // block_size]`, row
`p % block_size`. Attention gathers a request's keys and values by its block table, so the
tokens of one request may sit in any blocks of the pool, in any order.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from kvwatch.lab.engine.config import ModelShape
from kvwatch.lab.engine.transfer import CudaTransfer, HostKV, KVTransfer


def bytes_per_block(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    """KV bytes one block holds: all layers, K and V."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return shape.n_layers * 2 * block_size * shape.d_model * element_bytes


class PagedKVStorage:
    """The KV tensors of all layers, `[num_blocks * block_size, heads, head_dim]` each.

    Ownership: only the engine thread writes it, through `PagedAttention`, and only into the
    rows of blocks that `KVCacheManager` handed to the request being computed. The storage
    itself knows nothing about requests.
    """

    def __init__(
        self,
        shape: ModelShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        rows = num_blocks * block_size
        size = (rows, shape.n_heads, shape.head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.keys = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.n_layers)]
        self.values = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.n_layers)]
        self.bytes_per_block = bytes_per_block(shape, block_size, dtype)
        self._copy_stream: torch.cuda.Stream | None = None

    def copy_out(self, block_ids: list[int]) -> HostKV:
        """Starts a host-memory copy of these blocks' K and V, in the order given; the blocks
        must stay allocated until its transfer is done (kvwatch.lab.engine.transfer). On CUDA the
        copy runs on the storage's copy stream, after the work queued so far on the current
        stream (the last step's KV writes), into pinned memory; on the CPU it is done at once.
        """
        keys = self.keys[0]
        size = (len(self.keys), 2, len(block_ids), self.block_size, *keys.shape[1:])
        if keys.device.type != "cuda":
            return HostKV(self._gather(block_ids, size), KVTransfer())
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(keys.device)  # type: ignore[no-untyped-call]
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(keys.device))
        host = torch.empty(size, dtype=keys.dtype, pin_memory=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            host.copy_(self._gather(block_ids, size), non_blocking=True)
            event.record(stream)
        return HostKV(host, CudaTransfer(event))

    def copy_in(self, block_ids: list[int], copy: torch.Tensor) -> None:
        """Writes a `copy_out` copy into these blocks (as many as the copy has), in order.
        Queued on the current stream, so the next step reads the KV it wrote; the step's
        fence then covers the copy too."""
        index = torch.tensor(block_ids[: copy.shape[2]], device=self.keys[0].device)
        on_device = copy.to(self.keys[0].device, non_blocking=True)
        for layer, pair in enumerate(zip(self.keys, self.values, strict=True)):
            for kind, rows in enumerate(pair):
                self._blocks(rows).index_copy_(0, index, on_device[layer, kind])

    def _gather(self, block_ids: list[int], size: tuple[int, ...]) -> torch.Tensor:
        """These blocks' K and V in one new tensor on the storage's device (on the current
        stream)."""
        keys = self.keys[0]
        index = torch.tensor(block_ids, device=keys.device)
        gathered = torch.empty(size, dtype=keys.dtype, device=keys.device)
        for layer, pair in enumerate(zip(self.keys, self.values, strict=True)):
            for kind, rows in enumerate(pair):
                torch.index_select(self._blocks(rows), 0, index, out=gathered[layer, kind])
        return gathered

    def _blocks(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` seen as `[num_blocks, block_size, heads, head_dim]` (a view, no copy)."""
        return rows.view(self.num_blocks, self.block_size, rows.shape[1], rows.shape[2])


@dataclass(frozen=True)
class PagedBatch:
    """Index tensors for one forward call over `num_seqs` requests and `tokens` new tokens.

    slot_mapping[i]: the KV row where new token i is written.
    query_index[i]: where new token i sits in the padded `[num_seqs * max_query_len]` layout.
    block_tables: `[num_seqs, max_blocks]`, padded with block 0 (masked out).
    attn_mask: `[num_seqs, 1, max_query_len, max_blocks * block_size]`, True where a query may
    attend: key position <= query position (causal, and never past the request's own tokens).
    """

    slot_mapping: torch.Tensor
    query_index: torch.Tensor
    block_tables: torch.Tensor
    attn_mask: torch.Tensor
    num_seqs: int
    max_query_len: int


def build_paged_batch(
    first_positions: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> PagedBatch:
    """Index tensors for requests whose new tokens start at `first_positions[s]` and number
    `query_lens[s]`, with KV reachable through `block_tables[s]`."""
    num_seqs = len(query_lens)
    max_query_len = max(query_lens)
    max_blocks = max(len(table) for table in block_tables)
    flat_tables = array.array("q")  # one flat buffer: far cheaper than nested lists
    for table in block_tables:
        flat_tables.extend(table)
        flat_tables.extend([0] * (max_blocks - len(table)))
    tables = torch.frombuffer(flat_tables, dtype=torch.long).view(num_seqs, max_blocks)
    offsets = torch.arange(max_query_len)
    valid = offsets.view(1, -1) < torch.tensor(query_lens).view(-1, 1)
    positions = torch.tensor(first_positions).view(-1, 1) + offsets.view(1, -1)
    positions = torch.where(valid, positions, 0)  # padded queries look at key 0 only
    slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
    padded_index = torch.arange(num_seqs * max_query_len).view(num_seqs, max_query_len)
    mask = torch.arange(max_blocks * block_size).view(1, 1, -1) <= positions.unsqueeze(-1)
    return PagedBatch(
        slot_mapping=slots[valid].to(device),
        query_index=padded_index[valid].to(device),
        block_tables=tables.to(device),
        attn_mask=mask.unsqueeze(1).to(device),
        num_seqs=num_seqs,
        max_query_len=max_query_len,
    )


class PagedAttention:
    """An `AttentionFn` for one forward call: writes the new K/V into their slots, then gathers
    each request's K/V through its block table and attends with the batch's mask."""

    def __init__(self, storage: PagedKVStorage, batch: PagedBatch) -> None:
        self.storage = storage
        self.batch = batch

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        batch, storage = self.batch, self.storage
        keys, values = storage.keys[layer], storage.values[layer]
        keys.index_copy_(0, batch.slot_mapping, k)
        values.index_copy_(0, batch.slot_mapping, v)
        heads, head_dim = q.shape[1], q.shape[2]
        padded_q = q.new_zeros((batch.num_seqs * batch.max_query_len, heads, head_dim))
        padded_q[batch.query_index] = q
        padded_q = padded_q.view(batch.num_seqs, batch.max_query_len, heads, head_dim)
        gathered_k = _gather(keys, batch.block_tables, storage.block_size)
        gathered_v = _gather(values, batch.block_tables, storage.block_size)
        out = F.scaled_dot_product_attention(
            padded_q.transpose(1, 2),
            gathered_k.transpose(1, 2),
            gathered_v.transpose(1, 2),
            attn_mask=batch.attn_mask,
        )
        flat = out.transpose(1, 2).reshape(-1, heads, head_dim)
        return flat[batch.query_index]


def _gather(rows: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[num_seqs, max_blocks * block_size, heads, head_dim]: each request's rows in position
    order, read through its block table."""
    blocks = rows.view(-1, block_size, rows.shape[1], rows.shape[2])
    gathered = blocks[block_tables]
    return gathered.reshape(block_tables.shape[0], -1, rows.shape[1], rows.shape[2])

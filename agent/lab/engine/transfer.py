"""Copies of KV blocks between the device's pool and host memory, as asynchronous operations.

A copy that is under way may still read (a park's copy out) or write (a resume's copy in)
its blocks: no block it touches may return to the pool, let alone be handed to another
request, before the copy has completed. So a copy is handed back as a `KVTransfer`, which
says when it has: on CUDA the copy runs on a stream of its own and the transfer is the event
recorded after it; on the CPU a copy is done when the call returns, and so is its transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVTransfer:
    """One copy of KV blocks, under way or done; this base class is one that is done (a
    synchronous copy). Ownership: the engine thread's."""

    def done(self) -> bool:
        """True once the copy has completed: its blocks may be freed."""
        return True

    def wait(self) -> None:
        """Blocks until the copy has completed."""


class CudaTransfer(KVTransfer):
    """A copy queued on a CUDA stream; done once the event recorded after it has passed."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        self._event.synchronize()


@dataclass(frozen=True)
class HostKV:
    """KV blocks' contents in host memory, `[layers, 2, blocks, block_size, heads, head_dim]`
    (`PagedKVStorage.copy_out`): final once `transfer` is done."""

    blocks: torch.Tensor
    transfer: KVTransfer

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

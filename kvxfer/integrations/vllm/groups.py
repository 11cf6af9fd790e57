"""The scheduler side's record of one vLLM transfer group: its role and block sizes, no tensors.

:func:`kvxfer.integrations.vllm.spec.transfer_groups` makes these from an engine's ``KVCacheConfig``
(the same way on both instances of a P/D pair); the scheduler, its plans and its checks of a
prefill's publish read only these records, never vLLM's objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["TransferGroup"]


@dataclass(frozen=True)
class TransferGroup:
    """What the scheduler side needs about one vLLM transfer group (no tensors, no layout).

    ``role``: ``full`` (every block of the prompt moves), ``window`` (sliding window: only the
    blocks the decode side still attends to), ``chunked`` (chunked local attention: only the
    blocks of the decode side's current chunk) or ``state`` (Mamba: the running-state block).
    """

    index: int  # position in KVCacheConfig.transfer_groups (the order of remote_block_ids)
    name: str
    role: str
    block_size: int  # tokens per (manager) block
    window: int = 0  # sliding window in tokens
    spec_blocks: int = 0  # Mamba: trailing speculative scratch blocks
    chunk: int = 0  # chunked local attention: tokens per chunk
    #: Mamba: the state's split over TP ranks is known (segments, or replicated), so it moves
    #: between any TP sizes; False: an opaque page, equal TP sizes only.
    tp_split: bool = False
    #: Mamba, split known: this rank's byte size of each TP segment of the state (``mamba_tp_split``;
    #: empty for a replicated state), told to the decode side to check the two splits alike.
    segments: tuple[int, ...] = ()

    @property
    def window_blocks(self) -> int:
        """Blocks a sliding-window group keeps: the window, plus one for a window that straddles blocks."""
        return math.ceil(self.window / self.block_size) + 1 if self.window else 0

"""vLLM's transfer groups as the scheduler side sees them: roles and block sizes, no tensors.

A vLLM *transfer group* (``KVCacheConfig.transfer_groups``: full attention, sliding window, chunked
local attention, Mamba) is what the scheduler hands out blocks for; :func:`transfer_groups` turns an
engine's ``KVCacheConfig`` into :class:`TransferGroup` records, the same way on both instances of a
P/D pair. A Mamba group's split over TP ranks (:func:`mamba_tp_split`) comes from vLLM's own
``derive_mamba_conv_split``. vLLM is imported inside the functions, so that this module (and the
scheduler side) imports without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TransferGroup", "mamba_tp_split", "reports_failed_blocks", "transfer_group_specs", "transfer_groups"]


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


def transfer_groups(kv_cache_config: Any, tp_size: int = 1) -> tuple[TransferGroup, ...]:
    """The transfer groups of an engine, from its ``KVCacheConfig`` (scheduler or worker copy) and TP size."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec

    out = []
    for i, group in enumerate(transfer_group_specs(kv_cache_config)):
        spec = _first_spec(group.kv_cache_spec)
        if isinstance(spec, MambaSpec):
            segments, replicated = mamba_tp_split(spec, tp_size)
            out.append(TransferGroup(i, f"g{i}", "state", int(spec.block_size),
                                     spec_blocks=int(spec.num_speculative_blocks),
                                     tp_split=bool(segments) or replicated, segments=segments))  # fmt: skip
        elif isinstance(spec, SlidingWindowSpec):
            out.append(TransferGroup(i, f"g{i}", "window", int(spec.block_size), window=int(spec.sliding_window)))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            out.append(TransferGroup(i, f"g{i}", "chunked", int(spec.block_size), chunk=int(spec.attention_chunk_size)))
        else:
            out.append(TransferGroup(i, f"g{i}", "full", int(spec.block_size)))
    return tuple(out)


def mamba_tp_split(spec: Any, tp_size: int) -> tuple[tuple[int, ...], bool]:
    """How a Mamba layer's state is split over ``tp_size`` TP ranks: (segments, replicated).

    ``MambaSpec.tp_replicated``: every rank holds the whole state. Otherwise, with vLLM's DS conv
    state layout (``VLLM_SSM_CONV_STATE_LAYOUT=DS``: the conv state is (dim, state_len), so each
    sub-projection is contiguous) and a Mamba1, Mamba2 or GDN layer, vLLM's own
    ``derive_mamba_conv_split`` names the conv state's sub-projections (x; x, B, C; Q, K, V), each
    split evenly over the ranks, and the temporal (SSM) state follows, split on its first dim: the
    segments, as this rank's byte sizes in page order, as vLLM's NixlConnector reads them. Anything
    else (the SD layout, other mamba types, states that do not add up): ``((), False)``, an opaque
    page that moves only between equal TP sizes.
    """
    if getattr(spec, "tp_replicated", False):
        return (), True
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:  # a vLLM without NIXL's conv split
        return (), False
    shapes = tuple(getattr(spec, "shapes", ()))
    if not is_conv_state_dim_first() or len(shapes) != 2 or len(shapes[0]) != 2:
        return (), False
    try:
        split = derive_mamba_conv_split(spec, tp_size)
    except (NotImplementedError, AssertionError, ValueError, TypeError, ZeroDivisionError):
        return (), False
    segments = (*(int(b) for b in split.proj_bytes), int(split.ssm_sizes[1]))
    # The conv state's parts and the temporal state are the whole page content, in this order
    # (MambaSpec.shapes order, as the Mamba layer cuts its page); anything else stays opaque.
    if min(segments) < 1 or sum(segments) != int(spec.state_content_size_bytes):
        return (), False
    if sum(segments[:-1]) != int(split.ssm_sizes[0]):
        return (), False
    return segments, False


def reports_failed_blocks(kv_cache_config: Any) -> bool:
    """Whether a failed load may be reported to vLLM as its blocks (``get_block_ids_with_load_errors``).

    vLLM maps failed block ids back to requests only for a model with one KV-cache group (it stops
    the engine otherwise), and then recomputes from the first failed block over the blocks before
    it. That is sound for full attention alone: a sliding window's or a Mamba group's blocks
    before it are null blocks, and the recompute would attend to zeros. Everything else is
    reported per request (``failed_recving``), which recomputes or fails the whole prompt.
    """
    groups = transfer_groups(kv_cache_config)
    return len(kv_cache_config.kv_cache_groups) == 1 and len(groups) == 1 and groups[0].role == "full"


def transfer_group_specs(kv_cache_config: Any) -> Sequence[Any]:
    """vLLM's transfer groups of a ``KVCacheConfig`` (its KV-cache groups for a vLLM without them)."""
    groups = getattr(kv_cache_config, "transfer_groups", None)
    return tuple(groups) if groups is not None else tuple(kv_cache_config.kv_cache_groups)


def _first_spec(spec: Any) -> Any:
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs wraps one spec per layer
    return next(iter(inner.values())) if inner else spec

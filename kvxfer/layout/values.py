"""The value types a :class:`~kvxfer.layout.model.KVCacheLayout` answers with (:class:`RegionSpec`,
:class:`Plane`) and the :class:`TensorLike` it reads a layout from.

They live apart from the layout so that the modules that compute them (``geometry``) and read
them (``spans``, ``kvxfer.memory``) need not import the layout class itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Plane", "RegionSpec", "TensorLike"]


@dataclass(frozen=True)
class RegionSpec:
    """One contiguous memory region to register: which layers it holds and its size in bytes."""

    index: int
    first_layer: int
    num_layers: int
    nbytes: int


@dataclass(frozen=True)
class Plane:
    """Equal rows of one part of the content, one per (head, token), addressed affinely.

    Row ``(head, token)`` of a block starts ``offset + head * head_stride + (token //
    kernel_block_size) * kernel_stride + (token % kernel_block_size) * token_stride`` bytes after
    the block's start (:meth:`KVCacheLayout.block_offset`) and is ``row_bytes`` long; a row of a
    transposed plane is ``elements`` pieces of ``row_bytes``, ``element_stride`` apart. ``part``
    names what the rows hold: ``kv`` (K and V packed), ``k``/``v``, ``k_data``/``k_scale``/
    ``v_data``/``v_scale`` (nvfp4), ``latent`` (MLA) or ``state`` (Mamba).
    """

    part: str
    offset: int
    head_stride: int
    token_stride: int
    kernel_stride: int
    row_bytes: int
    elements: int = 1
    element_stride: int = 0


class TensorLike(Protocol):
    """What :meth:`KVCacheLayout.from_tensor` reads of a tensor (torch or numpy)."""

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def dtype(self) -> Any: ...

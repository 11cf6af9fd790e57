"""What two layouts must share to exchange blocks (:meth:`KVCacheLayout.incompatibilities`): one
reason per difference, for a handshake to refuse a peer with."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvxfer.layout.kinds import CacheKind, Packing
from kvxfer.layout.segments import segment_incompatibilities

if TYPE_CHECKING:
    # Annotations only: the layout imports this module to compare itself with a peer's.
    from kvxfer.layout.model import KVCacheLayout

__all__ = ["layout_incompatibilities"]


def layout_incompatibilities(local: KVCacheLayout, remote: KVCacheLayout) -> list[str]:
    """:meth:`KVCacheLayout.incompatibilities`: every reason blocks cannot move between ``local`` and ``remote``."""
    diffs: list[str] = []

    def differ(name: str, mine: object, theirs: object) -> None:
        if mine != theirs:
            diffs.append(f"{name}: local {mine}, remote {theirs}")

    differ("kind", local.kind.value, remote.kind.value)
    differ("dtype", local.dtype.value, remote.dtype.value)
    differ("num_layers", local.num_layers, remote.num_layers)
    # head_size holds the latent dim of an MLA cache and the page bytes of a Mamba one.
    size_name = {CacheKind.MLA: "latent_dim", CacheKind.MAMBA: "page_size_bytes"}.get(local.kind, "head_size")
    if local.kind is remote.kind is CacheKind.MAMBA and (local.segments or remote.segments):
        diffs.extend(segment_incompatibilities(local, remote))
    else:
        differ(size_name if local.kind is remote.kind else "head_size", local.head_size, remote.head_size)
    if local.head_size == remote.head_size:
        differ("head_size_v", local.v_head_size, remote.v_head_size)
    differ("total_kv_heads", local.total_kv_heads, remote.total_kv_heads)
    differ("packing", local.packing.value, remote.packing.value)
    if Packing.HEAD_BLOCK in (local.packing, remote.packing) and (local.block_size, local.tokens_per_kernel_block) != (
        remote.block_size,
        remote.tokens_per_kernel_block,
    ):
        diffs.append(
            f"block_size: local {local.block_size}, remote {remote.block_size}: packing head_block (a CPU "
            "attention kernel's private page order) moves whole blocks, so both sides need the same block size"
        )
    small, large = sorted((local.block_size, remote.block_size))
    if large % small:
        diffs.append(
            f"block_size: local {local.block_size}, remote {remote.block_size} (neither is a multiple of the other)"
        )
    return diffs

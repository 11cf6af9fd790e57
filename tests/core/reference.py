"""A naive byte-level model of the standardized layouts, written from the spec, not from kvxfer.

Every rank's memory is one numpy byte buffer with its regions at known offsets (the "addresses").
Logical KV values are indexed (layer, block, token, group, global head, byte-of-row); the model
places them with plain index arithmetic and reads the expected result of a transfer back out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GUARD = 64  # bytes between regions, so an overrun lands in a guard band and is caught


def row_bytes(kind: str, dtype: str, head_size: int) -> int:
    bits = {"bf16": 16, "fp16": 16, "fp32": 32, "fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8}
    if kind == "mamba":
        return head_size
    if dtype == "nvfp4":
        return head_size // 2 + head_size // 16
    elems = 2 * head_size if kind == "attention" else head_size
    return elems * bits[dtype] // 8


@dataclass(frozen=True)
class Side:
    """One rank's cache as the reference sees it (all numbers, no kvxfer objects)."""

    kind: str
    dtype: str
    layers: int
    blocks: int
    tokens: int  # per block (1 for mamba)
    groups: int  # 2 for quantized
    heads: int  # heads held by this rank
    head_start: int  # global index of its first head
    head_size: int
    order: str
    cross: bool

    @property
    def row(self) -> int:
        return row_bytes(self.kind, self.dtype, self.head_size)

    @property
    def entries(self) -> int:
        return self.groups * self.heads

    @property
    def page(self) -> int:
        return self.tokens * self.entries * self.row

    @property
    def regions(self) -> int:
        return 1 if self.cross else self.layers

    @property
    def region_bytes(self) -> int:
        return self.blocks * self.page * (self.layers if self.cross else 1)

    def bases(self) -> list[int]:
        return [GUARD + i * (self.region_bytes + GUARD) for i in range(self.regions)]

    def buffer_bytes(self) -> int:
        return GUARD + self.regions * (self.region_bytes + GUARD)

    def offsets(self) -> np.ndarray:
        """Byte address of row (layer, block, token, group, local head), shape (L, B, N, G, H)."""
        layer = np.arange(self.layers)[:, None, None, None, None]
        block = np.arange(self.blocks)[None, :, None, None, None]
        tok = np.arange(self.tokens)[None, None, :, None, None]
        grp = np.arange(self.groups)[None, None, None, :, None]
        head = np.arange(self.heads)[None, None, None, None, :]
        entry = grp * self.heads + head
        if self.order == "HND":
            inner = (entry * self.tokens + tok) * self.row
        else:
            inner = (tok * self.entries + entry) * self.row
        bases = np.asarray(self.bases())
        if self.cross:
            addr = bases[0] + block * (self.layers * self.page) + layer * self.page + inner
        else:
            addr = bases[layer] + block * self.page + inner
        return np.broadcast_to(addr, (self.layers, self.blocks, self.tokens, self.groups, self.heads))


def fill_from_logical(side: Side, logical: np.ndarray, buf: np.ndarray) -> None:
    """Write logical values (L, B, N, G, total heads, row) into this rank's buffer."""
    offs = side.offsets()
    vals = logical[:, :, :, :, side.head_start : side.head_start + side.heads, :]
    idx = offs[..., None] + np.arange(side.row)
    buf[idx] = vals


def expected_after_pull(
    local: Side, local_buf: np.ndarray, logical: np.ndarray, local_blocks: np.ndarray, remote_blocks: np.ndarray,
    remote_tokens: int,
) -> np.ndarray:  # fmt: skip
    """The local buffer after the request's blocks were read, moved token by token."""
    out = local_buf.copy()
    offs = local.offsets()
    for j, lb in enumerate(local_blocks):
        for t in range(local.tokens):
            k = j * local.tokens + t
            rb, rt = remote_blocks[k // remote_tokens], k % remote_tokens
            for layer in range(local.layers):
                for g in range(local.groups):
                    for h in range(local.heads):
                        a = int(offs[layer, lb, t, g, h])
                        out[a : a + local.row] = logical[layer, rb, rt, g, local.head_start + h]
    return out


def apply_descriptors(dst: np.ndarray, src: np.ndarray, local: np.ndarray, remote: np.ndarray) -> None:
    """Execute READ descriptors with plain numpy copies."""
    for (la, ln, _), (ra, rn, _) in zip(local.tolist(), remote.tolist(), strict=True):
        assert ln == rn
        dst[la : la + ln] = src[ra : ra + rn]

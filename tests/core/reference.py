"""A naive model of the standardized KV-cache layouts, written from DESIGN.md and nothing of kvxfer.

Logical values are what a model holds: for every layer, token and head a K vector and a V vector
of ``head_size`` elements (MLA: one latent vector per token; Mamba: an opaque page per block and
rank). The model computes the byte address of every single element on a rank from the layout
rules alone, fills rank memories from the logical values, and says what a decode rank's memory
must hold once it has pulled a request, by moving logical values one element at a time (the moves
are vectorized over elements, but every element's source and destination are computed on their own).

nvfp4 elements are 4-bit codes, two to a byte (element 2i in the low nibble of data byte i) and one
fp8 scale byte per 16 elements after the data bytes of a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

GUARD = 64  # bytes around every region, so that an overrun lands in noise and is caught

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}

IntArray = npt.NDArray[np.int64]
Bytes = npt.NDArray[np.uint8]


def heads_of_rank(total_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """Global KV heads ``[first, stop)`` of a TP rank: an even split, or replicas when tp > heads."""
    if total_heads >= tp_size:
        per = total_heads // tp_size
        return rank * per, rank * per + per
    replicas = tp_size // total_heads
    return rank // replicas, rank // replicas + 1


@dataclass(frozen=True)
class Side:
    """One rank's cache as the model sees it: plain numbers only."""

    kind: str  # attention | quantized | mla | mamba
    dtype: str
    layers: int
    blocks: int
    tokens: int  # per block (1 for mamba)
    heads: int  # KV heads on this rank (1 for mla and mamba)
    head_start: int  # global index of the first of them
    head_size: int  # elements per K or V vector; mla: latent dim; mamba: page bytes
    order: str  # HND | NHD
    cross: bool
    rank: int

    @property
    def groups(self) -> int:
        """Quantized caches keep K heads and V heads as two groups of entries."""
        return 2 if self.kind == "quantized" else 1

    @property
    def entries(self) -> int:
        return self.groups * self.heads

    @property
    def row(self) -> int:
        hs = self.head_size
        if self.kind == "mamba":
            return hs
        if self.dtype == "nvfp4":
            return hs // 2 + hs // 16
        vectors = 2 if self.kind == "attention" else 1  # K and V packed in one row
        return vectors * hs * ELEMENT_BYTES[self.dtype]

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

    def row_address(self, layer: IntArray, block: IntArray, token: IntArray, entry: IntArray) -> IntArray:
        """Address of the first byte of the row of (layer, block, token, entry); arrays broadcast."""
        if self.order == "HND":
            inner = (entry * self.tokens + token) * self.row
        else:
            inner = (token * self.entries + entry) * self.row
        bases = np.asarray(self.bases(), dtype=np.int64)
        if self.cross:
            return bases[0] + block * (self.layers * self.page) + layer * self.page + inner
        return bases[layer] + block * self.page + inner


def _grid(*sizes: int) -> list[IntArray]:
    """Index arrays of an n-dim grid, each shaped to broadcast along its own axis."""
    out = []
    for axis, n in enumerate(sizes):
        shape = [1] * len(sizes)
        shape[axis] = n
        out.append(np.arange(n, dtype=np.int64).reshape(shape))
    return out


def logical_values(rng: np.random.Generator, side: Side, total_heads: int, tp_size: int) -> dict[str, Bytes]:
    """Random logical contents of the *remote* cache group (every head of the model).

    Shapes (L = layers, B = blocks, N = tokens per block, H = total heads, D = head_size):
    attention/quantized ``kv`` (L, B, N, 2, H, D, element bytes); nvfp4 ``codes`` (L, B, N, 2, H, D)
    of 4 bits and ``scales`` (L, B, N, 2, H, D/16); mla ``latent`` (L, B, N, D, element bytes);
    mamba ``page`` (tp_size, L, B, page bytes), different on every rank.
    """
    lbn = (side.layers, side.blocks, side.tokens)
    hs = side.head_size
    if side.kind == "mamba":
        return {"page": rng.integers(0, 256, (tp_size, side.layers, side.blocks, hs), dtype=np.uint8)}
    if side.kind == "mla":
        return {"latent": rng.integers(0, 256, (*lbn, hs, ELEMENT_BYTES[side.dtype]), dtype=np.uint8)}
    if side.dtype == "nvfp4":
        return {
            "codes": rng.integers(0, 16, (*lbn, 2, total_heads, hs), dtype=np.uint8),
            "scales": rng.integers(0, 256, (*lbn, 2, total_heads, hs // 16), dtype=np.uint8),
        }
    return {"kv": rng.integers(0, 256, (*lbn, 2, total_heads, hs, ELEMENT_BYTES[side.dtype]), dtype=np.uint8)}


def place(side: Side, values: dict[str, Bytes], buf: Bytes, blocks: IntArray, src_block: IntArray,
          src_token: IntArray) -> None:  # fmt: skip
    """Write logical values into ``buf``: token t of block ``blocks[j]`` on this side gets the values
    of (``src_block[j, t]``, ``src_token[j, t]``) of the logical cache, for every layer and for the
    heads this side holds."""
    layer, j, t = _grid(side.layers, len(blocks), side.tokens)
    block = blocks[j]
    sb, st = src_block[j, t], src_token[j, t]
    hs = side.head_size
    if side.kind == "mamba":
        (byte,) = _grid(hs)
        addr = side.row_address(layer, block, t, np.zeros(1, np.int64))[..., None] + byte
        buf[addr] = values["page"][side.rank][layer, sb]
        return
    if side.kind == "mla":
        d, b = _grid(hs, ELEMENT_BYTES[side.dtype])
        row = side.row_address(layer, block, t, np.zeros(1, np.int64))[..., None, None]
        eb = ELEMENT_BYTES[side.dtype]
        buf[row + d * eb + b] = values["latent"][layer[..., None, None], sb[..., None, None], st[..., None, None], d, b]
        return
    kv, h = _grid(2, side.heads)
    gh = side.head_start + h  # global head
    entry = kv * side.heads + h if side.kind == "quantized" else h + 0 * kv
    row = side.row_address(layer[..., None, None], block[..., None, None], t[..., None, None], entry)
    idx = (layer[..., None, None], sb[..., None, None], st[..., None, None], kv, gh)
    if side.dtype == "nvfp4":
        codes = values["codes"][idx]  # (..., 2, heads, D)
        scales = values["scales"][idx]
        (i,) = _grid(hs // 2)
        buf[row[..., None] + i] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        (s,) = _grid(hs // 16)
        buf[row[..., None] + hs // 2 + s] = scales
        return
    eb = ELEMENT_BYTES[side.dtype]
    d, b = _grid(hs, eb)
    # attention rows are [K | V]: element d of V sits head_size elements after element d of K
    kv_shift = kv[..., None, None] * hs if side.kind == "attention" else 0
    buf[row[..., None, None] + (kv_shift + d) * eb + b] = values["kv"][(*(x[..., None, None] for x in idx), d, b)]


def fill_remote(side: Side, values: dict[str, Bytes], buf: Bytes) -> None:
    """A remote rank's memory: every block holds its own logical tokens."""
    blocks = np.arange(side.blocks, dtype=np.int64)
    j, t = np.meshgrid(blocks, np.arange(side.tokens), indexing="ij")
    place(side, values, buf, blocks, j, t)


def expected_after_pull(local: Side, local_buf: Bytes, values: dict[str, Bytes], local_blocks: IntArray,
                        remote_blocks: IntArray, remote_tokens: int) -> Bytes:  # fmt: skip
    """The local memory after the request was pulled: token k of the request (k-th token of the
    local block list) comes from token k of the remote block list; every other byte is unchanged."""
    out = local_buf.copy()
    k = np.arange(len(local_blocks))[:, None] * local.tokens + np.arange(local.tokens)[None, :]
    place(local, values, out, np.asarray(local_blocks, np.int64), np.asarray(remote_blocks)[k // remote_tokens],
          k % remote_tokens)  # fmt: skip
    return out


def apply_descriptors(dst: Bytes, src: Bytes, local: npt.NDArray[np.uint64], remote: npt.NDArray[np.uint64]) -> None:
    """Execute READ descriptors (address, length, device) with plain numpy copies."""
    for (la, ln, _), (ra, rn, _) in zip(local.tolist(), remote.tolist(), strict=True):
        assert ln == rn
        dst[la : la + ln] = src[ra : ra + rn]

"""A naive byte-level model of the standardized KV-cache layouts, written from DESIGN.md alone.

Nothing here imports or mirrors kvxfer: every byte's address is worked out from first principles.

Logical contents. For every layer, block and token of the *remote* block numbering the model holds
one *record* of bytes, in an order of this module's own choosing (it says what a byte *is*, not
where it lives):

* attention: for every global head its K (``head_size`` elements), then for every global head its
  V (``head_size_v`` elements);
* quantized fp8/int8 and kv_planes: K of every global head, then V of every global head;
* quantized nvfp4: for K then V, for every global head, the 4-bit data bytes (two codes a byte,
  ``head_size / 2`` bytes) then the fp8 scale bytes (one per 16 elements);
* mla: the latent vector of the token; mamba: the page of the block (one per TP rank: an opaque
  Mamba page is not replicated, so every rank holds a record of its own). A Mamba state split in
  TP *segments* is one global record: segment after segment, each ``local size x tp_size`` bytes,
  rank ``r`` holding bytes ``[r * local size, (r + 1) * local size)`` of each, its page being its
  slices of the segments one after the other; a *replicated* Mamba state is one record that every
  rank's page holds whole.

Physical placement. A rank's cache is the 5-D array ``[L, B, H, N, C]`` (layers, kernel blocks,
slots, tokens per kernel block, content bytes of one (slot, token) cell), laid out row-major in
the axis order its stride order names (``LBHNC`` ... ``BHLNC``): a stride order starting with
``L`` is one region per layer, one starting with ``B`` one region for all layers. Manager block
``b`` of ``block_size`` tokens is kernel blocks ``b * r .. b * r + r - 1`` (``r = block_size /
kernel_block_size``); its token ``t`` is token ``t % kernel_block_size`` of kernel block ``b * r +
t // kernel_block_size``. A padded page (``page_stride``) replaces the extent of the innermost
``H, N, C`` axes (one page) by ``page_stride`` bytes, the bytes after the page's data being padding.
In a stride order starting with ``B`` a block may be followed by slack (``block_bytes``: bytes from
one block to the next, as when cache groups of different sizes share vLLM's allocation); the region
then ends with the last block's data.

What a slot and a cell hold (``g`` = global head, ``h`` = the rank's local head):

* attention: slot ``h``; cell = K of the head then V of the head;
* quantized fp8/int8: slot ``h`` holds K of the head, slot ``heads + h`` its V; cell = the vector;
* kv_planes: slot 0 is the K plane, slot 1 the V plane; cell = that vector of every head of the
  rank, head after head;
* mla: one slot, cell = the latent; mamba: one slot, one token, cell = the page;
* nvfp4 (the HND and NHD orders with L and B outside the page: FlashInfer's ``_nvfp4_kv_views``): a
  kernel page is the K side (the first ``H * N * full`` bytes, ``full = head_size/2 + head_size/16``)
  then the V side; inside a side every row's data, then every row's scales, the rows in the page's
  own order: with HND row (h, t) is row ``i = h * N + t``, with NHD ``i = t * H + h``; its data is at
  ``i * data`` and its scales at ``H * N * data + i * scale``.

Transfers. A decode (local) rank pulls a request: token ``k`` of the local block list (in local
block size) takes the record bytes of its own heads from token ``k`` of the remote block list (in
remote block size); attention/quantized/kv_planes heads come from whichever remote rank holds them
(split evenly, or replicated when TP > heads); MLA is replicated; an opaque Mamba page reads the
same rank, a Mamba state split in segments each byte from the one remote rank holding it, a
replicated one from any rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

GUARD = 64  # bytes around every region, so that an overrun lands in noise and is caught

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
NVFP4_GROUP = 16  # elements per fp8 scale
NVFP4_ORDERS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")  # a page is whole inside a block (FlashInfer needs it dense)

# vLLM's physical orders over the logical [L, B, H, N, C] (vllm/v1/kv_cache_layout.py)
STRIDE_ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
PADDABLE_ORDERS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")  # a page (H, N, C) is innermost

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
class Elements:
    """The bytes of one (layer, manager block, token) of a rank, as flat arrays over its bytes.

    Byte ``e`` sits at ``origin(layer, kernel block) + offset[e] + kernel_token * per_token[e]``, where
    the origin is the address of element [layer, kernel block, 0, 0, 0], and is record byte
    ``record[e]`` of global head ``head[e]`` (0 for mla and mamba), in cell slot ``slot[e]``.
    """

    offset: IntArray
    per_token: IntArray
    record: IntArray
    head: IntArray
    slot: IntArray  # the slot (H index) of the cell holding the byte


@dataclass(frozen=True)
class Side:
    """One rank's cache as the model sees it: plain numbers only."""

    kind: str  # attention | quantized | kv_planes | mla | mamba
    dtype: str
    layers: int
    blocks: int  # manager blocks
    block_size: int  # tokens per manager block (1 for mamba)
    heads: int  # KV heads on this rank (1 for mla and mamba)
    head_start: int  # global index of the first of them
    total_heads: int  # KV heads of the model (1 for mla and mamba)
    head_size: int  # elements of a K vector; mla: latent dim; mamba: page bytes
    head_size_v: int  # elements of a V vector (attention may differ from head_size)
    stride_order: str  # one of STRIDE_ORDERS
    page_stride: int = 0  # bytes from one page to the next; 0: no padding
    kernel_block_size: int = 0  # tokens per kernel block; 0: block_size (no splitting)
    block_bytes: int = 0  # B-first orders: bytes from one block to the next; 0: no slack
    rank: int = 0
    segments: tuple[int, ...] = ()  # mamba: this rank's byte size of each TP segment, in page order
    tp_size: int = 1  # mamba with segments: how many ranks split each segment
    replicated: bool = False  # mamba: every rank holds the whole state

    def __post_init__(self) -> None:
        assert self.stride_order in STRIDE_ORDERS, self.stride_order
        if self.segments:
            assert self.kind == "mamba"
            assert not self.replicated
            assert sum(self.segments) == self.head_size
        assert self.block_size % self.kernel_tokens == 0
        if self.page_stride:
            assert self.stride_order in PADDABLE_ORDERS
            assert self.kernel_tokens == self.block_size
            assert self.page_stride >= self.page_bytes
        if self.block_bytes:
            assert self.stride_order[0] == "B"
            assert self.kernel_tokens == self.block_size
        if self.dtype == "nvfp4":
            assert self.kind == "quantized"
            assert self.stride_order in NVFP4_ORDERS
            assert self.head_size % NVFP4_GROUP == 0

    # ------------------------------------------------------------------ sizes
    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def nvfp4_data(self) -> int:
        return self.head_size // 2

    @property
    def nvfp4_scale(self) -> int:
        return self.head_size // NVFP4_GROUP

    @property
    def slots(self) -> int:
        """``H`` of [L, B, H, N, C]."""
        return {"attention": self.heads, "quantized": 2 * self.heads, "kv_planes": 2}.get(self.kind, 1)

    @property
    def cell(self) -> int:
        """``C`` of [L, B, H, N, C] in bytes: one (slot, token) cell."""
        if self.kind == "mamba":
            return self.head_size
        if self.dtype == "nvfp4":
            return self.nvfp4_data + self.nvfp4_scale
        eb = self.element_bytes
        if self.kind == "attention":
            return (self.head_size + self.head_size_v) * eb
        if self.kind == "kv_planes":
            return self.heads * self.head_size * eb
        return self.head_size * eb  # quantized fp8/int8, mla

    @property
    def kernel_tokens(self) -> int:
        return self.kernel_block_size or self.block_size

    @property
    def kernel_per_block(self) -> int:
        return self.block_size // self.kernel_tokens

    @property
    def page_bytes(self) -> int:
        """Data bytes of one manager block of one layer (what moves for a whole block)."""
        return self.block_size * self.slots * self.cell

    @property
    def record_bytes(self) -> int:
        th = self.total_heads
        if self.kind == "mamba":
            return self.head_size * (self.tp_size if self.segments else 1)
        if self.dtype == "nvfp4":
            return 2 * th * self.cell
        eb = self.element_bytes
        if self.kind == "attention":
            return th * (self.head_size + self.head_size_v) * eb
        if self.kind in ("quantized", "kv_planes"):
            return 2 * th * self.head_size * eb
        return self.head_size * eb  # mla

    @property
    def cross(self) -> bool:
        return self.stride_order[0] == "B"

    @property
    def regions(self) -> int:
        return 1 if self.cross else self.layers

    @cached_property
    def _layout(self) -> tuple[dict[str, int], int]:
        """Byte strides of the axes L, B (kernel block), H, N, C, and the bytes of one region."""
        sizes = {
            "L": self.layers,
            "B": self.blocks * self.kernel_per_block,
            "H": self.slots,
            "N": self.kernel_tokens,
            "C": self.cell,
        }
        strides: dict[str, int] = {}
        extent, inner = 1, ""
        for axis in reversed(self.stride_order):
            strides[axis] = extent
            if axis == "B" and self.block_bytes:  # the outermost axis: the last block has no slack after it
                assert self.block_bytes >= extent
                strides[axis] = self.block_bytes
                extent += (sizes[axis] - 1) * self.block_bytes
            else:
                extent *= sizes[axis]
            inner += axis
            if self.page_stride and sorted(inner) == ["C", "H", "N"]:
                extent = self.page_stride  # the page is followed by its padding
        if self.cross:
            return strides, extent
        region = strides["L"]
        strides["L"] = 0  # each layer has a region of its own
        return strides, region

    @property
    def strides(self) -> dict[str, int]:
        return self._layout[0]

    @property
    def region_bytes(self) -> int:
        return self._layout[1]

    def bases(self) -> list[int]:
        return [GUARD + i * (self.region_bytes + GUARD) for i in range(self.regions)]

    def buffer_bytes(self) -> int:
        return GUARD + self.regions * (self.region_bytes + GUARD)

    # ------------------------------------------------------------------ addresses
    @cached_property
    def elements(self) -> Elements:
        """Every byte of one (layer, block, token) of this rank: where it is and what it holds."""
        s, th = self.strides, self.total_heads
        eb = 1 if self.kind == "mamba" or self.dtype == "nvfp4" else self.element_bytes
        offs: list[IntArray] = []
        per_tok: list[IntArray] = []
        recs: list[IntArray] = []
        heads: list[IntArray] = []
        slots: list[IntArray] = []

        def add(offset: IntArray, per_token: int | IntArray, record: IntArray, head: int, slot: int) -> None:
            offs.append(np.asarray(offset, np.int64).ravel())
            per_tok.append(np.broadcast_to(np.asarray(per_token, np.int64), offs[-1].shape).ravel())
            recs.append(np.asarray(record, np.int64).ravel())
            heads.append(np.full(offs[-1].size, head, np.int64))
            slots.append(np.full(offs[-1].size, slot, np.int64))

        hs, hsv = self.head_size, self.head_size_v
        if self.kind == "mamba" and self.segments:
            start = 0  # the segment's first record byte
            page = 0  # its first byte in this rank's page
            for size in self.segments:
                b = np.arange(size)
                add((page + b) * s["C"], s["N"], start + self.rank * size + b, 0, 0)
                start, page = start + size * self.tp_size, page + size
        elif self.kind in ("mla", "mamba"):
            b = np.arange(self.cell)
            add(b * s["C"], s["N"], b, 0, 0)
        elif self.dtype == "nvfp4":
            # _nvfp4_kv_views + nvfp4_split_data_scale: per side, every row's data, then every row's
            # scales; rows head-major (HND) or token-major (NHD), as the page orders its cells.
            n, data, scale, full = self.kernel_tokens, self.nvfp4_data, self.nvfp4_scale, self.cell
            nhd = "NH" in self.stride_order
            for kv in range(2):
                side = kv * self.heads * n * full
                for h in range(self.heads):
                    g = self.head_start + h
                    first = (kv * th + g) * full  # the row's first record byte
                    row = kv * self.heads + h
                    # row index of (h, token 0), and how far the next token's row is
                    r0, step = (h, self.heads) if nhd else (h * n, 1)
                    i = np.arange(data)
                    add(side + r0 * data + i, step * data, first + i, g, row)
                    j = np.arange(scale)
                    add(side + self.heads * n * data + r0 * scale + j, step * scale, first + data + j, g, row)
        else:
            for kv in range(2):
                size = hs if kv == 0 or self.kind != "attention" else hsv
                for h in range(self.heads):
                    g = self.head_start + h
                    b = np.arange(size * eb)  # element b // eb, byte b % eb
                    slot: int
                    in_cell: IntArray
                    rec: IntArray
                    if self.kind == "attention":
                        slot, in_cell = h, kv * hs * eb + b
                        rec = (g * hs * eb if kv == 0 else th * hs * eb + g * hsv * eb) + b
                    elif self.kind == "quantized":
                        slot, in_cell, rec = kv * self.heads + h, b, (kv * th + g) * hs * eb + b
                    else:  # kv_planes
                        slot, in_cell, rec = kv, h * hs * eb + b, (kv * th + g) * hs * eb + b
                    add(slot * s["H"] + in_cell * s["C"], s["N"], rec, g, slot)
        return Elements(*(np.concatenate(a) for a in (offs, per_tok, recs, heads, slots)))

    def addresses(self, layer: IntArray, block: IntArray, token: IntArray) -> IntArray:
        """Addresses of every byte of (layer, manager block, token): shape broadcast(...) + (bytes,)."""
        s, el = self.strides, self.elements
        kblock = block * self.kernel_per_block + token // self.kernel_tokens
        ktok = token % self.kernel_tokens
        bases = np.asarray(self.bases(), dtype=np.int64)
        page = bases[0 if self.cross else layer] + layer * s["L"] + kblock * s["B"]
        return page[..., None] + el.offset + ktok[..., None] * el.per_token

    def all_addresses(self) -> IntArray:
        """Every data byte of the rank (every layer, block and token), flat."""
        layer, block, token = _grid(self.layers, self.blocks, self.block_size)
        return self.addresses(layer, block, token).ravel()


def _grid(*sizes: int) -> list[IntArray]:
    """Index arrays of an n-dim grid, each shaped to broadcast along its own axis."""
    out = []
    for axis, n in enumerate(sizes):
        shape = [1] * len(sizes)
        shape[axis] = n
        out.append(np.arange(n, dtype=np.int64).reshape(shape))
    return out


def check_side(side: Side) -> None:
    """The model's own sanity: every data byte has one address inside a region, padding aside."""
    addr = side.all_addresses()
    assert addr.size == side.layers * side.blocks * side.page_bytes
    assert np.unique(addr).size == addr.size, "two logical bytes share an address"
    region = (addr - GUARD) // (side.region_bytes + GUARD)
    inside = (addr - GUARD) % (side.region_bytes + GUARD)
    assert (region >= 0).all()
    assert (region < side.regions).all()
    assert (inside < side.region_bytes).all()
    if not side.page_stride and not side.block_bytes:  # without padding the data fills the regions exactly
        assert addr.size == side.regions * side.region_bytes


def _own_state(side: Side) -> bool:
    """An opaque Mamba page: every rank holds a state of its own."""
    return side.kind == "mamba" and not side.segments and not side.replicated


def logical_values(rng: np.random.Generator, remote: Side, remote_tp: int) -> Bytes:
    """Random records of the remote cache: shape (variants, L, B, N, record bytes), where variants is
    the remote TP size for Mamba (each rank its own state) and 1 otherwise."""
    variants = remote_tp if _own_state(remote) else 1
    shape = (variants, remote.layers, remote.blocks, remote.block_size, remote.record_bytes)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def place(side: Side, values: Bytes, buf: Bytes, blocks: IntArray, src_block: IntArray, src_token: IntArray) -> None:
    """Write records into ``buf``: token t of block ``blocks[j]`` on this side gets the bytes (of the
    heads this side holds) of record (``src_block[j, t]``, ``src_token[j, t]``), in every layer."""
    layer, j, t = _grid(side.layers, len(blocks), side.block_size)
    addr = side.addresses(layer, np.asarray(blocks, np.int64)[j], t)
    variant = side.rank if _own_state(side) else 0
    rec = side.elements.record
    buf[addr] = values[variant, layer[..., None], src_block[j, t][..., None], src_token[j, t][..., None], rec]


def fill_remote(side: Side, values: Bytes, buf: Bytes) -> None:
    """A remote rank's memory: every block holds its own logical tokens."""
    blocks = np.arange(side.blocks, dtype=np.int64)
    j, t = np.meshgrid(blocks, np.arange(side.block_size), indexing="ij")
    place(side, values, buf, blocks, j, t)


def _request_tokens(local: Side, local_blocks: IntArray, remote_blocks: IntArray, remote_tokens: int) -> tuple[
    IntArray, IntArray
]:  # fmt: skip
    k = np.arange(len(local_blocks))[:, None] * local.block_size + np.arange(local.block_size)[None, :]
    return np.asarray(remote_blocks, np.int64)[k // remote_tokens], k % remote_tokens


def expected_after_pull(local: Side, local_buf: Bytes, values: Bytes, local_blocks: IntArray,
                        remote_blocks: IntArray, remote_tokens: int) -> Bytes:  # fmt: skip
    """The local memory after the request was pulled: token k of the request (k-th token of the
    local block list) comes from token k of the remote block list; every other byte is unchanged."""
    out = local_buf.copy()
    src_block, src_token = _request_tokens(local, local_blocks, remote_blocks, remote_tokens)
    place(local, values, out, np.asarray(local_blocks, np.int64), src_block, src_token)
    return out


@dataclass(frozen=True)
class ByteMap:
    """Where every moved byte lands (local address) and where it is read (remote rank and address)."""

    local: IntArray
    remote_rank: IntArray
    remote: IntArray
    row: IntArray  # (layer, request token, local slot) of the byte: a row of the naive scheme

    def naive_descriptors(self) -> int:
        """One descriptor per contiguous piece of a row: what copying row by row would issue."""
        order = np.lexsort((self.local, self.row))
        lo, ro, rank, row = self.local[order], self.remote[order], self.remote_rank[order], self.row[order]
        brk = (row[1:] != row[:-1]) | (lo[1:] != lo[:-1] + 1) | (ro[1:] != ro[:-1] + 1) | (rank[1:] != rank[:-1])
        return int(brk.sum()) + 1

    def fewest_descriptors(self) -> int:
        """The fewest descriptors that can move these bytes: maximal runs contiguous on both sides."""
        order = np.argsort(self.local, kind="stable")
        lo, ro, rank = self.local[order], self.remote[order], self.remote_rank[order]
        brk = (lo[1:] != lo[:-1] + 1) | (ro[1:] != ro[:-1] + 1) | (rank[1:] != rank[:-1])
        return int(brk.sum()) + 1


def byte_map(local: Side, remotes: list[Side], local_blocks: IntArray, remote_blocks: IntArray) -> ByteMap:
    """The byte-level mapping of a pull (reading each head from the first remote rank holding it;
    every replica has the same addresses). Regions of a rank are apart by GUARD bytes, so runs never
    cross them."""
    remote = remotes[0]
    layer, j, t = _grid(local.layers, len(local_blocks), local.block_size)
    lb = np.asarray(local_blocks, np.int64)
    src_block, src_token = _request_tokens(local, lb, remote_blocks, remote.block_size)
    laddr = local.addresses(layer, lb[j], t)  # (L, J, T, E)
    el = local.elements
    shape = laddr.shape
    if _own_state(local):
        ranks = np.full(el.head.size, local.rank)
    elif local.kind == "mamba" and local.segments:
        holder = np.full(local.record_bytes, -1, np.int64)  # the one remote rank holding each record byte
        for q, side in enumerate(remotes):
            holder[side.elements.record] = q
        ranks = holder[el.record]
    elif local.kind in ("mla", "mamba"):
        ranks = np.zeros(el.head.size, np.int64)
    else:
        first = {}
        for q in reversed(range(len(remotes))):
            h0, h1 = remotes[q].head_start, remotes[q].head_start + remotes[q].heads
            first.update(dict.fromkeys(range(h0, h1), q))
        ranks = np.array([first[int(g)] for g in el.head], np.int64)
    raddr = np.empty(shape, np.int64)
    for q in np.unique(ranks).tolist():
        side = remotes[q]
        index = np.full(side.record_bytes, -1, np.int64)
        index[side.elements.record] = np.arange(side.elements.record.size)
        mine = ranks == q
        sel = index[el.record[mine]]
        assert (sel >= 0).all(), "remote rank does not hold the record bytes it was picked for"
        full = side.addresses(layer, src_block[j, t], src_token[j, t])  # (L, J, T, remote E)
        raddr[..., mine] = full[..., sel]
    tok = j * local.block_size + t  # request token
    row = (layer * (len(lb) * local.block_size) + tok)[..., None] * local.slots + el.slot
    return ByteMap(
        laddr.ravel(),
        np.broadcast_to(ranks, shape).ravel(),
        raddr.ravel(),
        np.broadcast_to(row, shape).ravel(),
    )


def apply_descriptors(dst: Bytes, src: Bytes, local: npt.NDArray[np.uint64], remote: npt.NDArray[np.uint64]) -> None:
    """Execute READ descriptors (address, length, device) with plain numpy copies."""
    for (la, ln, _), (ra, rn, _) in zip(local.tolist(), remote.tolist(), strict=True):
        assert ln == rn
        dst[la : la + ln] = src[ra : ra + rn]

"""Shared-memory segments: the worker's :class:`SharedKVBuffer` and the mapping both sides use."""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvxfer.errors import LayoutError
from kvxfer.layout import KVCacheLayout, Plane
from kvxfer.memory.refs import MemoryRegistrationError, SharedMemoryRef, ShmRegionRef, shm_path

__all__ = ["ALIGNMENT", "Segment", "SharedKVBuffer", "align"]

ALIGNMENT = 4096  # regions start on page boundaries so RDMA registration covers whole pages
U8 = npt.NDArray[np.uint8]


# ---------------------------------------------------------------------------- segments
class Segment:
    """One mapped segment file (opened by path, or a descriptor that is duplicated first)."""

    def __init__(self, path: Path, size: int | None, *, create: bool, fd: int | None = None) -> None:
        self.path = path
        if fd is not None:
            fd = os.dup(fd)
        else:
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
            fd = os.open(path, flags, 0o600)
        try:
            if create:
                assert size is not None
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            if self.size == 0:
                raise MemoryRegistrationError(f"shm segment {str(path)!r} is empty", field="shm.name")
            # MAP_POPULATE maps every page now: otherwise the first transfer into each page pays a
            # page fault inside the data plane (measured: early pulls ran at half speed).
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, self.size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array: U8 | None = np.frombuffer(self.mm, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)

    def close(self) -> None:
        self.array = None
        # BufferError: views handed out are still alive; the mapping goes when the last one does.
        with contextlib.suppress(BufferError):
            self.mm.close()


class SharedKVBuffer:
    """Worker side: one shared-memory segment holding every region of ``layout``, page-aligned.

    ``regions[i]`` is region i as a flat uint8 array; :meth:`pages` gives a (num_blocks, page_bytes)
    view of one layer. The creator unlinks the segment on :meth:`close` (and at interpreter exit).
    """

    def __init__(
        self, layout: KVCacheLayout, segment: Segment, offsets: Sequence[int], *, owner: bool, name: str = ""
    ) -> None:
        self.layout = layout
        self.name = name
        self._segment = segment
        self.offsets = tuple(int(o) for o in offsets)
        self.owner = owner
        arr = segment.array
        assert arr is not None
        self.regions: list[U8] = [arr[o : o + layout.region_bytes] for o in self.offsets]

    @classmethod
    def create(cls, layout: KVCacheLayout, name: str | None = None, *, fill: int | None = 0) -> SharedKVBuffer:
        """A new segment sized for ``layout`` (name: random ``kvxfer-...`` under /dev/shm)."""
        name = name or f"kvxfer-{os.getpid()}-{secrets.token_hex(6)}"
        stride = align(layout.region_bytes)
        offsets = [i * stride for i in range(layout.num_regions)]
        path = shm_path(name)
        try:
            seg = Segment(path, stride * layout.num_regions, create=True)
        except FileExistsError:
            raise MemoryRegistrationError(f"shm name: segment {str(path)!r} already exists", field="shm.name") from None
        except OSError as exc:
            raise MemoryRegistrationError(f"shm name: cannot create {str(path)!r}: {exc}", field="shm.name") from None
        buf = cls(layout, seg, offsets, owner=True, name=name)
        atexit.register(buf._unlink_quietly)
        if fill:
            seg.array[:] = fill  # type: ignore[index]
        return buf

    @property
    def path(self) -> Path:
        """The segment's file."""
        return self._segment.path

    @property
    def addresses(self) -> list[int]:
        """Base address of each region in this process."""
        return [self._segment.address + o for o in self.offsets]

    def ref(self) -> SharedMemoryRef:
        """What the sidecar needs to attach these regions."""
        return SharedMemoryRef(tuple(ShmRegionRef(self.name, o) for o in self.offsets))

    def pages(self, layer: int) -> U8:
        """(num_blocks, page_bytes) view of one layer's pages (strided for a cross-layer cache).

        Only for layouts whose pages are contiguous (not heads_outer); :meth:`rows` works for all.
        """
        lay = self.layout
        if lay.heads_outer:
            raise LayoutError(f"pages: a {lay.stride_order} block is not one contiguous page; use rows()",
                              field="layout")  # fmt: skip
        region = self.regions[lay.region_of_layer(layer)]
        start = lay.layer_offset(layer)
        return np.lib.stride_tricks.as_strided(
            region[start:], shape=(lay.num_blocks, lay.page_bytes), strides=(lay.block_stride, 1), writeable=True
        )

    def rows(self, layer: int, plane: Plane) -> U8:
        """``plane``'s rows of ``layer``: a (blocks, kernel blocks, heads, tokens, elements, row bytes) view."""
        lay = self.layout
        offset, shape, strides = lay.plane_view(layer, plane)
        region = self.regions[lay.region_of_layer(layer)]
        return np.lib.stride_tricks.as_strided(region[offset:], shape=shape, strides=strides, writeable=True)

    def unlink(self) -> None:
        """Remove the segment's name now; the pages live on while any process maps them.

        Call it once the sidecar has mapped the segment (after ``RegisterCaches``): from then on
        nothing is left in /dev/shm however either process ends.
        """
        if self.owner:
            self._unlink_quietly()

    def close(self) -> None:
        """Unmap, and unlink the segment when this process created it."""
        self.regions = []
        self._segment.close()
        if self.owner:
            self._unlink_quietly()

    def _unlink_quietly(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._segment.path)

    def __enter__(self) -> SharedKVBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT

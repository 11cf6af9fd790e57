"""Error types shared by every layer of kvxfer.

Each error carries the gRPC status name it maps to (as a plain string, so this module stays free of
gRPC) and the name of the field or setting that was wrong, so that a server can answer with the
right status code and a message that names the offending input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar


class KvxferError(Exception):
    """Base class of every error kvxfer raises on purpose."""

    status: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class LayoutError(KvxferError, ValueError):
    """A cache description (shape, strides, dtype, numbers) is not a standardized layout."""

    status = "INVALID_ARGUMENT"


class IncompatibleLayoutError(KvxferError):
    """Two layouts cannot exchange blocks; `differences` lists every reason."""

    status = "FAILED_PRECONDITION"

    def __init__(self, differences: Sequence[str], *, field: str | None = "layout") -> None:
        self.differences = tuple(differences)
        super().__init__("incompatible KV-cache layouts: " + "; ".join(self.differences), field=field)


class TopologyError(KvxferError, ValueError):
    """A transfer cannot be planned (ranks, parallelism, unsupported combination)."""

    status = "INVALID_ARGUMENT"


class BlockIdError(TopologyError):
    """Block id lists are empty, out of range, duplicated or of mismatched length."""

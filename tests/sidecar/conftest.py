"""Fixtures for the sidecar tests: real sidecars (grpc.aio + NIXL) on loopback, in this process.

NIXL's UCX build loads ``libuct_ib_efa``, which drags the system libibverbs and a second copy of
libnl into the process; the two copies crash in their exit-time destructors, which would turn a
green test run into exit code 139. The EFA module is useless on loopback, so it is excluded here
(before NIXL loads). ``kvxfer serve`` itself exits with ``os._exit`` after a clean drain instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_MODULES", "^efa")

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.sidecar.helpers import Harness


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    """Start sidecars and in-process workers on demand; everything is stopped afterwards."""
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        await h.close()


@pytest.fixture
def token_file(tmp_path: Path) -> Callable[[str], str]:
    """Write a token file and return its path."""

    def make(token: str, name: str = "token") -> str:
        p = tmp_path / name
        p.write_text(token + "\n")
        return str(p)

    return make

"""Fixtures for the sidecar tests: real sidecars (grpc.aio + NIXL) on loopback, in this process.

NIXL's UCX build loads ``libuct_ib_efa``, which drags the system libibverbs and a second copy of
libnl into the process; the two copies crash in their exit-time destructors, which would turn a
green test run into exit code 139. The EFA module is useless on loopback, so it is excluded here
(before NIXL loads). ``kvxfer serve`` itself exits with ``os._exit`` after a clean drain instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_MODULES", "^efa")

import io
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

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


class JsonLogs:
    """What the ``kvxfer`` loggers wrote, one JSON object per line (as ``kvxfer serve`` writes them)."""

    def __init__(self) -> None:
        self.stream = io.StringIO()

    @property
    def text(self) -> str:
        return self.stream.getvalue()

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.text.splitlines() if line.strip()]


@pytest.fixture
def json_logs() -> Iterator[JsonLogs]:
    """Route the kvxfer loggers (every in-process sidecar) to a buffer at debug level, in JSON."""
    from kvxfer.logs import configure_logging

    logs = JsonLogs()
    configure_logging("debug", "json", stream=logs.stream)
    try:
        yield logs
    finally:
        reset_kvxfer_logging()


def reset_kvxfer_logging() -> None:
    """Leave the "kvxfer" logger as pytest found it (propagating, no handler of ours)."""
    logger = logging.getLogger("kvxfer")
    for h in [h for h in logger.handlers if getattr(h, "_kvxfer", False)]:
        logger.removeHandler(h)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)

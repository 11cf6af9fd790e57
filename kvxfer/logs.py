"""Structured logs: one JSON object per line with the request, transfer and peer in context.

The ids travel in :mod:`contextvars`, so every log line written while a request is being served
carries them without passing them down by hand; asyncio copies the context into each task.
Tokens are never logged: nothing here formats request metadata, and a last-line filter masks
anything that looks like a bearer token in case a library message carries one.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
from typing import Any

__all__ = ["JsonFormatter", "adopt_logger", "configure_logging", "current_context", "get_logger", "log_context"]

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvxfer_request_id", default=None)
_transfer_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvxfer_transfer_id", default=None)
_peer: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvxfer_peer", default=None)
_VARS = {"request_id": _request_id, "transfer_id": _transfer_id, "peer": _peer}

_BEARER = re.compile(r"(?i)(bearer\s+)[^\s'\",]+")
_STD_ATTRS = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


def get_logger(name: str) -> logging.Logger:
    """A logger under the ``kvxfer`` hierarchy."""
    return logging.getLogger(name if name.startswith("kvxfer") else f"kvxfer.{name}")


class log_context:  # noqa: N801 - used as a function: ``with log_context(request_id=...):``
    """Set the given ids for the duration of the block (unset ones keep their outer value).

    A class rather than a generator-based context manager: a pull enters several of these, and
    this form costs a fraction of one.
    """

    __slots__ = ("_peer", "_request_id", "_tokens", "_transfer_id")

    def __init__(self, *, request_id: str | None = None, transfer_id: str | None = None,
                 peer: str | None = None) -> None:  # fmt: skip
        self._request_id, self._transfer_id, self._peer = request_id, transfer_id, peer
        self._tokens: list[tuple[contextvars.ContextVar[str | None], contextvars.Token[str | None]]] = []

    def __enter__(self) -> None:
        tokens = self._tokens
        if self._request_id is not None:
            tokens.append((_request_id, _request_id.set(self._request_id)))
        if self._transfer_id is not None:
            tokens.append((_transfer_id, _transfer_id.set(self._transfer_id)))
        if self._peer is not None:
            tokens.append((_peer, _peer.set(self._peer)))

    def __exit__(self, *exc: object) -> None:
        tokens = self._tokens
        while tokens:
            var, tok = tokens.pop()
            var.reset(tok)


def current_context() -> dict[str, str]:
    """The ids set right now."""
    return {k: v for k, var in _VARS.items() if (v := var.get()) is not None}


def redact(text: str) -> str:
    """Mask bearer tokens."""
    return _BEARER.sub(r"\1<redacted>", text)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for k, v in current_context().items():
            if not hasattr(record, k):
                setattr(record, k, v)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, the context ids and any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for k, v in vars(record).items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                out[k] = v if isinstance(v, str | int | float | bool | dict | list | type(None)) else str(v)
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(out, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ctx = " ".join(f"{k}={getattr(record, k)}" for k in _VARS if getattr(record, k, None) is not None)
        base = super().format(record)
        return redact(f"{base} {ctx}" if ctx else base)


_configured: logging.Handler | None = None


def configure_logging(level: str = "info", fmt: str = "json", stream: Any = None) -> None:
    """Route the ``kvxfer`` loggers to ``stream`` (stderr) in JSON or text; idempotent."""
    global _configured
    logger = logging.getLogger("kvxfer")
    for h in list(logger.handlers):
        if getattr(h, "_kvxfer", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._kvxfer = True  # type: ignore[attr-defined]
    handler.addFilter(_ContextFilter())
    handler.setFormatter(
        JsonFormatter() if fmt == "json" else _TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    _configured = handler


def adopt_logger(name: str) -> None:
    """Send a library's Python logger through the handler :func:`configure_logging` set up.

    NIXL configures its ``nixl`` logger with a plain-text handler on *stdout* when it is first
    imported; without this, ``kvxfer serve --log-format json`` would interleave those lines with its
    JSON ones. Call it after the library was imported. Nothing happens before configure_logging.
    """
    if _configured is None:
        return
    logger = logging.getLogger(name)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.addHandler(_configured)
    logger.setLevel(logging.getLogger("kvxfer").level)
    logger.propagate = False

"""The kvxfer sidecar: gRPC control plane (local + peer APIs), leases, pulls, health, metrics.

Entry points: :func:`serve_main` (``kvxfer serve``), :func:`drain_main` (``kvxfer drain``) and
:class:`Sidecar` (in-process, for tests and library mode). Imported lazily so that
``kvxfer.client`` can use the conversion helpers without starting anything heavy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvxfer.server.app import Sidecar, serve_main
    from kvxfer.server.cli import drain_main, parse_serve_args

__all__ = ["Sidecar", "drain_main", "parse_serve_args", "serve_main"]


def __getattr__(name: str) -> Any:
    if name in ("Sidecar", "serve_main"):
        from kvxfer.server import app

        return getattr(app, name)
    if name in ("drain_main", "parse_serve_args"):
        from kvxfer.server import cli

        return getattr(cli, name)
    raise AttributeError(name)

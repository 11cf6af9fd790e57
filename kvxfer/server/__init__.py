"""The kvxfer sidecar: gRPC control plane (local + peer APIs), leases, pulls, health, metrics.

Entry points: :func:`~kvxfer.server.app.serve_main` (``kvxfer serve``),
:func:`~kvxfer.server.cli.drain_main` (``kvxfer drain``) and :class:`~kvxfer.server.app.Sidecar`
(in-process, for tests and library mode). The reading path is in this package's README.md.
"""

from kvxfer.server.app import Sidecar, serve_main
from kvxfer.server.cli import drain_main, parse_serve_args

__all__ = ["Sidecar", "drain_main", "parse_serve_args", "serve_main"]

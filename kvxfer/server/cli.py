"""Command-line pieces of the sidecar that do not need typer: flag parsing and ``kvxfer drain``.

``python -m kvxfer.server [flags]`` runs the sidecar with flags generated from
:class:`kvxfer.config.Settings` (the same names as ``kvxfer serve``); the demo and the tests start
sidecar processes this way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from kvxfer.config import ConfigError, Settings, env_name, flag_name, load_settings

__all__ = ["build_parser", "drain_main", "parse_serve_args"]


def build_parser() -> argparse.ArgumentParser:
    """argparse flags for every setting (each defaults to "not given", so env and file apply)."""
    p = argparse.ArgumentParser(prog="kvxfer serve", description="Run the kvxfer sidecar.")
    for name, f in Settings.model_fields.items():
        p.add_argument(
            flag_name(name), dest=name, default=None, metavar=name.upper(),
            help=f"{f.description} (env {env_name(name)})",
        )  # fmt: skip
    return p


def parse_serve_args(argv: Sequence[str] | None = None) -> Settings:
    """Flags (argv) > env > --config file > defaults, validated."""
    ns = build_parser().parse_args(argv)
    return load_settings(vars(ns))


def drain_main(
    target: str = "/run/kvxfer/kvxfer.sock", *, token_file: str | None = None, timeout_seconds: float = 0.0,
    call_timeout: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``kvxfer drain``: ask the sidecar at ``target`` to drain and wait for it; returns the counts.

    ``target`` is a Unix socket path or ``host:port`` of the local API; ``timeout_seconds`` 0 uses the
    sidecar's ``--drain-seconds``. Raises :class:`kvxfer.client.KvxferRpcError` when the call fails.
    """
    from pathlib import Path

    from kvxfer.client import Client

    token = Path(token_file).read_text().strip() if token_file else None
    wait = call_timeout or (timeout_seconds or 600.0) + 30.0
    with Client(target, token=token, timeout=wait) as c:
        return c.drain(timeout_seconds)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvxfer.server``."""
    from kvxfer.server.app import serve_main

    try:
        settings = parse_serve_args(argv)
    except ConfigError as exc:
        print(json.dumps({"level": "error", "msg": f"invalid setting: {exc}", "setting": exc.field}), file=sys.stderr)
        return 2
    return serve_main(settings)

"""Command-line pieces of the sidecar that do not need typer: flag parsing and ``kvxfer drain``.

``python -m kvxfer.server [flags]`` runs the sidecar with flags generated from
:class:`kvxfer.config.Settings` (the same names as ``kvxfer serve``); the demo and the tests start
sidecar processes this way.
"""

from __future__ import annotations

import argparse
import math
import os
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from kvxfer.addresses import parse_address
from kvxfer.cli_errors import EXIT_USAGE, report
from kvxfer.config import ConfigError, Settings, env_name, flag_name, load_settings

__all__ = ["DrainUsageError", "build_parser", "check_drain_args", "check_target", "drain_main", "parse_serve_args"]

USAGE = "kvxfer serve [--flag VALUE ...]"


def _metavar(name: str, f: FieldInfo) -> str:
    """What a flag's value looks like (its choices, a number, a file, an address)."""
    ann = f.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    inner = args[0] if args and typing.get_origin(ann) is not typing.Literal else ann
    if typing.get_origin(inner) is typing.Literal:  # also an optional one (``Literal[...] | None``)
        return "{" + ",".join(str(a) for a in typing.get_args(inner)) + "}"
    if inner is bool:
        return "{true,false}"
    if inner is Path:
        return "FILE"
    if inner is int:
        return "PORT" if name.endswith("_port") else "N"
    if inner is float:
        return "PER_SECOND" if name.endswith("_rate") else "SECONDS"
    if name.endswith("_listen"):
        return "HOST:PORT"
    if name.endswith("_host"):
        return "HOST"
    if name.endswith("_socket"):
        return "PATH"
    return "LIST" if typing.get_origin(inner) is tuple else "TEXT"


#: Settings whose default is "not given": what the sidecar then does ("none" would read as a value).
_NOT_GIVEN = {
    "advertise_host": "--peer-listen's host, this host's name where that is 0.0.0.0 or ::",
    "metrics_auth": "token with --token-file, else none",
}


def _default(f: FieldInfo, name: str = "") -> str:
    """A setting's default as a user would type it (docs/sidecar-contract.md's table says the same)."""
    if name in _NOT_GIVEN:
        return _NOT_GIVEN[name]
    if f.default_factory is not None:
        return "this host's name"
    value = f.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "empty" if value == "" else str(value)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in kvxfer's one error style instead of printing usage."""

    def error(self, message: str) -> typing.NoReturn:
        report(f"{message} (kvxfer serve --help lists the flags)")
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    """argparse flags for every setting (each defaults to "not given", so env and file apply).

    The help shows each setting's default and environment variable.
    """
    p = _Parser(
        prog="kvxfer serve", usage=USAGE, allow_abbrev=False, exit_on_error=False,
        description="Run the kvxfer sidecar. Flags > KVXFER_* environment > --config file > defaults.",
    )  # fmt: skip
    for name, f in Settings.model_fields.items():
        p.add_argument(
            flag_name(name), dest=name, default=None, metavar=_metavar(name, f),
            help=f"{f.description} (default: {_default(f, name)}; env {env_name(name)})",
        )  # fmt: skip
    return p


def parse_serve_args(argv: Sequence[str] | None = None) -> Settings:
    """Flags (argv) > env > --config file > defaults, validated.

    Raises :class:`ConfigError` naming the flag for an unknown flag, a flag without its value or a bad value.
    """
    parser = build_parser()
    try:
        ns, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        flag = exc.argument_name or "kvxfer serve"
        raise ConfigError(f"{flag}: {exc.message}", field=flag.removeprefix("--").replace("-", "_")) from None
    if extra:
        word = extra[0]
        if word.startswith("-"):
            flag = word.split("=", 1)[0]
            raise ConfigError(f"{flag}: unknown flag (kvxfer serve --help lists the flags)", field=flag)
        raise ConfigError(f"{word}: unexpected argument; kvxfer serve takes --flag value pairs only", field=word)
    return load_settings(vars(ns))


class DrainUsageError(ConfigError):
    """``kvxfer drain`` was given a bad option (``field`` is the option, e.g. ``timeout_seconds``)."""


def check_target(target: str) -> str:
    """``--target`` of ``kvxfer drain`` and ``kvxfer health``, checked: the gRPC target.

    ``target`` is a Unix socket path (absolute, relative or ``unix:...``) or ``host:port``; raises
    :class:`DrainUsageError` (field ``target``) for anything else.
    """
    if not target.strip():
        raise DrainUsageError("--target: must not be empty (a Unix socket path or host:port)", field="target")
    if target.startswith("unix:") or "/" in target or target.endswith(".sock"):
        socket_path = target.removeprefix("unix://").removeprefix("unix:")
        return f"unix://{os.path.abspath(socket_path)}"
    try:
        parse_address(target, setting="--target", dial=True)
    except ConfigError as exc:
        raise DrainUsageError(f"{exc.message}; --target is a Unix socket path or host:port", field="target") from None
    return target


def check_drain_args(target: str, token_file: str | None, timeout_seconds: float) -> tuple[str, str | None]:
    """``kvxfer drain``'s options, checked before anything is sent: (gRPC target, token).

    ``target`` is a Unix socket path (absolute, relative or ``unix:...``) or ``host:port``.
    """
    if not math.isfinite(timeout_seconds) or timeout_seconds < 0:
        raise DrainUsageError(
            f"--timeout-seconds: must be a finite number >= 0 (0: the sidecar's --drain-seconds), "
            f"got {timeout_seconds}",
            field="timeout_seconds",
        )
    grpc_target = check_target(target)
    token = None
    if token_file is not None:
        path = Path(token_file)
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise DrainUsageError(
                f"--token-file: cannot read {token_file!r}: {exc.strerror}", field="token_file"
            ) from None
        if not token:
            raise DrainUsageError(f"--token-file: file {token_file!r} is empty", field="token_file")
    return grpc_target, token


def drain_main(
    target: str = "/run/kvxfer/kvxfer.sock", *, token_file: str | None = None, timeout_seconds: float = 0.0,
    call_timeout: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``kvxfer drain``: ask the sidecar at ``target`` to drain and wait for it; returns the counts.

    ``target`` is a Unix socket path or ``host:port`` of the local API; ``timeout_seconds`` 0 uses the
    sidecar's ``--drain-seconds``. Raises :class:`DrainUsageError` for a bad option (nothing is
    sent) and :class:`kvxfer.client.KvxferRpcError` when the call fails.
    """
    from kvxfer.client import Client

    grpc_target, token = check_drain_args(target, token_file, timeout_seconds)
    wait = call_timeout or (timeout_seconds or 600.0) + 30.0
    with Client(grpc_target, token=token, timeout=wait) as c:
        return c.drain(timeout_seconds)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvxfer.server`` (and ``kvxfer serve``): exit 2 with one error line for a bad setting."""
    from kvxfer.server.app import serve_main

    try:
        settings = parse_serve_args(argv)
    except ConfigError as exc:
        report(exc.message)
        return EXIT_USAGE
    return serve_main(settings)

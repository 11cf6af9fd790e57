"""One error style for every ``kvxfer`` command: ``error: <flag>: <message>``, one line on stderr.

Exit codes: :data:`EXIT_USAGE` (2) when the command cannot run with what it was given (an unknown
flag, a bad value, a setting the sidecar cannot start with), :data:`EXIT_FAILURE` (1) when it ran
and failed (a sidecar that cannot be reached, a demo that moved wrong bytes).

Errors of the core name its fields (``tp_rank``, ``total_kv_heads``); each command maps them to the
flags the user typed with a small table (:func:`describe`), keeping the core's message whole.
This module imports nothing beyond the standard library and :mod:`kvxfer.errors`, so the sidecar's
argparse front end (:mod:`kvxfer.server.cli`) uses it as the typer one does.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO

from kvxfer.errors import KvxferError

__all__ = ["EXIT_FAILURE", "EXIT_USAGE", "describe", "report"]

EXIT_USAGE = 2
EXIT_FAILURE = 1


def describe(exc: KvxferError, flags: Mapping[str, str]) -> str:
    """``<flag>: <message>`` when ``flags`` maps ``exc.field`` to a flag, else the message as it is.

    Core messages start with the field they are about (``tp_rank: 3 is not in [0, 1)``); that
    prefix gives way to the flag (``--decode-rank: 3 is not in [0, 1)``), the rest is kept.
    """
    flag = flags.get(exc.field or "")
    if flag is None:
        return exc.message
    prefix = f"{exc.field}: "
    rest = exc.message[len(prefix) :] if exc.message.startswith(prefix) else exc.message
    return f"{flag}: {rest}"


def report(text: str, file: TextIO | None = None) -> None:
    """Write ``error: <text>`` (to stderr unless ``file`` is given).

    The error is the first line; lines after it (a process's log tail) follow it as they are.
    """
    first, _, rest = text.strip().partition("\n")
    out = file if file is not None else sys.stderr
    print(f"error: {first}", file=out, flush=True)
    if rest:
        print(rest, file=out, flush=True)

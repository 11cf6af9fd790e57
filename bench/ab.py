"""Before/after figures of one benchmark command, run side by side from two checkouts.

Runs ``COMMAND`` (which must print one JSON object on stdout) in checkout A and checkout B,
alternating A, B, A, B, ... for ``--rounds`` rounds so that both see the same machine load, and
prints the median of each selected figure per checkout and the ratio B / A. A figure is a numeric
leaf of the JSON object, named by its dotted path (``pulls.p50_ms``); ``--keys`` picks them with
shell-style patterns (default: every numeric leaf).

    python bench/ab.py --a /tmp/before --b . --rounds 3 --keys 'throughput*' -- \\
        python bench/load.py --pulls 2000 --json

Each checkout runs with its own tree first on ``PYTHONPATH`` and as the working directory, with the
interpreter given by ``--python`` (default: this one), so both use the same installed packages.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted path, value) of every numeric leaf (booleans excluded)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}{k}.")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{prefix}{i}.")
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        yield prefix.rstrip("."), float(obj)


def run_once(tree: Path, command: Sequence[str], python: str, timeout: float) -> dict[str, float]:
    """One run of ``command`` in ``tree``; its JSON's numeric leaves."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(":"))
    argv = [python if c in ("python", "python3") else c for c in command]
    out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(argv)} exited {out.returncode}\n{out.stderr[-4000:]}")
    start = out.stdout.find("{")
    return dict(leaves(json.loads(out.stdout[start:])))


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="checkout A (before)")
    ap.add_argument("--b", type=Path, required=True, help="checkout B (after)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", nargs="*", default=["*"], help="figures to show (shell patterns of dotted paths)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--json", action="store_true", help="print the medians as one JSON object")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the benchmark command (prints one JSON object)")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("command: give the benchmark command after --")
    runs: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for i in range(args.rounds):
        for side in ("a", "b") if i % 2 == 0 else ("b", "a"):
            runs[side].append(run_once(getattr(args, side).resolve(), command, args.python, args.timeout))
            print(f"round {i + 1}/{args.rounds}: {side} done", file=sys.stderr)
    keys = sorted(k for k in set(runs["a"][0]) & set(runs["b"][0]) if any(fnmatch.fnmatchcase(k, p) for p in args.keys))
    table = {}
    for k in keys:
        a = statistics.median(r[k] for r in runs["a"] if k in r)
        b = statistics.median(r[k] for r in runs["b"] if k in r)
        table[k] = {"a": a, "b": b, "b_over_a": (b / a) if a else None}
    if args.json:
        print(json.dumps({"command": command, "rounds": args.rounds, "a": str(args.a), "b": str(args.b),
                          "medians": table}, indent=1))  # fmt: skip
        return 0
    width = max((len(k) for k in keys), default=10)
    print(f"{'figure':<{width}}  {'A (median)':>14}  {'B (median)':>14}  {'B/A':>6}")
    for k, row in table.items():
        ratio = f"{row['b_over_a']:.3f}" if row["b_over_a"] is not None else "-"
        print(f"{k:<{width}}  {row['a']:>14.4g}  {row['b']:>14.4g}  {ratio:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

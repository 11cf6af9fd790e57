"""Lint, format and type checks are part of the test suite, so CI enforces them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_lint() -> None:
    out = _run(str(BIN / "ruff"), "check", "kvxfer", "tests", "bench")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format() -> None:
    out = _run(str(BIN / "ruff"), "format", "--check", "kvxfer", "tests", "bench")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict() -> None:
    out = _run(str(BIN / "mypy"), "kvxfer")
    assert out.returncode == 0, out.stdout + out.stderr

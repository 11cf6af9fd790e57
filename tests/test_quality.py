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


def test_make_demo_installs_only_what_kvxfer_runs_with() -> None:
    # The Go toolchain and sprig sources build the chart's test renderer: `make test` needs them, a demo does not.
    go = ("golang-go", "golang-github-masterminds-sprig-dev", "golang-gopkg-yaml.v3-dev")
    runtime = ("libibverbs1", "librdmacm1", "libnuma1")
    for target in ("demo", "setup"):
        out = _run("make", "-n", target)
        assert out.returncode == 0, out.stdout + out.stderr
        assert all(p in out.stdout for p in runtime), out.stdout
        assert not any(p in out.stdout for p in go), f"make {target} installs {go}:\n{out.stdout}"
    out = _run("make", "-n", "test")
    assert out.returncode == 0, out.stdout + out.stderr
    assert all(p in out.stdout for p in (*runtime, *go)), out.stdout

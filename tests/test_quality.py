"""Lint, format and type checks are part of the test suite, so CI enforces them; so are the docs
that list the code (every RPC in docs/sidecar.md, every module in its package's README)."""

from __future__ import annotations

import re
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


def test_sidecar_doc_lists_every_rpc() -> None:
    """docs/sidecar.md has a table row for every RPC of kvxfer.v1.Local and kvxfer.v1.Peer."""
    from kvxfer.wire import local_pb2, peer_pb2

    text = (ROOT / "docs" / "sidecar.md").read_text()
    for module in (local_pb2, peer_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            start = text.index(f"`{service.full_name}`")
            section = text[start : text.index("\n## ", start)]
            rows = {n for row in re.findall(r"^\| ([^|]+) \|", section, re.M) for n in re.findall(r"`(\w+)`", row)}
            missing = sorted(m.name for m in service.methods if m.name not in rows)
            assert not missing, f"docs/sidecar.md's {service.full_name} table lacks {missing}"


def test_package_readmes_name_every_module() -> None:
    """A package's README.md (its reading path) names each of its modules."""
    readmes = sorted((ROOT / "kvxfer").rglob("README.md"))
    assert readmes
    for readme in readmes:
        text = readme.read_text()
        missing = [
            p.name for p in sorted(readme.parent.glob("*.py")) if not p.name.startswith("__") and p.name not in text
        ]
        assert not missing, f"{readme.relative_to(ROOT)} does not name {missing}"

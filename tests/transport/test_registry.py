"""One registry picks data planes by name; nothing else in kvxfer branches on a backend's name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvxfer.topology import RegionTable
from kvxfer.transport import (
    BackendUnavailableError,
    Notification,
    Registration,
    TransferResult,
    Transport,
    available_transports,
    create_transport,
    register_transport,
    transport_class,
)
from kvxfer.transport import registry as registry_module

PACKAGE = Path(__file__).resolve().parents[2] / "kvxfer"
BACKEND_NAMES = {"nixl", "mooncake"}


def test_builtins_are_imported_on_first_use_only() -> None:
    code = (
        "import sys\n"
        "import kvxfer.transport as t\n"
        "mods = ('nixl', 'mooncake', 'kvxfer.transport.nixl_backend', 'kvxfer.transport.mooncake_backend')\n"
        "print([m for m in mods if m in sys.modules])\n"
        "t.create_transport('mooncake', 'x').close()\n"
        "print([m for m in mods if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.splitlines() == ["[]", "['mooncake', 'kvxfer.transport.mooncake_backend']"]


def test_a_third_party_backend_registers_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))

    @register_transport("loopback-test")
    class Loopback(Transport):
        def register(self, table: RegionTable, mem_type: Any = "DRAM") -> Registration:
            return Registration(table, mem_type, None)

        def deregister(self, registration: Registration) -> None:
            pass

        def metadata(self) -> bytes:
            return self.agent_name.encode()

        def add_peer(self, metadata: bytes) -> str:
            return metadata.decode()

        def remove_peer(self, peer: str) -> None:
            pass

        async def transfer(self, *args: Any, **kwargs: Any) -> TransferResult:
            return TransferResult(0, 0, 0.0)

        def poll_notifications(self) -> list[Notification]:
            return []

        def close(self) -> None:
            pass

    assert available_transports() == ["loopback-test", "mooncake", "nixl", "worker"]
    t = create_transport("loopback-test", "agent-7")
    assert (type(t), t.backend, t.agent_name, t.metadata()) == (Loopback, "loopback-test", "agent-7", b"agent-7")
    assert transport_class("loopback-test") is Loopback


def test_unknown_backend_names_the_known_ones() -> None:
    with pytest.raises(BackendUnavailableError) as err:
        transport_class("rdma-magic")
    assert str(err.value) == "rdma-magic: unknown backend 'rdma-magic'; available: mooncake, nixl, worker"
    assert err.value.status == "FAILED_PRECONDITION"


def _name_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing something with a backend's name (``== "nixl"``, ``in ("nixl", ...)``, ``case "nixl"``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            consts = [n for o in operands for n in ast.walk(o) if isinstance(n, ast.Constant)]
            if any(c.value in BACKEND_NAMES for c in consts):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.MatchValue)
            and isinstance(node.value, ast.Constant)
            and node.value.value in BACKEND_NAMES
        ):
            lines.append(node.lineno)
    return lines


def test_no_code_branches_on_a_backend_name() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if "_proto" not in path.parts and (lines := _name_comparisons(ast.parse(path.read_text())))
    }
    assert offenders == {}
    # the check itself sees a ladder when there is one
    assert _name_comparisons(ast.parse("if backend == 'nixl':\n    pass\nelif b in ('x', 'mooncake'):\n    pass")) == [
        1,
        3,
    ]

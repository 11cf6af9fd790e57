"""The bad-input inventory (bench/bad_inputs.py): every case gets the right status and names the field."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _inventory() -> ModuleType:
    """bench/bad_inputs.py as a module (bench/ is a directory of scripts, not a package)."""
    name = "kvxfer_bad_inputs"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "bad_inputs.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_the_inventory_covers_every_way_in() -> None:
    inv = _inventory()
    cases = inv.all_cases()
    keys = [c.key for c in cases]
    assert len(set(keys)) == len(keys) >= 150
    targets = {(c.surface, c.target) for c in cases}
    local = {"RegisterCaches", "Publish", "Pull", "PullBatch", "Release", "Abort", "Drain", "GetStatus"}
    peer = {"Handshake", "GetPublished", "GetPublishedBatch", "Notify", "NotifyBatch", "Abort"}
    cli = {"kvxfer plan", "kvxfer serve", "kvxfer drain", "kvxfer demo", "kvxfer bench topology",
           "kvxfer bench transport"}  # fmt: skip
    assert {("local", t) for t in local} <= targets
    assert {("peer", t) for t in peer} <= targets
    assert {("cli", t) for t in cli} <= targets
    assert ("chart", "values") in targets
    # Every case says what must answer it and which field the message must name.
    for c in cases:
        assert c.expect, c
        assert c.field, c
        assert c.expect in ("schema", "render") or c.expect.startswith("exit ") or c.expect.isupper(), c


def test_every_bad_input_gets_the_right_status_and_names_the_field() -> None:
    inv = _inventory()
    outcomes = inv.run_inventory()
    assert len(outcomes) >= 150
    wrong = [o for o in outcomes if not o.ok]
    assert not wrong, f"{inv.summary(outcomes)}\n{inv._table(wrong, show_all=True)}"
    assert inv.summary(outcomes) == (
        f"{len(outcomes)} of {len(outcomes)} bad inputs got the right status and a message naming the field"
    )

"""Machine-readable reasons: every failure that crosses a process carries one, and code branches on it.

The reason travels in the status details (``google.rpc.ErrorInfo``, domain ``kvxfer``) of a failed
call, and in the ``reason``/``field`` of one failed item of a batch; the client turns both into
:attr:`KvxferRpcError.reason` and ``.field``. Messages stay for people.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import grpc
import pytest

from kvxfer.client import AsyncClient, KvxferRpcError, PullItem, PullResult
from kvxfer.errors import NotFoundError, Reason
from kvxfer.wire.status import code_of, error_from_status, error_of, status_of
from tests.sidecar.helpers import Harness, attention, expect_error

OK = grpc.StatusCode
LAY = attention()
ROOT = Path(__file__).resolve().parents[2]


async def test_a_failed_call_carries_its_reason_and_field(harness: Harness) -> None:
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    d = await harness.sidecar(role="decode", engine_id="decode")
    dw = await harness.worker(d, {"kv": LAY})
    bare = AsyncClient(p.local_target)
    try:
        err = await expect_error(OK.FAILED_PRECONDITION, bare.publish("r0", {"kv": [1]}), "register")
        assert err.reason is Reason.NOT_REGISTERED
    finally:
        await bare.close()
    pw = await harness.worker(p, {"kv": LAY})
    err = await expect_error(OK.NOT_FOUND, dw.pull("missing", [p], {"kv": [1]}), "missing")
    assert (err.reason, err.field) == (Reason.NOT_PUBLISHED, "request_id")
    # Read as any KvxferError (its status, code_of), the error has the code it came with, not INTERNAL.
    assert (err.status, code_of(err)) == ("NOT_FOUND", OK.NOT_FOUND)
    err = await expect_error(OK.FAILED_PRECONDITION, dw.client.publish("r1", {"kv": [1]}), "role")
    assert err.reason is Reason.WRONG_ROLE
    err = await expect_error(OK.INVALID_ARGUMENT, pw.client.publish("r2", {"kv": [LAY.num_blocks]}), "out of range")
    assert err.reason is Reason.INVALID_FIELD
    assert err.field == "blocks[kv]"
    await pw.prefill("r3", {"kv": [1]}, salt=1)
    err = await expect_error(OK.ALREADY_EXISTS, pw.client.publish("r3", {"kv": [2]}), "r3")
    assert (err.reason, err.field) == (Reason.DUPLICATE, "request_id")


async def test_each_failed_item_of_a_batch_carries_its_reason(harness: Harness) -> None:
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    d = await harness.sidecar(role="decode", engine_id="decode")
    pw = await harness.worker(p, {"kv": LAY})
    dw = await harness.worker(d, {"kv": LAY})
    await pw.prefill("ok", {"kv": [1, 2]}, salt=4)
    results = await dw.client.pull_batch([
        PullItem("ok", [p.peer_address], {"kv": [3, 4]}),
        PullItem("nobody-published-this", [p.peer_address], {"kv": [5]}),
        PullItem("bad-ids", [p.peer_address], {"kv": [LAY.num_blocks + 3]}),
    ])  # fmt: skip
    assert isinstance(results[0], PullResult)
    missing, bad = results[1], results[2]
    assert isinstance(missing, KvxferRpcError)
    assert (missing.code, missing.reason, missing.field) == (OK.NOT_FOUND, Reason.NOT_PUBLISHED, "request_id")
    assert isinstance(bad, KvxferRpcError)
    assert (bad.code, bad.reason) == (OK.INVALID_ARGUMENT, Reason.INVALID_FIELD)
    assert bad.field == "local_blocks[kv]"


async def test_unauthenticated_calls_say_so_in_the_reason(harness: Harness, token_file: object) -> None:
    good = token_file("s3cret-token")  # type: ignore[operator]
    p = await harness.sidecar(role="prefill", engine_id="prefill", token_file=good)
    c = AsyncClient(p.local_target, token="guess")
    try:
        err = await expect_error(OK.UNAUTHENTICATED, c.status(), "not valid")
        assert (err.reason, err.field) == (Reason.UNAUTHENTICATED, "authorization")
    finally:
        await c.close()


async def test_a_refused_handshake_keeps_the_publishers_reason(harness: Harness) -> None:
    """A publisher whose worker has not registered refuses the handshake with NOT_REGISTERED (it may
    come up any moment): the pull says so, not INCOMPATIBLE_PEER (layouts, roles or versions that
    differ, which no wait cures). A real incompatibility still reads INCOMPATIBLE_PEER."""
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    d = await harness.sidecar(role="decode", engine_id="decode")
    dw = await harness.worker(d, {"kv": LAY})
    err = await expect_error(OK.FAILED_PRECONDITION, dw.pull("r1", [p], {"kv": [1]}), "handshake with",
                             "no KV caches registered")  # fmt: skip
    assert (err.reason, err.field) == (Reason.NOT_REGISTERED, "remote_addresses")
    pw = await harness.worker(p, {"kv": attention(head_size=128)})
    await pw.prefill("r2", {"kv": [1]}, salt=1)
    err = await expect_error(OK.FAILED_PRECONDITION, dw.pull("r2", [p], {"kv": [1]}), "head_size")
    assert (err.reason, err.field) == (Reason.INCOMPATIBLE_PEER, "remote_addresses")


async def test_a_worker_that_cannot_reach_its_own_sidecar_is_told_so(harness: Harness) -> None:
    """gRPC's own UNAVAILABLE on a local call (no sidecar at the socket), and a fast-socket call whose
    connection the sidecar closed, read SIDECAR_UNREACHABLE: not PEER_UNREACHABLE, which says a
    remote sidecar cannot be reached (the sidecar's own UNAVAILABLE keeps the reason it sent)."""
    d = await harness.sidecar(role="decode", engine_id="decode")
    dw = await harness.worker(d, {"kv": LAY})
    p = await harness.sidecar(role="prefill", engine_id="prefill")
    await harness.worker(p, {"kv": LAY})
    # A push pull waits for a publish that never comes: the sidecar stops under it.
    pulling = asyncio.ensure_future(dw.pull("never", [p], {"kv": [1]}, push=True, deadline=20.0))
    await asyncio.sleep(0.3)
    assert dw.client.fast_active
    await d.stop(0)
    harness.sidecars.remove(d)
    with pytest.raises(KvxferRpcError) as info:
        await pulling
    assert (info.value.code, info.value.reason) == (OK.UNAVAILABLE, Reason.SIDECAR_UNREACHABLE), info.value
    err = await expect_error(OK.UNAVAILABLE, dw.client.status(deadline=2.0))
    assert err.reason is Reason.SIDECAR_UNREACHABLE
    # A peer that cannot be reached is still PEER_UNREACHABLE.
    q = await harness.sidecar(role="decode", engine_id="decode-2")
    qw = await harness.worker(q, {"kv": LAY})
    err = await expect_error(OK.UNAVAILABLE, qw.pull("r", ["127.0.0.1:1"], {"kv": [1]}, deadline=5.0))
    assert err.reason is Reason.PEER_UNREACHABLE


async def test_a_restarted_publisher_is_rehandshaken_on_its_reason(harness: Harness) -> None:
    """The reader's cached session outlives the publisher: the new one answers NOT_HANDSHAKEN, the
    reader handshakes again and the pull succeeds (restart recovery rides on the reason)."""
    p = await harness.sidecar("pub", role="prefill", engine_id="prefill")
    d = await harness.sidecar(role="decode", engine_id="decode")
    pw = await harness.worker(p, {"kv": LAY})
    dw = await harness.worker(d, {"kv": LAY})
    await pw.prefill("before", {"kv": [1]}, salt=1)
    assert (await dw.pull("before", [p], {"kv": [2]})).done
    address = p.peer_address
    await pw.close()
    harness.workers.remove(pw)
    await p.stop(0)
    harness.sidecars.remove(p)
    again = await harness.sidecar("pub2", role="prefill", engine_id="prefill", peer_listen=address)
    assert again.peer_address == address
    pw2 = await harness.worker(again, {"kv": LAY})
    await pw2.prefill("after", {"kv": [5, 6]}, salt=9)
    assert d.metrics is not None
    before = d.metrics.handshakes.labels(outcome="ok")._value.get()
    res = await dw.pull("after", [address], {"kv": [7, 8]})
    assert res.done
    assert dw.verify({"kv": [7, 8]}, 9) == (2 * LAY.page_bytes * LAY.num_layers, 0)
    assert d.metrics.handshakes.labels(outcome="ok")._value.get() == before + 1


def test_reason_and_field_survive_the_status_details() -> None:
    exc = NotFoundError("request_id: 'x' is not published", field="request_id")
    status = status_of(exc)
    assert status.code is OK.NOT_FOUND
    assert error_from_status(status.code, status.details, status.trailing_metadata) == (
        Reason.NOT_PUBLISHED,
        "request_id",
    )
    # A reason-less failure (an older peer, gRPC itself) reads as what its code implies.
    assert error_from_status(OK.UNIMPLEMENTED, "Method not found!", ()) == (Reason.UNSUPPORTED, None)
    # A reason this build does not know (a newer peer) also falls back to the code's.
    err = error_of(OK.UNAVAILABLE.value[0], "peer went away", "SOMETHING_NEW", "remote_addresses")
    assert (err.status, err.reason, err.field) == ("UNAVAILABLE", Reason.PEER_UNREACHABLE, "remote_addresses")


def _decisions_on_message_text(path: Path, root: Path = ROOT) -> list[str]:
    """``"..." in <x>.message`` / ``in str(exc)`` / ``in <x>.details`` comparisons: behaviour decided by text."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare) or not any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            continue
        for right in node.comparators:
            text = ast.unparse(right)
            if text.endswith((".message", ".details", ".details()")) or text.startswith("str("):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_branches_on_an_error_message() -> None:
    found = [hit for p in sorted((ROOT / "kvxfer").rglob("*.py")) if "_proto" not in p.parts
             for hit in _decisions_on_message_text(p)]  # fmt: skip
    assert found == []


def test_the_text_check_finds_a_decision_on_text(tmp_path: Path) -> None:
    # The check above must be able to fail.
    sample = tmp_path / "sample.py"
    sample.write_text("def f(exc):\n    return 'has not handshaken' in exc.message or 'x' in str(exc)\n")
    assert len(_decisions_on_message_text(sample, tmp_path)) == 2


def _errors_without_a_reason(path: Path, root: Path = ROOT) -> list[str]:
    """``FailedPreconditionError(...)`` raised without ``reason=``: it reads as
    reason INTERNAL ("a bug"), and FAILED_PRECONDITION has no one reason that fits all its causes."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Raise) or not isinstance(node.exc, ast.Call):
            continue
        call = node.exc
        named = isinstance(call.func, ast.Name) and call.func.id == "FailedPreconditionError"
        if named and not any(k.arg == "reason" for k in call.keywords):
            found.append(f"{path.relative_to(root)}:{node.lineno}: FailedPreconditionError(...)")
    return found


def test_every_failed_precondition_says_which_reason() -> None:
    found = [hit for p in sorted((ROOT / "kvxfer").rglob("*.py")) if "_proto" not in p.parts
             for hit in _errors_without_a_reason(p)]  # fmt: skip
    assert found == []


def test_no_error_class_of_a_caller_mistake_defaults_to_a_bug() -> None:
    """Every error class whose status is not INTERNAL has a reason of its own (INTERNAL means a bug)."""
    import importlib
    import pkgutil

    import kvxfer
    from kvxfer.errors import FailedPreconditionError, KvxferError

    for mod in pkgutil.walk_packages(kvxfer.__path__, "kvxfer."):
        if "_proto" in mod.name or mod.name.endswith("__main__") or mod.name.startswith("kvxfer.integrations"):
            continue
        importlib.import_module(mod.name)

    def subclasses(cls: type[KvxferError]) -> list[type[KvxferError]]:
        return [c for s in cls.__subclasses__() for c in (s, *subclasses(s))]

    defaulting = [f"{c.__module__}.{c.__qualname__}" for c in subclasses(KvxferError)
                  if c.status != "INTERNAL" and c.default_reason is Reason.INTERNAL
                  and c is not FailedPreconditionError]  # fmt: skip
    assert defaulting == []

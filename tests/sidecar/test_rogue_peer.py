"""A rogue peer process (its own NIXL agent, an engine id of its choosing) against real sidecars.

It must fail at every step it is not entitled to: no credentials, a certificate for another
engine, a publish bound to another reader. The last test is the control: with no credentials at
all (loopback development mode) the same process does read bytes that were never published,
which is what one-sided RDMA allows once the metadata is out, and why it never is before the peer
authenticated.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvxfer.server.app import Sidecar
from tests.sidecar.helpers import Harness, Worker, attention, expect_error

ROGUE = Path(__file__).with_name("rogue_peer.py")
ROOT = Path(__file__).resolve().parents[2]
SECRET = "cluster-token-5f1d"


async def _rogue(publisher: Sidecar, reader: Sidecar, engine_id: str, steps: list[list[Any]], **creds: str) -> list[
    dict[str, Any]
]:  # fmt: skip
    """Run the rogue process against ``publisher``, looking like ``reader`` but for its engine id."""
    assert reader.core is not None
    plan = {"address": publisher.peer_address, "info": reader.core.identity().to_proto().SerializeToString().hex(),
            "engine_id": engine_id, "steps": steps, **creds}  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROGUE), json.dumps(plan), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, err.decode()[-3000:]
    results: list[dict[str, Any]] = json.loads(out.decode().strip().splitlines()[-1])
    return results


def _codes(results: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(r["op"], r["code"]) for r in results]


def _secret_block(w: Worker, block: int) -> str:
    """Fill ``block`` (never published) with random bytes; their digest."""
    page = w.buffers["kv"].pages(0)[block]
    page[:] = np.random.default_rng(block).integers(0, 256, page.size, dtype=np.uint8)
    return hashlib.sha256(page.tobytes()).hexdigest()


ALL_STEPS: list[list[Any]] = [
    ["handshake", ""], ["get_published", "r1"], ["notify_done", "r1"], ["notify_unread", "r1"], ["abort", "r1"],
    ["read", "", 5],
]  # fmt: skip


def _certs(d: Path, names: dict[str, list[str]]) -> dict[str, tuple[str, str]]:
    """A throwaway CA and, per file stem, a certificate for 127.0.0.1 naming the given engines (openssl CLI)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=kvxfer-test-ca")  # fmt: skip
    out = {}
    for stem, engines in names.items():
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{stem}.key", "-out", f"{stem}.csr", "-subj",
            f"/CN={stem}")  # fmt: skip
        uris = "".join(f",URI:kvxfer://engine/{n}" for n in engines)
        (d / f"{stem}.ext").write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost{uris}\n")
        run("x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            f"{stem}.pem", "-days", "1", "-extfile", f"{stem}.ext")  # fmt: skip
        out[stem] = (str(d / f"{stem}.pem"), str(d / f"{stem}.key"))
    return out


async def test_without_credentials_a_rogue_gets_nothing(harness: Harness, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(SECRET)
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, token_file=str(token))
    await pw[0].prefill("r1", {"kv": [1, 2]}, salt=3)
    _secret_block(pw[0], 5)
    results = await _rogue(ps[0], ds[0], "decode", ALL_STEPS)
    assert _codes(results)[:5] == [(op, "UNAUTHENTICATED") for op, _ in ALL_STEPS[:5]]
    assert "metadata_bytes" not in results[0]
    assert results[5]["read"].startswith("no data-plane metadata")
    assert (await pw[0].client.status())["leases"] == 1
    res = await dw[0].pull("r1", ps, {"kv": [3, 4]})
    assert dw[0].verify({"kv": [3, 4]}, 3) == (res.bytes, 0)


async def test_a_certificate_names_the_only_engine_its_holder_may_be(harness: Harness, tmp_path: Path) -> None:
    certs = await asyncio.to_thread(_certs, tmp_path, {"engines": ["prefill", "decode"], "rogue": ["rogue"]})
    ca = str(tmp_path / "ca.pem")
    lay = attention()
    cert, key = certs["engines"]
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, tls_cert=cert, tls_key=key, tls_ca=ca)
    await pw[0].prefill("r1", {"kv": [1, 2]}, salt=4)
    rogue_cert, rogue_key = certs["rogue"]
    tls = {"cert": rogue_cert, "key": rogue_key, "ca": ca}
    # A certificate for 'rogue' cannot act as 'decode': not in the handshake, not in any later call.
    results = await _rogue(ps[0], ds[0], "decode", ALL_STEPS, **tls)
    assert _codes(results)[:5] == [(op, "PERMISSION_DENIED") for op, _ in ALL_STEPS[:5]]
    assert "engine id 'decode' is not named by the caller's client certificate" in results[0]["details"]
    assert "metadata_bytes" not in results[0]
    assert results[5]["read"].startswith("no data-plane metadata")
    # Without a client certificate the TLS handshake itself fails.
    results = await _rogue(ps[0], ds[0], "decode", ALL_STEPS[:1], ca=ca)
    assert _codes(results) == [("handshake", "UNAVAILABLE")]
    # The real decode engine, whose certificate names it, still reads exactly.
    res = await dw[0].pull("r1", ps, {"kv": [3, 4]})
    assert dw[0].verify({"kv": [3, 4]}, 4) == (res.bytes, 0)


@pytest.mark.parametrize("named", [True, False], ids=["reader-named", "first-reader"])
async def test_a_peer_in_the_cluster_cannot_touch_a_publish_bound_to_another_reader(
    harness: Harness, tmp_path: Path, named: bool
) -> None:
    token = tmp_path / "token"
    token.write_text(SECRET)
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, token_file=str(token), lease_seconds=60)
    await pw[0].client.publish("r1", {"kv": [1, 2]}, reader_engine_id="decode" if named else "")
    pw[0].fill({"kv": [1, 2]}, salt=5)
    if not named:
        # The first reader to fetch it binds it: the decode engine fetches it, and its pull fails on
        # its own bad input (an id that was not published), which leaves the publish as it was.
        bad = dw[0].pull("r1", ps, {"kv": [3]}, remote_blocks={"kv": [9]})
        await expect_error(grpc.StatusCode.INVALID_ARGUMENT, bad, "remote_blocks[kv]: block id 9")
    # The token makes the rogue a member of the cluster: it handshakes (and so holds the metadata,
    # as docs/security.md says), but the publish is not its to fetch, free or abort.
    results = await _rogue(ps[0], ds[0], "rogue", ALL_STEPS[:5], token=SECRET)
    assert _codes(results) == [("handshake", "OK")] + [(op, "PERMISSION_DENIED") for op, _ in ALL_STEPS[1:5]]
    assert results[0]["metadata_bytes"] > 0
    assert "'r1' is bound to reader engine 'decode'; 'rogue' may not fetch it" in results[1]["details"]
    assert (await pw[0].client.status())["leases"] == 1
    res = await dw[0].pull("r1", ps, {"kv": [3, 4]})
    assert dw[0].verify({"kv": [3, 4]}, 5) == (res.bytes, 0)


async def test_control_with_no_credentials_the_metadata_reads_unpublished_bytes(harness: Harness) -> None:
    # Loopback development mode (no token, no TLS): anyone who can connect is trusted. The rogue
    # fetches a publish nobody bound, then READs a block that was never published, and gets its
    # bytes: the residual risk of one-sided RDMA that the credentials above keep out.
    lay = attention()
    ps, pw, ds, _dw = await harness.deployment({"kv": lay}, {"kv": lay})
    await pw[0].prefill("r1", {"kv": [1, 2]}, salt=6)
    digest = _secret_block(pw[0], 5)
    results = await _rogue(ps[0], ds[0], "rogue", [["handshake", ""], ["get_published", "r1"], ["read", "", 5]])
    assert _codes(results) == [("handshake", "OK"), ("get_published", "OK"), ("read", "OK")]
    assert results[2]["sha256"] == digest

"""A rogue peer, run as a process of its own: its own NIXL agent and an engine id of its choosing.

``python tests/sidecar/rogue_peer.py '<json plan>'`` prints one JSON line: for each step, the gRPC
status code it got and what it learned. It does what an attacker on the network would: handshake
(with whatever credentials it was given), then ask for, free and abort publishes, and READ
registered memory it was never offered if it ever got the publisher's data-plane metadata.

Plan keys: ``address`` (the publisher's peer API), ``info`` (hex of a PeerInfo to look like: a
real decode sidecar's), ``engine_id`` (who it claims to be), ``token``, ``cert``/``key``/``ca``
(PEM paths for TLS), ``steps`` (list of ``[op, request_id, ...]``): ``handshake``,
``get_published``, ``notify_done``, ``notify_unread``, ``abort``, ``read`` (block ``n`` of the
first group's first layer, from the regions of the last GetPublished answer).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvxfer.topology import RegionTable
from kvxfer.transport import TransportConfig, create_transport
from kvxfer.wire import peer_pb2, peer_pb2_grpc
from kvxfer.wire.convert import layout_from_proto


async def main(plan: dict[str, Any]) -> list[dict[str, Any]]:
    dp = create_transport("nixl", f"rogue-{uuid.uuid4().hex[:8]}", TransportConfig())
    info = peer_pb2.PeerInfo.FromString(bytes.fromhex(plan["info"]))
    info.engine_id = plan["engine_id"]
    info.instance_id = uuid.uuid4().hex
    info.data_plane.agent_name = dp.agent_name
    info.data_plane.metadata = dp.metadata()
    md = (("authorization", f"Bearer {plan['token']}"),) if plan.get("token") else ()
    if plan.get("ca"):
        pem = {k: Path(plan[k]).read_bytes() if plan.get(k) else None for k in ("ca", "key", "cert")}  # noqa: ASYNC240
        creds = grpc.ssl_channel_credentials(
            root_certificates=pem["ca"], private_key=pem["key"], certificate_chain=pem["cert"]
        )
        channel = grpc.aio.secure_channel(plan["address"], creds)
    else:
        channel = grpc.aio.insecure_channel(plan["address"])
    me = dict(engine_id=info.engine_id, instance_id=info.instance_id)
    results: list[dict[str, Any]] = []
    publisher: peer_pb2.PeerInfo | None = None
    published: peer_pb2.GetPublishedResponse | None = None
    async with channel:
        stub = peer_pb2_grpc.PeerStub(channel)
        for op, rid, *args in plan["steps"]:
            out: dict[str, Any] = {"op": op, "request_id": rid}
            try:
                if op == "handshake":
                    resp = await stub.Handshake(peer_pb2.HandshakeRequest(info=info), timeout=10, metadata=md)
                    publisher = resp.info
                    out["metadata_bytes"] = len(resp.info.data_plane.metadata)
                elif op == "get_published":
                    published = await stub.GetPublished(
                        peer_pb2.GetPublishedRequest(request_id=rid, rank=info.rank, **me), timeout=10, metadata=md
                    )
                    out["block_ids"] = list(published.groups[0].block_ids)
                elif op in ("notify_done", "notify_unread"):
                    outcome = peer_pb2.NotifyRequest.DONE if op == "notify_done" else peer_pb2.NotifyRequest.UNREAD
                    resp_n = await stub.Notify(
                        peer_pb2.NotifyRequest(request_id=rid, rank=info.rank, outcome=outcome, **me),
                        timeout=10, metadata=md,
                    )  # fmt: skip
                    out["released"] = resp_n.released
                elif op == "abort":
                    resp_a = await stub.Abort(peer_pb2.PeerAbortRequest(request_id=rid, **me), timeout=10, metadata=md)
                    out["found"] = resp_a.found
                elif op == "read":
                    out.update(await _read(dp, publisher, published, int(args[0])))
                out["code"] = "OK"
            except grpc.aio.AioRpcError as exc:
                out["code"] = exc.code().name
                out["details"] = exc.details()
            results.append(out)
    dp.close()
    return results


async def _read(
    dp: Any, publisher: peer_pb2.PeerInfo | None, published: peer_pb2.GetPublishedResponse | None, block: int
) -> dict[str, Any]:
    """READ one page of a block nobody offered, with whatever metadata and regions were obtained."""
    if publisher is None or not publisher.data_plane.metadata or published is None:
        return {"read": "no data-plane metadata or regions: nothing to READ with"}
    layout = layout_from_proto(publisher.groups[0].layout, "layout")
    region = published.groups[0].regions[0]
    peer = dp.add_peer(publisher.data_plane.metadata)
    buf = np.zeros(layout.page_bytes, dtype=np.uint8)
    base = buf.ctypes.data
    dp.register(RegionTable(np.array([base]), np.array([buf.nbytes]), np.array([0])))
    local = np.array([[base, layout.page_bytes, 0]], dtype=np.uint64)
    remote = np.array([[region.base + block * layout.block_stride, layout.page_bytes, region.device]], dtype=np.uint64)
    await dp.read(peer, local, remote, timeout=10)
    return {"read": "ok", "sha256": hashlib.sha256(buf.tobytes()).hexdigest()}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))

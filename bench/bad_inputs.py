"""Bad-input inventory: what kvxfer answers to inputs it must refuse, across every way in.

Each case is one distinct bad input and states what the answer must be: the gRPC status code (or
the command's exit code, or which layer of the Helm chart refuses it) and the field that the
message must name, with the bad value where there is one. The surfaces:

* ``local``: the local API (worker -> sidecar) over the Unix socket: RegisterCaches, Publish, Pull,
  PullBatch, Release, Abort, Drain, WatchCompletions, GetStatus;
* ``peer``: the peer API (sidecar -> sidecar): Handshake, GetPublished(Batch), Notify, Abort;
* ``cli``: ``kvxfer plan / serve / drain / demo / bench`` run as processes (exit code 2 and one line
  ``error: <flag>: <message>`` on stderr);
* ``chart``: values of the Helm chart, checked against values.schema.json (as ``helm install``
  does, ``schema``) and rendered by the repository's renderer (tools/helm-render, ``render``).

Real sidecars run on loopback in this process (gRPC + NIXL, as the tests start them): one prefill
and one decode sidecar with registered workers, and one sidecar nobody registered with.

    python bench/bad_inputs.py [--surface local,peer,cli,chart] [--json] [--all]

Prints a table of the cases that went wrong (every case with ``--all``) and the summary line
``N of M bad inputs got the right status and a message naming the field``; exits 1 unless all did.
tests/sidecar/test_bad_inputs.py runs it.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_MODULES", "^efa")  # before NIXL loads (see tests/sidecar/conftest.py)

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf.message import Message

from kvxfer import PROTOCOL_VERSION
from kvxfer.client import AsyncClient
from kvxfer.config import load_settings
from kvxfer.layout import KVCacheLayout
from kvxfer.memory import SharedKVBuffer
from kvxfer.server.app import Sidecar
from kvxfer.topology import RankInfo
from kvxfer.wire import common_pb2, local_pb2, local_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvxfer.wire.convert import layout_to_proto, memory_to_proto, rank_to_proto

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "kvxfer"
SURFACES = ("local", "peer", "cli", "chart")
LAYOUT = KVCacheLayout.attention(num_layers=2, num_blocks=32, block_size=16, num_kv_heads=4, head_size=64)
G = "kv"  # the one cache group
DRAIN_SECONDS = 5.0


# ============================================================================ cases
@dataclass(frozen=True)
class Case:
    """One bad input and the answer it must get.

    ``expect``: a gRPC status code name (``INVALID_ARGUMENT``), ``exit <n>`` for a command, or
    ``schema`` / ``render`` for chart values. ``field`` (and ``value`` when set) must appear in the
    message. ``run`` produces (what was answered, the message).
    """

    surface: str
    target: str
    name: str
    expect: str
    field: str
    value: str | None
    run: Callable[[Env], Awaitable[tuple[str, str]]] = field(repr=False, compare=False)

    @property
    def key(self) -> tuple[str, str, str]:
        """What makes a case distinct."""
        return (self.surface, self.target, self.name)


@dataclass
class Outcome:
    """What one case got."""

    case: Case
    got: str
    message: str
    seconds: float

    @property
    def ok(self) -> bool:
        """The right status, and a message naming the field (and the value, where the case has one)."""
        c = self.case
        return self.got == c.expect and c.field in self.message and (c.value is None or c.value in self.message)


# ---------------------------------------------------------------------------- environment
@dataclass
class Env:
    """The sidecars, workers and files the cases run against."""

    tmp: Path
    prefill: Sidecar
    decode: Sidecar
    fresh: Sidecar  # role both, nobody registered
    buffers: list[SharedKVBuffer]
    clients: list[AsyncClient]
    channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)
    renderer: Path | None = None
    renderer_error: str = ""
    cli: CliDrivers | None = None
    _n: int = 0

    def fresh_id(self, prefix: str) -> str:
        """A request id no case used before."""
        self._n += 1
        return f"{prefix}-{self._n}"

    def channel(self, target: str) -> grpc.aio.Channel:
        """One channel per target, reused by every case."""
        ch = self.channels.get(target)
        if ch is None:
            ch = self.channels[target] = grpc.aio.insecure_channel(target)
        return ch

    def local(self, which: str) -> local_pb2_grpc.LocalStub:
        """A raw stub of a sidecar's local API (no client-side checks in the way)."""
        return local_pb2_grpc.LocalStub(self.channel(self.sidecar(which).local_target))

    def peer(self) -> peer_pb2_grpc.PeerStub:
        """A raw stub of the prefill sidecar's peer API."""
        return peer_pb2_grpc.PeerStub(self.channel(self.prefill.peer_address))

    def sidecar(self, which: str) -> Sidecar:
        """``prefill``, ``decode`` or ``fresh``."""
        sc: Sidecar = getattr(self, which)
        return sc

    async def publish(self, blocks: Sequence[int] = (1, 2)) -> str:
        """Publish a new request on the prefill sidecar; returns its id."""
        rid = self.fresh_id("pub")
        req = local_pb2.PublishRequest(request_id=rid, blocks=[common_pb2.BlockList(group=G, block_ids=list(blocks))])
        await self.local("prefill").Publish(req, timeout=10)
        return rid

    def reader_info(self, **changes: Any) -> peer_pb2.PeerInfo:
        """A reader's handshake (the decode sidecar's own identity, under another instance id)."""
        core = self.decode.core
        assert core is not None
        info = core.identity().to_proto()
        info.instance_id = "inventory-reader"
        for k, v in changes.items():
            setattr(info, k, v)
        return info

    async def handshake(self) -> peer_pb2.PeerInfo:
        """Handshake the inventory's reader with the prefill sidecar; returns its identity."""
        info = self.reader_info()
        await self.peer().Handshake(peer_pb2.HandshakeRequest(info=info), timeout=10)
        return info


async def start_env(tmp: Path) -> Env:
    """Start the three sidecars and register workers with two of them."""
    sock_dir = Path(tempfile.mkdtemp(prefix="kx-bad-"))  # Unix socket paths are short

    async def sidecar(name: str, role: str) -> Sidecar:
        flags = {
            "engine_id": name, "role": role, "peer_listen": "127.0.0.1:0", "metrics_listen": "", "log_level": "error",
            "local_socket": str(sock_dir / f"{name}.sock"), "drain_seconds": DRAIN_SECONDS,
        }  # fmt: skip
        sc = Sidecar(load_settings(flags, env={}))
        await sc.start()
        return sc

    prefill, decode, fresh = (
        await sidecar("prefill", "prefill"),
        await sidecar("decode", "decode"),
        await sidecar("fresh", "both"),
    )
    env = Env(tmp, prefill, decode, fresh, [], [])
    env.tmp = sock_dir
    for sc in (prefill, decode):
        buf = SharedKVBuffer.create(LAYOUT)
        env.buffers.append(buf)
        client = AsyncClient(sc.local_target, timeout=30)
        env.clients.append(client)
        await client.register_caches({G: (LAYOUT, buf.ref())}, rank=RankInfo(0, 1), worker_id="w0")
    env.buffers.append(SharedKVBuffer.create(LAYOUT))  # memory the fresh sidecar's cases describe
    env.renderer, env.renderer_error = await asyncio.to_thread(_build_renderer)
    env.cli = CliDrivers(2, sock_dir)
    await env.cli.start()
    return env


async def close_env(env: Env) -> None:
    """Stop everything :func:`start_env` started."""
    if env.cli is not None:
        await env.cli.close()
    for ch in env.channels.values():
        await ch.close()
    for c in env.clients:
        await c.close()
    for sc in (env.prefill, env.decode, env.fresh):
        await sc.stop(0)
    for b in env.buffers:
        b.close()
    shutil.rmtree(env.tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- local and peer calls
Request = Callable[[Env], Message | Awaitable[Message]]


async def _request(env: Env, make: Request) -> Message:
    out = make(env)
    return await out if asyncio.iscoroutine(out) else out  # type: ignore[return-value]


async def _answer(call: Awaitable[Any]) -> tuple[str, str, Any]:
    try:
        resp = await call
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or "", None
    return "OK", "", resp


def rpc_case(
    surface: str, target: str, name: str, expect: str, fld: str, value: str | None, make: Request, *,
    on: str = "decode", item: str | None = None, then: Callable[[Env], Awaitable[str]] | None = None,
) -> Case:  # fmt: skip
    """A call of ``target`` on a sidecar's local API (``on``) or the prefill sidecar's peer API.

    ``item``: a batch's result list to read the answer from (its first item); ``then``: a check run
    after the call whose non-empty answer is what was got instead (e.g. "drained").
    """

    async def run(env: Env) -> tuple[str, str]:
        req = await _request(env, make)
        stub: Any = env.peer() if surface == "peer" else env.local(on)
        got, message, resp = await _answer(getattr(stub, target)(req, timeout=15))
        if got == "OK" and item is not None:
            results = getattr(resp, item)
            if results:
                r = results[0]
                got, message = (grpc.StatusCode.OK if not r.code else _code(r.code)).name, r.message
        if then is not None:
            instead = await then(env)
            if instead:
                return instead, message
        return got, message

    return Case(surface, target, name, expect, fld, value, run)


def _code(n: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == n), grpc.StatusCode.UNKNOWN)


def malformed_case(surface: str, service: str, method: str) -> Case:
    """Bytes that are no protobuf message of the method's type."""

    async def run(env: Env) -> tuple[str, str]:
        target = env.prefill.peer_address if surface == "peer" else env.fresh.local_target
        call = env.channel(target).unary_unary(f"/kvxfer.v1.{service}/{method}")
        got, message, _ = await _answer(call(b"\xff\xff\xff\xff\x0f", timeout=10))
        return got, message

    return Case(surface, method, "malformed message bytes", "INVALID_ARGUMENT", "request", None, run)


def bl(ids: Sequence[int], group: str = G, **kw: int) -> common_pb2.BlockList:
    """One BlockList."""
    return common_pb2.BlockList(group=group, block_ids=list(ids), **kw)


def pull(env: Env, **kw: Any) -> local_pb2.PullRequest:
    """A Pull of a new request from the prefill sidecar, with ``kw`` overriding its fields."""
    fields: dict[str, Any] = {
        "request_id": env.fresh_id("pull"), "remote_addresses": [env.prefill.peer_address],
        "local_blocks": [bl([3, 4])], "wait": True, "timeout_seconds": 5.0,
    }  # fmt: skip
    fields.update(kw)
    return local_pb2.PullRequest(**fields)


def reg(env: Env, *, layout: common_pb2.Layout | None = None, rank: common_pb2.Rank | None = None,
        memory: local_pb2.Memory | None = None, name: str = G, groups: list[Any] | None = None,
        worker_id: str = "bad") -> local_pb2.RegisterCachesRequest:  # fmt: skip
    """A RegisterCaches for the fresh sidecar, with one part changed."""
    if groups is None:
        mem = memory if memory is not None else memory_to_proto(env.buffers[2].ref())
        groups = [local_pb2.CacheGroup(name=name, layout=layout or layout_to_proto(LAYOUT), memory=mem)]
    return local_pb2.RegisterCachesRequest(worker_id=worker_id, rank=rank or rank_to_proto(RankInfo(0, 1)),
                                           groups=groups)  # fmt: skip


def lay(**changes: Any) -> common_pb2.Layout:
    """The inventory's layout on the wire, with fields changed."""
    msg = layout_to_proto(LAYOUT)
    for k, v in changes.items():
        setattr(msg, k, v)
    return msg


def shm(env: Env, regions: list[tuple[str, int]] | None = None) -> local_pb2.Memory:
    """Shared-memory regions (default: the fresh sidecar's buffer, as it is)."""
    ref = env.buffers[2].ref()
    given = regions if regions is not None else [(r.name, r.offset) for r in ref.regions]
    return local_pb2.Memory(shm=local_pb2.SharedMemory(regions=[local_pb2.ShmRegion(name=n, offset=o)
                                                                for n, o in given]))  # fmt: skip


async def _not_draining(env: Env) -> str:
    for which in ("prefill", "decode", "fresh"):
        status = await env.local(which).GetStatus(local_pb2.GetStatusRequest(), timeout=10)
        if status.draining:
            return f"drained ({which})"
    return ""


def local_cases() -> list[Case]:
    """The local API (worker -> sidecar)."""
    cases: list[Case] = []

    def add(target: str, name: str, expect: str, fld: str, value: str | None, make: Request, **kw: Any) -> None:
        cases.append(rpc_case("local", target, name, expect, fld, value, make, **kw))

    inv = "INVALID_ARGUMENT"
    # ---- RegisterCaches (the fresh sidecar: nobody registered)
    rc = "RegisterCaches"
    add(rc, "no cache groups", inv, "groups", None, lambda e: reg(e, groups=[]), on="fresh")
    add(rc, "worker_id with a newline", inv, "worker_id", "\\n", lambda e: reg(e, worker_id="w\nforged log line"),
        on="fresh")  # fmt: skip
    add(rc, "worker_id of 2400 characters", inv, "worker_id", "2400", lambda e: reg(e, worker_id="w" * 2400),
        on="fresh")  # fmt: skip
    add(rc, "empty group name", inv, "groups[0].name", None, lambda e: reg(e, name=""), on="fresh")
    add(rc, "group name with a newline", inv, "groups[0].name", "\\n", lambda e: reg(e, name="k\nv"), on="fresh")
    add(rc, "group name of 600 characters", inv, "groups[0].name", "600", lambda e: reg(e, name="g" * 600), on="fresh")
    add(rc, "the same group twice", inv, "groups[1].name", "'kv'",
        lambda e: reg(e, groups=[local_pb2.CacheGroup(name=G, layout=lay(), memory=shm(e))] * 2),
        on="fresh")  # fmt: skip
    add(rc, "257 cache groups", inv, "groups", "257",
        lambda e: reg(e, groups=[local_pb2.CacheGroup(name=f"g{i}", layout=lay(), memory=shm(e)) for i in range(257)]),
        on="fresh")  # fmt: skip
    for fname, value, shown in (
        ("kind", "banana", "'banana'"), ("dtype", "fp9", "'fp9'"), ("order", "XYZ", "'XYZ'"),
        ("packing", "zigzag", "'zigzag'"), ("num_layers", 0, "0"), ("num_blocks", 0, "0"), ("block_size", 0, "0"),
        ("num_kv_heads", 0, "0"), ("head_size", 0, "0"),
    ):  # fmt: skip
        add(rc, f"layout {fname} {value!r}", inv, f"groups[0].layout.{fname}", shown,
            lambda e, f=fname, v=value: reg(e, layout=lay(**{f: v})), on="fresh")  # fmt: skip
    add(rc, "nvfp4 in an attention cache", inv, "groups[0].layout.dtype", "nvfp4",
        lambda e: reg(e, layout=lay(dtype="nvfp4")), on="fresh")  # fmt: skip
    add(rc, "MLA layout with 4 heads", inv, "groups[0].layout.num_kv_heads", "4",
        lambda e: reg(e, layout=lay(kind="mla")), on="fresh")  # fmt: skip
    add(rc, "rank holds more heads than its share", inv, "groups[0].layout.num_kv_heads", "4",
        lambda e: reg(e, rank=common_pb2.Rank(tp_rank=0, tp_size=2)), on="fresh")  # fmt: skip
    add(rc, "heads that do not split over tp 3", inv, "groups[0].layout.total_kv_heads", "tp_size 3",
        lambda e: reg(e, rank=common_pb2.Rank(tp_rank=0, tp_size=3)), on="fresh")  # fmt: skip
    add(rc, "tp_rank outside tp_size", inv, "rank.tp_rank", "2",
        lambda e: reg(e, rank=common_pb2.Rank(tp_rank=2, tp_size=2)), on="fresh")  # fmt: skip
    add(rc, "pp_rank outside pp_size", inv, "rank.pp_rank", "1",
        lambda e: reg(e, rank=common_pb2.Rank(pp_rank=1, pp_size=1)), on="fresh")  # fmt: skip
    add(rc, "no memory", inv, "groups[0].memory", None, lambda e: reg(e, memory=local_pb2.Memory()), on="fresh")
    add(rc, "shm segment that does not exist", inv, "groups[0].memory.shm.regions[0].name", "no-such-segment",
        lambda e: reg(e, memory=shm(e, [("no-such-segment", 0)] * 2)), on="fresh")  # fmt: skip
    add(rc, "one shm region for two layers", inv, "groups[0].memory.shm.regions", "got 1",
        lambda e: reg(e, memory=shm(e, [(e.buffers[2].ref().regions[0].name, 0)])), on="fresh")  # fmt: skip
    add(rc, "shm offset past the segment", inv, "groups[0].memory.shm.regions[0]", str(1 << 40),
        lambda e: reg(e, memory=shm(e, [(r.name, 1 << 40) for r in e.buffers[2].ref().regions])),
        on="fresh")  # fmt: skip
    add(rc, "shm name '..'", inv, "shm", "'..'", lambda e: reg(e, memory=shm(e, [("..", 0)] * 2)), on="fresh")
    add(rc, "library memory of another process", inv, "groups[0].memory.library.pid", "1",
        lambda e: reg(e, memory=local_pb2.Memory(library=local_pb2.LibraryMemory(addresses=[4096, 8192], pid=1))),
        on="fresh")  # fmt: skip
    add(rc, "library memory type HBM", inv, "groups[0].memory.library.memory_type", "HBM",
        lambda e: reg(e, memory=local_pb2.Memory(library=local_pb2.LibraryMemory(
            addresses=[4096, 8192], pid=os.getpid(), memory_type="HBM"))), on="fresh")  # fmt: skip
    add(rc, "library null address", inv, "groups[0].memory.library.addresses", "null",
        lambda e: reg(e, memory=local_pb2.Memory(library=local_pb2.LibraryMemory(addresses=[0, 8192],
                                                                                  pid=os.getpid()))),
        on="fresh")  # fmt: skip
    add(rc, "descriptor handle nobody passed", inv, "groups[0].memory.fd.handle", "nope",
        lambda e: reg(e, memory=local_pb2.Memory(fd=local_pb2.FdMemory(handle="nope", regions=[
            local_pb2.FdRegion(index=0), local_pb2.FdRegion(index=0)]))), on="fresh")  # fmt: skip
    add(rc, "CUDA IPC handle of 3 bytes", inv, "groups[0].memory.cuda_ipc.handles[0]", "3",
        lambda e: reg(e, memory=local_pb2.Memory(cuda_ipc=local_pb2.CudaIpc(handles=[b"abc", b"def"],
                                                                             offsets=[0, 0]))), on="fresh")  # fmt: skip
    add(rc, "a second rank on a sidecar that serves one", "FAILED_PRECONDITION", "rank", "tp rank 1/2",
        lambda e: reg(e, rank=common_pb2.Rank(tp_rank=1, tp_size=2), layout=lay(total_kv_heads=8)),
        on="decode")  # fmt: skip

    # ---- Publish (the prefill sidecar)
    def publish(**kw: Any) -> Request:
        def make(env: Env) -> local_pb2.PublishRequest:
            fields: dict[str, Any] = {"request_id": env.fresh_id("p"), "blocks": [bl([1, 2])]}
            fields.update(kw)
            return local_pb2.PublishRequest(**fields)

        return make

    pb = "Publish"
    add(pb, "empty request_id", inv, "request_id", None, publish(request_id=""), on="prefill")
    add(pb, "request_id of 600 characters", inv, "request_id", "600", publish(request_id="r" * 600), on="prefill")
    add(pb, "request_id with a NUL", inv, "request_id", "\\x00", publish(request_id="a\x00b"), on="prefill")
    add(pb, "no block lists", inv, "blocks", "'kv'", publish(blocks=[]), on="prefill")
    add(pb, "unknown group", inv, "blocks[0].group", "'nope'", publish(blocks=[bl([1], "nope")]), on="prefill")
    add(pb, "group given twice", inv, "blocks[1].group", "'kv'", publish(blocks=[bl([1]), bl([2])]), on="prefill")
    add(pb, "block id out of range", inv, "blocks[kv]", "32", publish(blocks=[bl([1, 32])]), on="prefill")
    add(pb, "negative block id", inv, "blocks[kv]", "-1", publish(blocks=[bl([-1])]), on="prefill")
    add(pb, "repeated block id", inv, "blocks[kv]", "block id 5", publish(blocks=[bl([5, 5])]), on="prefill")
    add(pb, "empty block list", inv, "blocks[kv]", "empty", publish(blocks=[bl([])]), on="prefill")
    for shown, v in (("-1", -1.0), ("nan", math.nan), ("inf", math.inf), ("100000", 1e5)):
        add(pb, f"lease_seconds {shown}", inv, "lease_seconds", shown, publish(lease_seconds=v), on="prefill")
    add(pb, "reader_engine_id with a space", inv, "reader_engine_id", "'a b'", publish(reader_engine_id="a b"),
        on="prefill")  # fmt: skip

    # ---- Expect (decode side: hold a queued request's publishes)
    ex = "Expect"
    add(ex, "empty request_id", inv, "request_id", None,
        lambda e: local_pb2.ExpectRequest(remote_addresses=[e.prefill.peer_address]))  # fmt: skip
    add(ex, "no remote_addresses", inv, "remote_addresses", None, lambda e: local_pb2.ExpectRequest(request_id="x"))
    add(ex, "remote address port 0", inv, "remote_addresses[0]", "127.0.0.1:0",
        lambda e: local_pb2.ExpectRequest(request_id="x", remote_addresses=["127.0.0.1:0"]))  # fmt: skip
    add(ex, "on a prefill-only sidecar", "FAILED_PRECONDITION", "role", "prefill",
        lambda e: local_pb2.ExpectRequest(request_id="x", remote_addresses=[e.decode.peer_address]),
        on="prefill")  # fmt: skip
    add(pb, "already published", "ALREADY_EXISTS", "request_id", "pub-",
        lambda e: _republish(e), on="prefill")  # fmt: skip
    add(pb, "on a decode-only sidecar", "FAILED_PRECONDITION", "role", "decode", publish(), on="decode")
    add(pb, "before any RegisterCaches", "FAILED_PRECONDITION", "RegisterCaches", None, publish(), on="fresh")

    # ---- Pull (the decode sidecar)
    def pl(**kw: Any) -> Request:
        return lambda env: pull(env, **kw)

    pu = "Pull"
    add(pu, "empty request_id", inv, "request_id", None, pl(request_id=""))
    add(pu, "request_id with a newline", inv, "request_id", "\\n", pl(request_id="a\nb"))
    add(pu, "remote_engine_id of 600 characters", inv, "remote_engine_id", "600", pl(remote_engine_id="e" * 600))
    add(pu, "no remote_addresses", inv, "remote_addresses", None, pl(remote_addresses=[]))
    for addr, shown, why in (
        ("127.0.0.1:0", "127.0.0.1:0", "port 0"), ("127.0.0.1:70000", "70000", "port above 65535"),
        ("127.0.0.1", "127.0.0.1", "no port"), ("foo", "foo", "garbage"), (":1234", ":1234", "empty host"),
        ("host:abc", "abc", "port not a number"), ("host:", "host:", "empty port"),
        ("unix:///tmp/kvxfer.sock", "unix:///tmp/kvxfer.sock", "a Unix socket URL"),
        ("/run/kvxfer/kvxfer.sock", "/run/kvxfer/kvxfer.sock", "a Unix socket path"),
        ("0.0.0.0:50051", "0.0.0.0", "wildcard IPv4"), ("[::]:50051", "::", "wildcard IPv6"),
        ("256.1.1.1:50051", "256.1.1.1", "IPv4 out of range"), ("a..b:50051", "a..b", "empty label"),
        ("-bad-:50051", "-bad-", "label starting with a dash"), ("[]:50051", "[]:50051", "empty brackets"),
        ("[fe80::zz]:50051", "fe80::zz", "bad IPv6"), ("::1:50051", "::1:50051", "IPv6 without brackets"),
        (" 127.0.0.1:50051", "127.0.0.1:50051", "leading space"), ("h:99999999999999999999", "99999999999999999999",
                                                                    "huge port"),
        ("http://127.0.0.1:50051", "http://127.0.0.1:50051", "a URL"),
    ):  # fmt: skip
        add(pu, f"remote address: {why}", inv, "remote_addresses[0]", shown, pl(remote_addresses=[addr]))
    add(pu, "second remote address bad", inv, "remote_addresses[1]", "127.0.0.1:0",
        lambda e: pull(e, remote_addresses=[e.prefill.peer_address, "127.0.0.1:0"]))  # fmt: skip
    add(pu, "the same address twice", inv, "remote_addresses", "appears twice",
        lambda e: pull(e, remote_addresses=[e.prefill.peer_address] * 2))  # fmt: skip
    add(pu, "no local block lists", inv, "local_blocks", "'kv'", pl(local_blocks=[]))
    add(pu, "local unknown group", inv, "local_blocks[0].group", "'nope'", pl(local_blocks=[bl([1], "nope")]))
    add(pu, "local group twice", inv, "local_blocks[1].group", "'kv'", pl(local_blocks=[bl([1]), bl([2])]))
    add(pu, "local block id out of range", inv, "local_blocks[kv]", "99", pl(local_blocks=[bl([99])]))
    add(pu, "local negative block id", inv, "local_blocks[kv]", "-3", pl(local_blocks=[bl([-3])]))
    add(pu, "local repeated block id", inv, "local_blocks[kv]", "block id 4", pl(local_blocks=[bl([4, 4])]))
    add(pu, "local empty block list", inv, "local_blocks[kv]", "empty", pl(local_blocks=[bl([])]))
    add(pu, "remote unknown group", inv, "remote_blocks[0].group", "'nope'", pl(remote_blocks=[bl([1], "nope")]))
    add(pu, "remote group twice", inv, "remote_blocks[1].group", "'kv'",
        pl(remote_blocks=[bl([1]), bl([2])]))  # fmt: skip
    add(pu, "remote negative block id", inv, "remote_blocks[kv]", "-2", pl(remote_blocks=[bl([1, -2])]))
    add(pu, "remote repeated block id", inv, "remote_blocks[kv]", "block id 1", pl(remote_blocks=[bl([1, 1])]))
    for shown, v in (("-1", -1.0), ("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf)):
        add(pu, f"timeout_seconds {shown}", inv, "timeout_seconds", shown, pl(timeout_seconds=v))
    add(pu, "a request nobody published", "NOT_FOUND", "request_id", "pull-", pl())
    add(pu, "remote_blocks naming ids that were not published", inv, "remote_blocks[kv]", "block id 9",
        lambda e: _pull_published(e, remote_blocks=[bl([1, 9])]))  # fmt: skip
    add(pu, "local and remote block counts differ", inv, "remote_blocks", "length mismatch",
        lambda e: _pull_published(e, local_blocks=[bl([3, 4, 5])]))  # fmt: skip
    add(pu, "skip_tokens past the block", inv, "local_skip", "17",
        lambda e: _pull_published(e, local_blocks=[bl([3, 4], skip_tokens=17, num_tokens=8)]))  # fmt: skip
    add(pu, "the wrong remote engine", "FAILED_PRECONDITION", "remote_addresses[0]", "'someone-else'",
        lambda e: _pull_published(e, remote_engine_id="someone-else"))  # fmt: skip
    add(pu, "on a prefill-only sidecar", "FAILED_PRECONDITION", "role", "prefill", pl(), on="prefill")

    # ---- PullBatch
    def batch(*items: Callable[[Env], local_pb2.PullRequest]) -> Request:
        return lambda env: local_pb2.PullBatchRequest(pulls=[make(env) for make in items])

    pbat = "PullBatch"
    add(pbat, "no pulls", inv, "pulls", "0 pulls", lambda e: local_pb2.PullBatchRequest())
    add(pbat, "1025 pulls", inv, "pulls", "1025",
        lambda e: local_pb2.PullBatchRequest(pulls=[pull(e, remote_addresses=["127.0.0.1:0"])] * 1025))  # fmt: skip
    add(pbat, "item with port 0", inv, "remote_addresses[0]", "127.0.0.1:0",
        batch(lambda e: pull(e, remote_addresses=["127.0.0.1:0"])), item="results")  # fmt: skip
    add(pbat, "item with a NaN timeout", inv, "timeout_seconds", "nan",
        batch(lambda e: pull(e, timeout_seconds=math.nan)), item="results")  # fmt: skip
    add(pbat, "item with an empty request_id", inv, "request_id", None, batch(lambda e: pull(e, request_id="")),
        item="results")  # fmt: skip

    # ---- Release, Abort
    for target, msg in (("Release", local_pb2.ReleaseRequest), ("Abort", local_pb2.AbortRequest)):
        add(target, "empty request_id", inv, "request_id", None, lambda e, m=msg: m(request_id=""))
        add(target, "request_id of 600 characters", inv, "request_id", "600", lambda e, m=msg: m(request_id="x" * 600))
        add(target, "request_id with a tab", inv, "request_id", "\\t", lambda e, m=msg: m(request_id="a\tb"))
    for addr, shown in (("127.0.0.1:0", "127.0.0.1:0"), ("nowhere", "nowhere"), ("0.0.0.0:1", "0.0.0.0")):
        add("Abort", f"remote address {addr}", inv, "remote_addresses[0]", shown,
            lambda e, a=addr: local_pb2.AbortRequest(request_id="ab-1", remote_addresses=[a]))  # fmt: skip
    add("Abort", "remote_addresses on a prefill-only sidecar", "FAILED_PRECONDITION", "role", "prefill",
        lambda e: local_pb2.AbortRequest(request_id="ab-2", remote_addresses=[e.decode.peer_address]),
        on="prefill")  # fmt: skip

    # ---- Drain: a bad budget is refused and drains nothing
    for shown, v in (("-5", -5.0), ("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), ("1000000000", 1e9)):
        add("Drain", f"timeout_seconds {shown}", inv, "timeout_seconds", shown,
            lambda e, v=v: local_pb2.DrainRequest(timeout_seconds=v), on="fresh", then=_not_draining)  # fmt: skip

    for method in ("RegisterCaches", "Publish", "Pull", "PullBatch", "Release", "Abort", "Expect", "Drain",
                   "GetStatus", "WatchCompletions"):  # fmt: skip
        if method != "WatchCompletions":
            cases.append(malformed_case("local", "Local", method))
    return cases


async def _republish(env: Env) -> local_pb2.PublishRequest:
    rid = await env.publish()
    return local_pb2.PublishRequest(request_id=rid, blocks=[bl([7])])


async def _pull_published(env: Env, **kw: Any) -> local_pb2.PullRequest:
    rid = await env.publish([1, 2])
    return pull(env, request_id=rid, **kw)


def peer_cases() -> list[Case]:
    """The peer API (sidecar -> sidecar), against the prefill sidecar."""
    cases: list[Case] = []
    inv, fp = "INVALID_ARGUMENT", "FAILED_PRECONDITION"

    def add(target: str, name: str, expect: str, fld: str, value: str | None, make: Request, **kw: Any) -> None:
        cases.append(rpc_case("peer", target, name, expect, fld, value, make, **kw))

    def hs(**changes: Any) -> Request:
        return lambda env: peer_pb2.HandshakeRequest(info=env.reader_info(**changes))

    def hs_edit(edit: Callable[[peer_pb2.PeerInfo], None]) -> Request:
        def make(env: Env) -> peer_pb2.HandshakeRequest:
            info = env.reader_info()
            edit(info)
            return peer_pb2.HandshakeRequest(info=info)

        return make

    h = "Handshake"
    add(h, "no info at all", inv, "info.engine_id", None, lambda e: peer_pb2.HandshakeRequest())
    add(h, "empty engine_id", inv, "info.engine_id", None, hs(engine_id=""))
    add(h, "engine_id of 600 characters", inv, "info.engine_id", "600", hs(engine_id="e" * 600))
    add(h, "engine_id with a newline", inv, "info.engine_id", "\\n", hs(engine_id="a\nb"))
    add(h, "empty instance_id", inv, "info.instance_id", None, hs(instance_id=""))
    for addr, shown in (
        ("", "''"), ("127.0.0.1:0", "127.0.0.1:0"), ("reader", "reader"), ("unix:///run/r.sock", "unix:///run/r.sock"),
        ("0.0.0.0:50051", "0.0.0.0"), ("127.0.0.1:65536", "65536"),
    ):  # fmt: skip
        add(h, f"address {addr!r}", inv, "info.address", shown, hs(address=addr))
    add(h, "tp_rank outside tp_size", inv, "info.rank.tp_rank", "3",
        hs_edit(lambda i: i.rank.CopyFrom(common_pb2.Rank(tp_rank=3, tp_size=2))))  # fmt: skip
    add(h, "tp_size of a million ranks", inv, "info.rank.tp_size", "1000000",
        hs_edit(lambda i: i.rank.CopyFrom(common_pb2.Rank(tp_rank=7, tp_size=1_000_000))))  # fmt: skip
    add(h, "pp_rank outside pp_size", inv, "info.rank.pp_rank", "2",
        hs_edit(lambda i: i.rank.CopyFrom(common_pb2.Rank(pp_rank=2, pp_size=2))))  # fmt: skip
    add(h, "empty group name", inv, "info.groups[0].name", None, hs_edit(lambda i: setattr(i.groups[0], "name", "")))
    add(h, "the same group twice", inv, "info.groups[1].name", "'kv'", hs_edit(lambda i: i.groups.append(i.groups[0])))
    add(
        h,
        "257 cache groups",
        inv,
        "info.groups",
        "257",
        hs_edit(
            lambda i: i.groups.extend(peer_pb2.GroupLayout(name=f"g{n}", layout=i.groups[0].layout) for n in range(256))
        ),
    )
    for fname, value, shown in (
        ("kind", "banana", "'banana'"), ("dtype", "fp9", "'fp9'"), ("num_layers", 0, "0"), ("block_size", 0, "0"),
        ("order", "ZYX", "'ZYX'"),
    ):  # fmt: skip
        add(h, f"layout {fname} {value!r}", inv, f"info.groups[kv].layout.{fname}", shown,
            hs_edit(lambda i, f=fname, v=value: setattr(i.groups[0].layout, f, v)))  # fmt: skip
    add(h, "another protocol version", fp, "protocol_version", str(PROTOCOL_VERSION + 7),
        hs(protocol_version=PROTOCOL_VERSION + 7))  # fmt: skip
    add(h, "a prefill-only reader", fp, "role", "prefill-only", hs(role="prefill"))
    add(h, "another dtype", fp, "dtype", "fp16", hs_edit(lambda i: setattr(i.groups[0].layout, "dtype", "fp16")))
    add(h, "another layer count", fp, "num_layers", "3",
        hs_edit(lambda i: setattr(i.groups[0].layout, "num_layers", 3)))  # fmt: skip
    add(h, "a group the publisher lacks", fp, "'other'", None,
        hs_edit(lambda i: i.groups.append(peer_pb2.GroupLayout(name="other", layout=i.groups[0].layout))))  # fmt: skip
    add(h, "another backend", fp, "backend", "mooncake",
        hs_edit(lambda i: setattr(i.data_plane, "backend", "mooncake")))  # fmt: skip

    def lookup(**kw: Any) -> Callable[[Env], Awaitable[peer_pb2.GetPublishedRequest]]:
        async def make(env: Env) -> peer_pb2.GetPublishedRequest:
            info = await env.handshake()
            fields: dict[str, Any] = {
                "request_id": await env.publish(), "engine_id": info.engine_id, "instance_id": info.instance_id,
                "rank": info.rank, "epoch": info.epoch,
            }  # fmt: skip
            fields.update(kw)
            return peer_pb2.GetPublishedRequest(**fields)

        return make

    gp = "GetPublished"
    add(gp, "empty request_id", inv, "request_id", None, lambda e: peer_pb2.GetPublishedRequest())
    add(gp, "request_id of 600 characters", inv, "request_id", "600",
        lambda e: peer_pb2.GetPublishedRequest(request_id="q" * 600))  # fmt: skip
    add(gp, "request_id with a NUL", inv, "request_id", "\\x00",
        lambda e: peer_pb2.GetPublishedRequest(request_id="q\x00"))  # fmt: skip
    add(gp, "a request nobody published", "NOT_FOUND", "request_id", "'nobody-published-this'",
        lookup(request_id="nobody-published-this"))  # fmt: skip
    add(gp, "a reader that never handshook", fp, "engine_id", "'stranger'",
        lookup(engine_id="stranger", instance_id="x"))  # fmt: skip
    add(gp, "a reader that never handshook, for a request nobody published", fp, "engine_id", "'stranger'",
        lookup(engine_id="stranger", instance_id="x", request_id="nobody-published-this"))  # fmt: skip
    add(gp, "tp_rank outside tp_size", inv, "rank.tp_rank", "5", lookup(rank=common_pb2.Rank(tp_rank=5, tp_size=2)))
    add(gp, "another epoch than the handshake's", fp, "epoch", "999", lookup(epoch=999))

    gpb, lookups = "GetPublishedBatch", peer_pb2.GetPublishedBatchRequest
    add(gpb, "1025 lookups", inv, "requests", "1025",
        lambda e: lookups(requests=[peer_pb2.GetPublishedRequest(request_id="z")] * 1025))  # fmt: skip
    add(gpb, "item with an empty request_id", inv, "request_id", None,
        lambda e: lookups(requests=[peer_pb2.GetPublishedRequest()]), item="results")  # fmt: skip

    def batch_of(one: Callable[[Env], Awaitable[peer_pb2.GetPublishedRequest]]) -> Request:
        async def make(env: Env) -> peer_pb2.GetPublishedBatchRequest:
            return lookups(requests=[await one(env)])

        return make

    add(gpb, "item nobody published", "NOT_FOUND", "request_id", "'unknown-in-batch'",
        batch_of(lookup(request_id="unknown-in-batch")), item="results")  # fmt: skip
    add(gpb, "item from a reader that never handshook", fp, "engine_id", "'stranger'",
        batch_of(lookup(engine_id="stranger", instance_id="x", request_id="unknown-in-batch")),
        item="results")  # fmt: skip

    def notice(**kw: Any) -> Callable[[Env], Awaitable[peer_pb2.NotifyRequest]]:
        async def make(env: Env) -> peer_pb2.NotifyRequest:
            info = await env.handshake()
            fields: dict[str, Any] = {
                "request_id": await env.publish(), "engine_id": info.engine_id, "instance_id": info.instance_id,
                "rank": info.rank, "outcome": peer_pb2.NotifyRequest.DONE,
            }  # fmt: skip
            fields.update(kw)
            return peer_pb2.NotifyRequest(**fields)

        return make

    nt = "Notify"
    add(nt, "empty request_id", inv, "request_id", None, lambda e: peer_pb2.NotifyRequest())
    add(nt, "request_id of 600 characters", inv, "request_id", "600",
        lambda e: peer_pb2.NotifyRequest(request_id="n" * 600))  # fmt: skip
    add(nt, "outcome unspecified", inv, "outcome", "0", notice(outcome=0))
    add(nt, "outcome 42", inv, "outcome", "42", notice(outcome=42))
    add(nt, "tp_rank outside tp_size", inv, "rank.tp_rank", "4", notice(rank=common_pb2.Rank(tp_rank=4, tp_size=1)))
    add(nt, "DONE from a reader that never fetched", fp, "engine_id", "did not fetch", notice())
    add(nt, "UNREAD from a sidecar that never handshook", fp, "engine_id", "'stranger'",
        notice(engine_id="stranger", outcome=peer_pb2.NotifyRequest.UNREAD))  # fmt: skip

    add("NotifyBatch", "1025 notices", inv, "notices", "1025",
        lambda e: peer_pb2.NotifyBatchRequest(notices=[peer_pb2.NotifyRequest(request_id="z")] * 1025))  # fmt: skip

    ab = "Abort"
    add(ab, "empty request_id", inv, "request_id", None, lambda e: peer_pb2.PeerAbortRequest())
    add(ab, "request_id with a newline", inv, "request_id", "\\n",
        lambda e: peer_pb2.PeerAbortRequest(request_id="a\nb"))  # fmt: skip
    add(ab, "from a sidecar that never handshook", fp, "engine_id", "'stranger'",
        lambda e: peer_pb2.PeerAbortRequest(request_id="x", engine_id="stranger", instance_id="i"))  # fmt: skip

    hd = "Hold"
    add(hd, "from a sidecar that never handshook", fp, "engine_id", "'stranger'",
        lambda e: peer_pb2.HoldRequest(request_ids=["x"], engine_id="stranger", instance_id="i"))  # fmt: skip
    add(hd, "1025 ids in one call", inv, "request_ids", "1025",
        lambda e: peer_pb2.HoldRequest(request_ids=[f"r{i}" for i in range(1025)], engine_id="stranger"))  # fmt: skip

    for method in ("Handshake", "GetPublished", "GetPublishedBatch", "Notify", "NotifyBatch", "Abort", "Hold"):
        cases.append(malformed_case("peer", "Peer", method))
    return cases


# ---------------------------------------------------------------------------- the command line
#: Runs `kvxfer <argv>` through the console script's entry point (kvxfer.cli:main) once per input
#: line, as the shell would (sys.argv, environment, exit code, stderr), and answers one JSON line:
#: a process per command line would spend the whole inventory's time starting interpreters.
CLI_DRIVER = r"""
import contextlib, io, json, os, sys
from kvxfer.cli import main
for line in sys.stdin:
    job = json.loads(line)
    saved = dict(os.environ)
    os.environ.update(job["env"])
    err, out = io.StringIO(), io.StringIO()
    sys.argv = ["kvxfer", *job["argv"]]
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException as exc:
            code = -1
            err.write(f"crashed: {type(exc).__name__}: {exc}")
    os.environ.clear()
    os.environ.update(saved)
    print(json.dumps({"code": code, "stderr": err.getvalue()}), flush=True)
"""


class CliDrivers:
    """A few long-lived processes running :data:`CLI_DRIVER`, lent to one case at a time."""

    def __init__(self, count: int, cwd: Path) -> None:
        self.count = count
        self.cwd = cwd
        self.idle: asyncio.Queue[asyncio.subprocess.Process] = asyncio.Queue()
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self) -> None:
        """Start the driver processes."""
        for _ in range(self.count):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", CLI_DRIVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                env={**os.environ, "COLUMNS": "80"}, cwd=str(self.cwd),
            )  # fmt: skip
            self.procs.append(proc)
            self.idle.put_nowait(proc)

    async def run(self, argv: Sequence[str], env_vars: Mapping[str, str]) -> tuple[int, str]:
        """(exit code, stderr) of ``kvxfer <argv>``."""
        proc = await self.idle.get()
        try:
            assert proc.stdin is not None
            assert proc.stdout is not None
            proc.stdin.write((json.dumps({"argv": list(argv), "env": dict(env_vars)}) + "\n").encode())
            await proc.stdin.drain()
            answer = json.loads(await asyncio.wait_for(proc.stdout.readline(), timeout=60))
        finally:
            self.idle.put_nowait(proc)
        return int(answer["code"]), str(answer["stderr"])

    async def close(self) -> None:
        """End the driver processes."""
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), timeout=10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def cli_case(target: str, name: str, argv: Sequence[str] | Callable[[Env], Sequence[str]], fld: str,
             value: str | None, *, expect: str = "exit 2", env_vars: Mapping[str, str] | None = None,
             then: Callable[[Env], Awaitable[str]] | None = None, own_process: bool = False) -> Case:  # fmt: skip
    """``kvxfer <argv>``: its exit code, and its ``error:`` lines as the message.

    ``own_process``: a process of its own (``python -m kvxfer.cli``), as a shell would start it;
    otherwise one of the :class:`CliDrivers` runs it through the same entry point.
    """

    async def run(env: Env) -> tuple[str, str]:
        args = list(argv(env) if callable(argv) else argv)
        if own_process:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvxfer.cli", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={**os.environ, "COLUMNS": "80", **(env_vars or {})}, cwd=str(env.tmp),
            )  # fmt: skip
            try:
                _out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                return "timeout", ""
            code, text = proc.returncode, err.decode(errors="replace")
        else:
            assert env.cli is not None
            code, text = await env.cli.run(args, env_vars or {})
        # kvxfer's one error style: the message is the `error:` line; without one, the case fails.
        lines = [ln for ln in text.splitlines() if ln.startswith("error: ")]
        got = f"exit {code}"
        if then is not None:
            got = (await then(env)) or got
        return got, "\n".join(lines) if lines else f"(no 'error:' line) {text[-300:]}"

    return Case("cli", f"kvxfer {target}".strip(), name, expect, fld, value, run)


def cli_cases() -> list[Case]:
    """``kvxfer plan / serve / drain / demo / bench`` and the command group itself."""
    cases: list[Case] = []

    def add(target: str, argv: Sequence[str], fld: str, value: str | None, name: str | None = None, **kw: Any) -> None:
        cases.append(cli_case(target, name or " ".join(argv), [*target.split(), *argv], fld, value, **kw))

    # ---- plan
    for argv, fld, value in (
        (["--blocks", "5:2"], "--blocks", "5:2"), (["--blocks", ""], "--blocks", "''"),
        (["--blocks", "1,x"], "--blocks", "'x'"), (["--blocks=-1"], "--blocks", "-1"),
        (["--blocks", "0:99999999999"], "--blocks", "0:99999999999"),
        (["--blocks", "0:3", "--remote-blocks", "5,5,6"], "--remote-blocks", "5"),
        (["--blocks", "0:4", "--remote-blocks", "0:5"], "--remote-blocks", "5 remote blocks"),
        (["--remote-blocks", "9:3"], "--remote-blocks", "9:3"),
        (["--decode-rank", "3"], "--decode-rank", "3"), (["--decode-rank", "-1"], "--decode-rank", "-1"),
        (["--decode-tp", "0"], "--decode-tp", "0"), (["--prefill-tp", "0"], "--prefill-tp", "0"),
        (["--kv-heads", "6", "--decode-tp", "4"], "--kv-heads", "6"),
        (["--kv-heads", "6", "--prefill-tp", "4"], "--kv-heads", "--prefill-tp 4"),
        (["--kv-heads", "2", "--decode-tp", "3"], "--decode-tp", "3"),
        (["--kv-heads", "0"], "--kv-heads", "0"), (["--layers", "0"], "--layers", "0"),
        (["--layers", "abc"], "--layers", "abc"), (["--head-size", "0"], "--head-size", "0"),
        (["--block-size", "0"], "--block-size", "0"), (["--remote-block-size", "24"], "--remote-block-size", "24"),
        (["--remote-block-size", "0"], "--remote-block-size", "0"), (["--num-blocks", "0"], "--num-blocks", "0"),
        (["--num-blocks", "4", "--blocks", "0:8"], "--blocks", "block id 4"), (["--dtype", "fp9"], "--dtype", "fp9"),
        (["--kind", "quantized", "--dtype", "bf16"], "--dtype", "bf16"),
        (["--layout", "HDN"], "--layout", "HDN"), (["--kind", "foo"], "--kind", "foo"),
        (["--kind", "mamba", "--prefill-tp", "2"], "--prefill-tp", "2"), (["--json", "yes"], "--json", "yes"),
        (["--cross-layer", "no"], "--cross-layer", "no"), (["--bogus"], "--bogus", None),
        (["--blocks"], "--blocks", None), (["0:8"], "0:8", None),
    ):  # fmt: skip
        add("plan", argv, fld, value, own_process=argv == ["--blocks", "5:2"])

    # ---- serve (the sidecar's settings; nothing starts)
    def exists(env: Env, name: str, text: str) -> str:
        p = env.tmp / name
        p.write_text(text)
        return str(p)

    for argv, fld, value in (
        (["--lease-seconds", "-5"], "--lease-seconds", "-5"), (["--lease-seconds", "nan"], "--lease-seconds", "nan"),
        (["--lease-seconds", "1e9"], "--lease-seconds", "1e9"),
        (["--transfer-timeout-seconds", "0"], "--transfer-timeout-seconds", "0"),
        (["--drain-seconds", "inf"], "--drain-seconds", "inf"), (["--drain-seconds", "-1"], "--drain-seconds", "-1"),
        (["--role", "sideways"], "--role", "sideways"), (["--role"], "--role", None),
        (["--peer-listen", "nowhere"], "--peer-listen", "nowhere"),
        (["--peer-listen", "127.0.0.1:99999"], "--peer-listen", "99999"),
        (["--peer-listen", "host:abc"], "--peer-listen", "abc"),
        (["--peer-listen", "unix:///tmp/x.sock"], "--peer-listen", "unix:///tmp/x.sock"),
        (["--peer-listen", "999.0.0.1:50051"], "--peer-listen", "999.0.0.1"),
        (["--advertise-host", "10.0.0.1:50051"], "--advertise-host", "10.0.0.1:50051"),
        (["--advertise-host", "0.0.0.0"], "--advertise-host", "0.0.0.0"),
        (["--advertise-host", "a host"], "--advertise-host", "a host"),
        (["--advertise-host", "http://x"], "--advertise-host", "http://x"),
        (["--metrics-listen", "foo"], "--metrics-listen", "foo"),
        (["--local-listen", ":abc"], "--local-listen", ":abc"),
        (["--data-port", "70000"], "--data-port", "70000"), (["--data-port", "-1"], "--data-port", "-1"),
        (["--max-message-bytes", "1024"], "--max-message-bytes", "1024"),
        (["--backend", "carrier-pigeon"], "--backend", "carrier-pigeon"),
        (["--nixl-backends", ","], "--nixl-backends", ","),
        (["--mooncake-protocol", "udp"], "--mooncake-protocol", "udp"),
        (["--cuda-ipc-direct", "maybe"], "--cuda-ipc-direct", "maybe"),
        (["--log-level", "loud"], "--log-level", "loud"), (["--log-format", "xml"], "--log-format", "xml"),
        (["--engine-id", "a b"], "--engine-id", "a b"), (["--engine-id", ""], "--engine-id", "''"),
        (["--token-file", "/nonexistent/token"], "--token-file", "/nonexistent/token"),
        (["--tls-ca", "/etc/hostname"], "--tls-ca", None), (["--config", "/nonexistent.yaml"], "--config", None),
        (["--bogus", "1"], "--bogus", None), (["extra"], "extra", None),
        (["--local-socket", ""], "--local-socket", None),
    ):  # fmt: skip
        add("serve", argv, fld, value, own_process=argv == ["--lease-seconds", "-5"])
    cases.append(cli_case("serve", "--tls-cert without --tls-key", lambda e: ["serve", "--tls-cert",
                          exists(e, "cert.pem", "x")], "--tls-key", None))  # fmt: skip
    cases.append(cli_case("serve", "an empty --token-file", lambda e: ["serve", "--token-file",
                          exists(e, "empty-token", "\n")], "--token-file", "empty"))  # fmt: skip
    cases.append(cli_case("serve", "--config with an unknown key", lambda e: ["serve", "--config",
                          exists(e, "bad.yaml", "lease_seconds: 5\nbogus_key: 1\n")], "bogus_key", None))  # fmt: skip
    cases.append(cli_case("serve", "--config with a bad value", lambda e: ["serve", "--config",
                          exists(e, "bad2.yaml", "drain_seconds: lots\n")], "drain_seconds", "lots"))  # fmt: skip
    cases.append(cli_case("serve", "KVXFER_ROLE=sideways", ["serve"], "KVXFER_ROLE", "sideways",
                          env_vars={"KVXFER_ROLE": "sideways"}, own_process=True))  # fmt: skip

    # ---- drain
    for argv, fld, value in (
        (["--timeout-seconds", "nan"], "--timeout-seconds", "nan"), (["--timeout-seconds", "-1"], "--timeout-seconds",
                                                                    "-1"),
        (["--timeout-seconds", "inf"], "--timeout-seconds", "inf"), (["--timeout-seconds", "soon"], "--timeout-seconds",
                                                                     "soon"),
        (["--target", "foo:bar"], "--target", "foo:bar"), (["--target", ":5"], "--target", ":5"),
        (["--target", "127.0.0.1:0"], "--target", "127.0.0.1:0"), (["--target", ""], "--target", None),
        (["--target", "/tmp/x.sock", "--token-file", "/nonexistent/token"], "--token-file", "/nonexistent/token"),
    ):  # fmt: skip
        add("drain", argv, fld, value, own_process=argv == ["--timeout-seconds", "nan"])
    cases.append(cli_case("drain", "a budget above the sidecar's --drain-seconds", lambda e: [
        "drain", "--target", e.fresh.local_target.removeprefix("unix://"), "--timeout-seconds", "1e9"],
        "--timeout-seconds", "1000000000", then=_not_draining, own_process=True))  # fmt: skip
    cases.append(cli_case("drain", "no sidecar at --target", ["drain", "--target", "/nonexistent/kvxfer.sock"],
                          "--target", "/nonexistent/kvxfer.sock", expect="exit 1", own_process=True))  # fmt: skip

    # ---- demo (refused before any process starts)
    for argv, fld, value in (
        (["--prefill-tp", "0"], "--prefill-tp", "0"), (["--kind", "ssm"], "--kind", "ssm"),
        (["--layout", "XYZ"], "--layout", "XYZ"), (["--backend", "rdma"], "--backend", "rdma"),
        (["--min-tokens", "900", "--max-tokens", "100"], "--min-tokens", "900"),
        (["--prefill-tp", "3"], "--kv-heads", "8"), (["--requests", "0"], "--requests", "0"),
        (["--dtype", "fp9"], "--dtype", "fp9"), (["--kv-heads", "2", "--decode-tp", "3"], "--decode-tp", "3"),
    ):  # fmt: skip
        add("demo", argv, fld, value, own_process=argv == ["--prefill-tp", "0"])

    # ---- bench
    for target, argv, fld, value in (
        ("bench topology", ["--layers", "0"], "--layers", "0"), ("bench topology", ["--blocks", "4"], "--blocks", "4"),
        ("bench topology", ["--repeat", "0"], "--repeat", "0"), ("bench topology", ["--json", "1"], "--json", "1"),
        ("bench transport", ["--backend", "foo"], "--backend", "foo"),
        ("bench transport", ["--size-mib", "0"], "--size-mib", "0"),
        ("bench transport", ["--layers", "-2"], "--layers", "-2"),
        ("bench transport", ["--repeat", "x"], "--repeat", "x"),
    ):  # fmt: skip
        add(target, argv, fld, value, own_process=argv == ["--layers", "0"])
    cases.append(cli_case("bench", "no such benchmark", ["bench", "nosuch"], "nosuch", None))
    cases.append(cli_case("", "no such command", ["nosuch"], "nosuch", None))
    return cases


# ---------------------------------------------------------------------------- the chart
def _build_renderer() -> tuple[Path | None, str]:
    """tools/helm-render, built (or found built) as tests/deploy builds it."""
    given = os.environ.get("KVXFER_HELM_RENDER")
    if given:
        return Path(given), ""
    base = Path(os.environ.get("KVXFER_HELM_RENDER_DIR", Path(tempfile.gettempdir()) / "kvxfer-helm-render"))
    out = subprocess.run([str(ROOT / "tools" / "helm-render" / "build.sh"), str(base / "helm-render")],
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    if out.returncode != 0:
        return None, f"building tools/helm-render failed: {out.stdout}{out.stderr}"
    return base / "helm-render", ""


def _merge(base: Any, over: Any) -> Any:
    """Helm's coalescing of values: maps merge deeply, a null deletes the key, anything else replaces."""
    if not isinstance(base, dict) or not isinstance(over, dict):
        return copy.deepcopy(over)
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


def _schema_errors(values: Mapping[str, Any]) -> list[str]:
    """What ``helm install`` says of values that break values.schema.json: ``<path>: <why>`` each."""
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    merged = _merge(yaml.safe_load((CHART / "values.yaml").read_text()), dict(values))
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
        for e in sorted(validator.iter_errors(merged), key=lambda e: list(map(str, e.absolute_path)))
    ]


def chart_case(name: str, values: Mapping[str, Any], expect: str, fld: str, value: str | None) -> Case:
    """Chart values: refused by the schema (``schema``) or, past it, by the templates (``render``)."""

    async def run(env: Env) -> tuple[str, str]:
        errors = _schema_errors(values)
        if errors:
            return "schema", "\n".join(errors)
        if env.renderer is None:
            return "no renderer", env.renderer_error
        path = env.tmp / f"values-{abs(hash(name))}.yaml"
        path.write_text(yaml.safe_dump(dict(values)))
        proc = await asyncio.create_subprocess_exec(
            str(env.renderer), "-chart", str(CHART), "-release-name", "kvxfer", "-namespace", "kvxfer", "-f", str(path),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        _out, err = await proc.communicate()
        return ("render" if proc.returncode else "accepted"), err.decode(errors="replace")

    return Case("chart", "values", name, expect, fld, value, run)


def chart_cases() -> list[Case]:
    """Helm chart values: the schema's refusals, then the templates' (which see all values at once)."""
    s, r = "schema", "render"
    rows: list[tuple[str, dict[str, Any], str, str, str | None]] = [
        ("unknown top-level key", {"replica": 2}, s, "replica", None),
        ("unknown key in a role", {"decode": {"replicaCount": 2}}, s, "replicaCount", None),
        ("unknown key deep down", {"sidecar": {"ucx": {"tlss": "rc"}}}, s, "tlss", None),
        ("replicas not a number", {"prefill": {"replicas": "two"}}, s, "prefill.replicas", "two"),
        ("negative replicas", {"prefill": {"replicas": -1}}, s, "prefill.replicas", "-1"),
        ("peer port a string", {"sidecar": {"ports": {"peer": "50051"}}}, s, "sidecar.ports.peer", "50051"),
        ("peer port 0", {"sidecar": {"ports": {"peer": 0}}}, s, "sidecar.ports.peer", "0"),
        ("peer port 70000", {"sidecar": {"ports": {"peer": 70000}}}, s, "sidecar.ports.peer", "70000"),
        ("metrics port 0", {"sidecar": {"ports": {"metrics": 0}}}, s, "sidecar.ports.metrics", "0"),
        ("data port 70000", {"sidecar": {"ports": {"data": 70000}}}, s, "sidecar.ports.data", "70000"),
        ("backend rdma", {"sidecar": {"backend": "rdma"}}, s, "sidecar.backend", "rdma"),
        ("mooncake protocol udp", {"sidecar": {"mooncake": {"protocol": "udp"}}}, s, "sidecar.mooncake.protocol",
         "udp"),
        ("hostNetwork a string", {"hostNetwork": "false"}, s, "hostNetwork", "false"),
        ("image tag latest", {"image": {"tag": "latest"}}, s, "image.tag", "latest"),
        ("env entry with 'val'", {"extraEnv": [{"name": "A", "val": "b"}]}, s, "val", None),
        ("rdma resource count a word", {"rdma": {"resources": {"rdma/ib": "one"}}}, s, "rdma.resources.rdma/ib",
         "one"),
        ("tensor parallel 0", {"vllm": {"tensorParallelSize": 0}}, s, "vllm.tensorParallelSize", "0"),
        ("pipeline parallel a string", {"decode": {"vllm": {"pipelineParallelSize": "2"}}}, s,
         "decode.vllm.pipelineParallelSize", "2"),
        ("net devices by rank not a list", {"sidecar": {"ucx": {"netDevicesByRank": "mlx5_0:1"}}}, s,
         "sidecar.ucx.netDevicesByRank", "mlx5_0:1"),
        ("message size below the sidecar's minimum", {"sidecar": {"maxMessageBytes": 1024}}, s,
         "sidecar.maxMessageBytes", "1024"),
        ("lease above the sidecar's maximum", {"sidecar": {"leaseSeconds": 100000}}, s, "sidecar.leaseSeconds",
         "100000"),
        ("lease 0", {"sidecar": {"leaseSeconds": 0}}, s, "sidecar.leaseSeconds", "0"),
        ("transfer timeout negative", {"sidecar": {"transferTimeoutSeconds": -1}}, s, "sidecar.transferTimeoutSeconds",
         "-1"),
        ("drain seconds a string", {"sidecar": {"drainSeconds": "20s"}}, s, "sidecar.drainSeconds", "20s"),
        ("log level loud", {"sidecar": {"logLevel": "loud"}}, s, "sidecar.logLevel", "loud"),
        ("log format xml", {"sidecar": {"logFormat": "xml"}}, s, "sidecar.logFormat", "xml"),
        ("variant tpu", {"variant": "tpu"}, s, "variant", "tpu"),
        ("tls enabled without a secret", {"tls": {"enabled": True}}, r, "tls.secretName", None),
        ("auth off without mutual TLS", {"auth": {"enabled": False}}, r, "auth.enabled", None),
        ("metrics token without auth", {"auth": {"enabled": False}, "insecure": True}, r, "metrics.auth", None),
        ("two monitors", {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}, r,
         "podMonitor", None),
        ("data port equal to rank 1's peer port", {"vllm": {"tensorParallelSize": 2}, "sidecar": {"ports": {
            "data": 50052}}}, r, "sidecar.ports.data", "50052"),
        ("peer ports past 65535", {"vllm": {"tensorParallelSize": 8}, "sidecar": {"ports": {"peer": 65530}}}, r,
         "sidecar.ports.peer", "65536"),
        ("net devices for 2 of 4 ranks", {"vllm": {"tensorParallelSize": 4}, "sidecar": {"ucx": {
            "netDevicesByRank": ["mlx5_0:1", "mlx5_1:1"]}}}, r, "sidecar.ucx.netDevicesByRank", "2 entries"),
        ("extraArgs sets a per-rank flag", {"sidecar": {"extraArgs": ["--local-socket=/run/kvxfer/kvxfer.sock"]}}, r,
         "--local-socket", None),
        ("grace period not above the drain", {"terminationGracePeriodSeconds": 20}, r,
         "terminationGracePeriodSeconds", "20"),
    ]  # fmt: skip
    return [chart_case(*row) for row in rows]


def all_cases(surfaces: Sequence[str] = SURFACES) -> list[Case]:
    """Every case of the given surfaces, in order."""
    makers = {"local": local_cases, "peer": peer_cases, "cli": cli_cases, "chart": chart_cases}
    return [c for s in surfaces for c in makers[s]()]


# ============================================================================ running
@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The sidecars' logs would drown the table: only errors of kvxfer's own loggers, while the cases run."""
    with contextlib.suppress(ImportError):
        import nixl  # noqa: F401 - it sets its logger's level when first imported: before ours
    loggers = [logging.getLogger(name) for name in ("kvxfer", "nixl")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


async def run_cases(cases: Sequence[Case], tmp: Path, *, parallel: int = 2) -> list[Outcome]:
    """Run ``cases`` against fresh sidecars; calls run one at a time, processes ``parallel`` at a time."""
    sem = asyncio.Semaphore(parallel)

    async def one(c: Case) -> Outcome:
        t0 = time.monotonic()
        try:
            got, message = await c.run(env)
        except Exception as exc:  # a case that crashed is a wrong answer, not the end of the inventory
            got, message = f"crashed: {type(exc).__name__}", str(exc)
        return Outcome(c, got, message, time.monotonic() - t0)

    async def in_process(c: Case) -> Outcome:
        async with sem:
            return await one(c)

    with _quiet():
        env = await start_env(tmp)
        try:
            calls = [await one(c) for c in cases if c.surface in ("local", "peer")]
            others = await asyncio.gather(*(in_process(c) for c in cases if c.surface not in ("local", "peer")))
        finally:
            await close_env(env)
    by_key = {o.case.key: o for o in [*calls, *others]}
    return [by_key[c.key] for c in cases]


def run_inventory(surfaces: Sequence[str] = SURFACES, tmp: Path | None = None) -> list[Outcome]:
    """Every case of ``surfaces``; outcomes in case order."""
    cases = all_cases(surfaces)
    keys = [c.key for c in cases]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise ValueError(f"cases that are not distinct: {sorted(dupes)}")
    with tempfile.TemporaryDirectory(prefix="kvxfer-bad-") as d:
        return asyncio.run(run_cases(cases, tmp or Path(d)))


def summary(outcomes: Sequence[Outcome]) -> str:
    """The inventory's one-line figure."""
    good = sum(o.ok for o in outcomes)
    return f"{good} of {len(outcomes)} bad inputs got the right status and a message naming the field"


def _table(outcomes: Sequence[Outcome], show_all: bool) -> str:
    rows = [o for o in outcomes if show_all or not o.ok]
    lines = []
    for o in rows:
        c = o.case
        mark = "ok " if o.ok else "BAD"
        want = f"{c.expect} naming {c.field!r}" + (f" and {c.value!r}" if c.value else "")
        lines.append(f"{mark} {c.surface:5} {c.target:20.20} {c.name[:48]:48} want {want}")
        if not o.ok or show_all:
            lines.append(f"      got {o.got}: {o.message[:300]!r}")
    by_surface: dict[str, list[bool]] = {}
    for o in outcomes:
        by_surface.setdefault(o.case.surface, []).append(o.ok)
    lines.append("  ".join(f"{s}: {sum(v)}/{len(v)}" for s, v in by_surface.items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the inventory and print what went wrong (or everything with --all) and the summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--surface", default=",".join(SURFACES), help="comma-separated: local, peer, cli, chart")
    p.add_argument("--json", action="store_true", help="one JSON object per case, then the summary")
    p.add_argument("--all", action="store_true", help="list every case, not only the wrong ones")
    args = p.parse_args(argv)
    surfaces = [s.strip() for s in args.surface.split(",") if s.strip()]
    unknown = sorted(set(surfaces) - set(SURFACES))
    if unknown:
        p.error(f"--surface: unknown {unknown}; known: {', '.join(SURFACES)}")
    outcomes = run_inventory(surfaces)
    if args.json:
        for o in outcomes:
            c = o.case
            row = {"surface": c.surface, "target": c.target, "case": c.name, "expect": c.expect, "field": c.field,
                   "value": c.value, "got": o.got, "message": o.message, "ok": o.ok}  # fmt: skip
            print(json.dumps(row))
    else:
        print(_table(outcomes, args.all))
    print(summary(outcomes))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

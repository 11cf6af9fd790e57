"""The worker -> sidecar hop alone: one small ``Pull`` round trip over each candidate channel, in one run.

A server process (as a sidecar is one) answers every ``Pull`` with a canned ``PullResponse``
(it parses the request, so the hop's serialization is all there); the caller plays the worker.
The real ``kvxfer.v1.PullRequest`` / ``PullResponse`` messages are used. Variants:

* ``grpc_aio_facade`` (a): grpc.aio client on a private uvloop thread, called from the caller's
  thread through ``run_coroutine_threadsafe``: what :class:`kvxfer.client.Client` and the vLLM
  worker do today. The ratio column is to this one.
* ``grpc_aio_inloop``: the same grpc.aio client timed inside its loop (an :class:`AsyncClient`
  caller already on the loop), so the thread hand-off's share shows.
* ``grpc_sync`` (b): the sync gRPC stub called on the caller's thread.
* ``frame_blocking`` (c): length-prefixed protobuf frames on a Unix stream socket, a blocking socket
  on the caller's thread; the server is asyncio/uvloop.
* ``frame_facade`` / ``frame_inloop``: the same frames from an asyncio protocol on the uvloop thread
  (called through ``run_coroutine_threadsafe``, or timed inside the loop).
* ``shm_eventfd`` (d): a shared-memory ring in each direction with an eventfd doorbell; the server
  waits on the doorbell in its event loop (``add_reader``), the caller blocks reading its eventfd.
* ``shm_spin``: the same rings, both sides busy-polling (no doorbell; ``sched_yield`` between
  polls, else the spinning thread holds the GIL from its process's other threads for whole 5 ms
  switch intervals): the lower bound of a ring, at the price of a core per side while it spins.

Variants run interleaved in rounds (one batch of calls each, in a shuffled order per round) so
that the machine's noise hits all of them. Per variant: p50/p99 of the round trip, its ratio to
(a), and CPU time per call of the caller process and the server process (both over every thread).

    python bench/local_hop.py [--rounds 25] [--calls 200] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import mmap
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import uvloop

from kvxfer.wire import local_pb2, local_pb2_grpc
from kvxfer.wire.convert import blocks_to_proto

PULL_METHOD = "/" + local_pb2.DESCRIPTOR.services_by_name["Local"].full_name + "/Pull"
#: Frame header on the stream socket: payload length, call id (echoed in the answer).
HEADER = struct.Struct("<IQ")
#: Idle time before each call (``--gap-ms``): a worker calls its sidecar between steps, not back to
#: back, and a thread that slept for milliseconds may take far longer to wake than one that spun.
GAP_S = 0.0


def _gap() -> None:
    if GAP_S:
        time.sleep(GAP_S)


#: One ring: head (written by the producer), tail (by the consumer), spin flag; then the slots.
RING_HEAD = struct.Struct("<QQQ")
RING_HEADER_BYTES = 64
SLOTS = 16
SLOT_BYTES = 4096
LEN = struct.Struct("<I")
RING_BYTES = RING_HEADER_BYTES + SLOTS * SLOT_BYTES
TOKEN = "t" * 32  # sent as gRPC metadata, as a deployment with --token-file does


def sample_request(i: int = 0) -> local_pb2.PullRequest:
    """A Pull as the vLLM connector sends it: one group of 16 blocks, both sides named."""
    ids = list(range(100, 116))
    return local_pb2.PullRequest(
        request_id=f"cmpl-{i:08d}-0", remote_addresses=["10.0.0.17:50051"], remote_blocks=blocks_to_proto({"kv": ids}),
        local_blocks=blocks_to_proto({"kv": ids}), wait=True, timeout_seconds=30.0,
    )  # fmt: skip


def canned_response() -> bytes:
    """What the server answers every Pull with."""
    resp = local_pb2.PullResponse(transfer_id="0123456789abcdef", request_id="cmpl-00000000-0", done=True)
    st = resp.stats
    st.bytes, st.descriptors, st.duration_seconds, st.data_seconds, st.fetch_seconds = 2097152, 4, 4e-4, 2e-4, 1e-4
    st.remote_ranks.append(0)
    return bytes(resp.SerializeToString())


# ============================================================================ rings
class Ring:
    """A single-producer single-consumer ring of fixed slots in a shared mapping (x86: stores stay in order)."""

    def __init__(self, buf: mmap.mmap, offset: int) -> None:
        self.view = memoryview(buf)[offset : offset + RING_BYTES]

    def put(self, payload: bytes) -> None:
        head, tail, _ = RING_HEAD.unpack_from(self.view, 0)
        if head - tail >= SLOTS or len(payload) > SLOT_BYTES - LEN.size:
            raise RuntimeError("ring full or message too large")
        at = RING_HEADER_BYTES + (head % SLOTS) * SLOT_BYTES
        LEN.pack_into(self.view, at, len(payload))
        self.view[at + LEN.size : at + LEN.size + len(payload)] = payload
        struct.pack_into("<Q", self.view, 0, head + 1)  # publish after the payload is in place

    def get(self) -> bytes | None:
        head, tail, _ = RING_HEAD.unpack_from(self.view, 0)
        if head == tail:
            return None
        at = RING_HEADER_BYTES + (tail % SLOTS) * SLOT_BYTES
        (n,) = LEN.unpack_from(self.view, at)
        out = bytes(self.view[at + LEN.size : at + LEN.size + n])
        struct.pack_into("<Q", self.view, 8, tail + 1)
        return out

    @property
    def spin(self) -> bool:
        return bool(struct.unpack_from("<Q", self.view, 16)[0])

    @spin.setter
    def spin(self, on: bool) -> None:
        struct.pack_into("<Q", self.view, 16, int(on))


def _rings(path: str) -> tuple[mmap.mmap, list[Ring]]:
    """Four rings in one file: doorbell requests, doorbell answers, spin requests, spin answers."""
    fd = os.open(path, os.O_RDWR)
    try:
        buf = mmap.mmap(fd, 4 * RING_BYTES)
    finally:
        os.close(fd)
    return buf, [Ring(buf, i * RING_BYTES) for i in range(4)]


# ============================================================================ server process
def serve(sock_dir: str, ring_path: str, efd_req: int, efd_resp: int) -> None:
    """The sidecar stand-in: answers Pull on gRPC, on frames, and on both ring pairs."""
    canned = canned_response()
    parse = local_pb2.PullRequest.FromString

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def pull(raw: bytes, _ctx: Any) -> bytes:
            parse(raw)
            return canned

        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(pull)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(PULL_METHOD.split("/")[1], {"Pull": handler}),)
        )
        server.add_insecure_port(f"unix://{sock_dir}/grpc.sock")
        await server.start()

        class Frames(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.t: Any = transport
                self.buf = bytearray()

            def data_received(self, data: bytes) -> None:
                self.buf += data
                for call, payload in _complete_frames(self.buf):
                    parse(payload)
                    self.t.write(HEADER.pack(len(canned), call) + canned)

        # Kept referenced: uvloop closes a server object that is garbage-collected.
        frames = await loop.create_unix_server(Frames, f"{sock_dir}/frames.sock")

        _mapping, (req, resp, spin_req, spin_resp) = _rings(ring_path)  # the views keep it mapped

        def doorbell() -> None:
            os.read(efd_req, 8)
            while (raw := req.get()) is not None:
                parse(raw)
                resp.put(canned)
                os.write(efd_resp, (1).to_bytes(8, "little"))

        loop.add_reader(efd_req, doorbell)

        def spinner() -> None:
            # Spins only while the caller's flag is up (its own round), else sleeps in short naps so
            # that it costs the other variants nothing measurable.
            while True:
                if not spin_req.spin:
                    time.sleep(0.002)
                    continue
                raw = spin_req.get()
                if raw is None:
                    os.sched_yield()  # as the caller: a pure spin would hold the GIL for 5 ms slices
                else:
                    parse(raw)
                    spin_resp.put(canned)

        threading.Thread(target=spinner, daemon=True).start()
        print("ready", flush=True)
        async with frames:
            await asyncio.Event().wait()

    uvloop.run(main())


# ============================================================================ caller side
class Caller:
    """Every variant's client, all set up once, on the caller's thread and one private uvloop thread."""

    def __init__(self, sock_dir: str, ring_path: str, efd_req: int, efd_resp: int) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.md = (("authorization", f"Bearer {TOKEN}"),)
        self.grpc_target = f"unix://{sock_dir}/grpc.sock"

        async def setup() -> None:
            self.aio_channel = grpc.aio.insecure_channel(self.grpc_target)
            self.aio_stub = local_pb2_grpc.LocalStub(self.aio_channel)
            self.frames = await FrameClient.connect(f"{sock_dir}/frames.sock")

        self.run(setup())
        self.sync_channel = grpc.insecure_channel(self.grpc_target)
        self.sync_stub = local_pb2_grpc.LocalStub(self.sync_channel)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(f"{sock_dir}/frames.sock")
        self.calls = 0
        self.buf, (self.req, self.resp, self.spin_req, self.spin_resp) = _rings(ring_path)
        self.efd_req, self.efd_resp = efd_req, efd_resp

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # -- one timed batch per variant: a list of round-trip seconds
    def variants(self) -> dict[str, Callable[[list[local_pb2.PullRequest]], list[float]]]:
        return {
            "grpc_aio_facade": self.grpc_aio_facade,
            "grpc_aio_inloop": self.grpc_aio_inloop,
            "grpc_sync": self.grpc_sync,
            "frame_blocking": self.frame_blocking,
            "frame_blocking_spin": self.frame_blocking_spin,
            "frame_facade": self.frame_facade,
            "frame_inloop": self.frame_inloop,
            "shm_eventfd": self.shm_eventfd,
            "shm_spin": self.shm_spin,
        }

    def grpc_aio_facade(self, reqs: list[local_pb2.PullRequest]) -> list[float]:
        out = []
        for r in reqs:
            _gap()
            t = time.perf_counter()
            self.run(self._aio_pull(r))
            out.append(time.perf_counter() - t)
        return out

    async def _aio_pull(self, r: local_pb2.PullRequest) -> local_pb2.PullResponse:
        # As AsyncClient does: the call is made on the loop, by a coroutine the caller submitted.
        resp: local_pb2.PullResponse = await self.aio_stub.Pull(r, timeout=31.0, metadata=self.md)
        return resp

    def grpc_aio_inloop(self, reqs: list[local_pb2.PullRequest]) -> list[float]:
        result: list[float] = self.run(_timed_async(lambda r: self.aio_stub.Pull(r, timeout=31.0, metadata=self.md),
                                                    reqs))  # fmt: skip
        return result

    def grpc_sync(self, reqs: list[local_pb2.PullRequest]) -> list[float]:
        return _timed(lambda r: self.sync_stub.Pull(r, timeout=31.0, metadata=self.md), reqs)

    def _send_frame(self, r: local_pb2.PullRequest) -> None:
        self.calls += 1
        payload = r.SerializeToString()
        self.sock.sendall(HEADER.pack(len(payload), self.calls) + payload)

    def frame_blocking(self, reqs: list[local_pb2.PullRequest]) -> list[float]:
        out = []
        for r in reqs:
            _gap()
            t = time.perf_counter()
            self._send_frame(r)
            head = _recv_exactly(self.sock, HEADER.size)
            n, call = HEADER.unpack(head)
            assert call == self.calls
            local_pb2.PullResponse.FromString(_recv_exactly(self.sock, n))
            out.append(time.perf_counter() - t)
        return out

    def frame_blocking_spin(self, reqs: list[local_pb2.PullRequest]) -> list[float]:
        """frame_blocking whose caller polls its socket for the answer instead of sleeping in recv."""
        out = []
        for r in reqs:
            _gap()
            t = time.perf_counter()
            self._send_frame(r)
            buf = b""
            while len(buf) < HEADER.size or len(buf) < HEADER.size + HEADER.unpack_from(buf)[0]:
                try:
                    buf += self.sock.recv(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
            n, call = HEADER.unpack_from(buf)
            assert call == self.calls
            local_pb2.PullResponse.FromString(buf[HEADER.size : HEADER.size + n])
            out.append(time.perf_counter() - t)
        return out

    def frame_facade(self, reqs: list[local_pb2.PullRequest]) -> list[float]:
        return _timed(lambda r: self.run(self.frames.pull(r)), reqs)

    def frame_inloop(self, reqs: list[local_pb2.PullRequest]) -> list[float]:
        result: list[float] = self.run(_timed_async(self.frames.pull, reqs))
        return result

    def shm_eventfd(self, reqs: list[local_pb2.PullRequest]) -> list[float]:
        out = []
        one = (1).to_bytes(8, "little")
        for r in reqs:
            _gap()
            t = time.perf_counter()
            self.req.put(r.SerializeToString())
            os.write(self.efd_req, one)
            while True:
                os.read(self.efd_resp, 8)  # blocks until the server rings back
                raw = self.resp.get()
                if raw is not None:
                    break
            local_pb2.PullResponse.FromString(raw)
            out.append(time.perf_counter() - t)
        return out

    def shm_spin(self, reqs: list[local_pb2.PullRequest]) -> list[float]:
        out = []
        self.spin_req.spin = True
        time.sleep(0.005)  # the server's spinner wakes from its nap
        try:
            for r in reqs:
                t = time.perf_counter()
                self.spin_req.put(r.SerializeToString())
                while (raw := self.spin_resp.get()) is None:
                    os.sched_yield()  # lets go of the GIL (and the core, if anyone else wants it)
                local_pb2.PullResponse.FromString(raw)
                out.append(time.perf_counter() - t)
        finally:
            self.spin_req.spin = False
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.aio_channel.close())
            self.run(self.frames.close())
        self.sync_channel.close()
        self.sock.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _complete_frames(buf: bytearray) -> Iterator[tuple[int, bytes]]:
    """(call id, payload) of each whole frame at the front of ``buf``, removed from it as it is read."""
    while len(buf) >= HEADER.size:
        n, call = HEADER.unpack_from(buf, 0)
        if len(buf) < HEADER.size + n:
            return
        payload = bytes(buf[HEADER.size : HEADER.size + n])
        del buf[: HEADER.size + n]
        yield call, payload


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("server closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _timed(call: Callable[[local_pb2.PullRequest], object], reqs: list[local_pb2.PullRequest]) -> list[float]:
    """Seconds of each ``call(request)``, one after the other."""
    out = []
    for r in reqs:
        _gap()
        t = time.perf_counter()
        call(r)
        out.append(time.perf_counter() - t)
    return out


async def _timed_async(
    call: Callable[[local_pb2.PullRequest], Awaitable[object]], reqs: list[local_pb2.PullRequest]
) -> list[float]:
    """Seconds of each ``await call(request)``, one after the other."""
    out = []
    for r in reqs:
        if GAP_S:
            await asyncio.sleep(GAP_S)
        t = time.perf_counter()
        await call(r)
        out.append(time.perf_counter() - t)
    return out


class FrameClient(asyncio.Protocol):
    """Frames from an asyncio protocol: calls in flight are matched to answers by call id."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiting: dict[int, asyncio.Future[bytes]] = {}
        self.calls = 0
        self.transport: Any = None

    @classmethod
    async def connect(cls, path: str) -> FrameClient:
        _, proto = await asyncio.get_running_loop().create_unix_connection(cls, path)
        return proto

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        for call, payload in _complete_frames(self.buf):
            fut = self.waiting.pop(call, None)
            if fut is not None and not fut.done():
                fut.set_result(payload)

    async def pull(self, req: local_pb2.PullRequest) -> local_pb2.PullResponse:
        self.calls += 1
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiting[self.calls] = fut
        payload = req.SerializeToString()
        self.transport.write(HEADER.pack(len(payload), self.calls) + payload)
        return local_pb2.PullResponse.FromString(await fut)

    async def close(self) -> None:
        self.transport.close()


def _server_cpu_ns(pid: int) -> int:
    """CPU nanoseconds of every thread of ``pid`` so far (schedstat: ns resolution)."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        with contextlib.suppress(OSError), open(path) as f:
            total += int(f.read().split()[0])
    return total


# ============================================================================ driver
def run(rounds: int, calls: int, seed: int, only: list[str] | None = None) -> dict[str, Any]:
    """Start the server, run every variant ``rounds`` times ``calls`` calls, interleaved; the figures."""
    sock_dir = tempfile.mkdtemp(prefix="kx-hop-")
    ring_path = os.path.join(sock_dir, "rings")
    with open(ring_path, "wb") as f:
        f.truncate(4 * RING_BYTES)
    efd_req, efd_resp = os.eventfd(0), os.eventfd(0)
    here = Path(__file__).resolve()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, str(here), "--serve", sock_dir, ring_path, str(efd_req), str(efd_resp)],
        pass_fds=(efd_req, efd_resp), stdout=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    caller: Caller | None = None
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit("the server process did not start")
        caller = Caller(sock_dir, ring_path, efd_req, efd_resp)
        variants = {k: v for k, v in caller.variants().items() if not only or k in only}
        rng = random.Random(seed)
        reqs = [sample_request(i) for i in range(calls)]
        for fn in variants.values():  # warm-up: connections, first-call paths
            fn(reqs[:20])
        lat: dict[str, list[float]] = {k: [] for k in variants}
        client_cpu = dict.fromkeys(variants, 0.0)
        server_cpu = dict.fromkeys(variants, 0)
        for _ in range(rounds):
            order = list(variants)
            rng.shuffle(order)
            for name in order:
                c0, s0 = time.process_time(), _server_cpu_ns(proc.pid)
                lat[name] += variants[name](reqs)
                client_cpu[name] += time.process_time() - c0
                server_cpu[name] += _server_cpu_ns(proc.pid) - s0
    finally:
        if caller is not None:
            caller.close()
        proc.kill()
        proc.wait()
        os.close(efd_req)
        os.close(efd_resp)
        with contextlib.suppress(OSError):
            for p in Path(sock_dir).iterdir():
                p.unlink()
            os.rmdir(sock_dir)
    base = float(np.percentile(lat.get("grpc_aio_facade") or next(iter(lat.values())), 50))
    out: dict[str, Any] = {}
    for name, xs in lat.items():
        us = np.array(xs) * 1e6
        n = len(xs)
        out[name] = {
            "calls": n,
            "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()),
            "ratio_p50_to_grpc_aio_facade": float(np.percentile(us, 50)) / (base * 1e6),
            "client_cpu_us_per_call": client_cpu[name] * 1e6 / n,
            "server_cpu_us_per_call": server_cpu[name] / 1e3 / n,
        }
    return {
        "rounds": rounds,
        "calls_per_round": calls,
        "request_bytes": sample_request().ByteSize(),
        "response_bytes": len(canned_response()),
        "cpus": os.cpu_count(),
        "variants": out,
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--serve":  # the server process (started by run())
        serve(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--calls", type=int, default=200, help="calls per variant per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", help="variants to run (default: all)")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each call (the caller sleeps)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    global GAP_S
    GAP_S = a.gap_ms / 1e3
    if a.rounds < 1 or a.calls < 20:
        ap.error("--rounds must be >= 1 and --calls >= 20")
    r = run(a.rounds, a.calls, a.seed, a.only)
    if a.json:
        print(json.dumps(r))
        return 0
    print(
        f"Pull round trip ({r['request_bytes']} B request, {r['response_bytes']} B answer), "
        f"{r['rounds']} rounds x {r['calls_per_round']} calls per variant, interleaved, {r['cpus']} CPUs"
    )
    print(f"{'variant':18s} {'p50 us':>8s} {'p99 us':>8s} {'/ (a)':>6s} {'caller CPU us':>14s} {'server CPU us':>14s}")
    for name, v in r["variants"].items():
        print(
            f"{name:18s} {v['p50_us']:8.1f} {v['p99_us']:8.1f} {v['ratio_p50_to_grpc_aio_facade']:6.2f} "
            f"{v['client_cpu_us_per_call']:14.1f} {v['server_cpu_us_per_call']:14.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Probe: can a READ from a SIGSTOPped TCP peer still land after kvxfer gave up on it? (NIXL, Mooncake).

Run from the repository root: ``python -m bench.fence_probe nixl keep|release|remove|kill`` or
``python -m bench.fence_probe mooncake status|kill``. Each scenario prints what the library said and
when, and whether local bytes changed after that point. Findings: docs/transports.md.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import cast

os.environ.setdefault("UCX_MODULES", "^efa")
os.environ.setdefault("UCX_TLS", "tcp")

import numpy as np

from kvxfer.transport import TransportConfig, create_transport
from tests.transport.peer import Cache, cache_layout
from tests.transport.test_transports import Peer, descriptors, freeze


def log(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:7.3f}s] {msg}", flush=True)


def landed(cache: Cache) -> int:
    return int(sum(int(np.count_nonzero(r)) for r in cache.regions))


def nixl(scenario: str) -> None:
    t = create_transport("nixl", f"probe-{os.getpid()}", TransportConfig())
    cache = Cache(cache_layout(), None)
    t.register(cache.table)
    peer = Peer("nixl", f"probe-peer-{os.getpid()}", 7)
    name = t.add_peer(peer.metadata)
    ld, rd, _ = descriptors(cache, peer)
    agent = t._agent  # type: ignore[attr-defined]
    for r in cache.regions:
        r[:] = 0
    pid = peer.proc.pid
    assert pid
    freeze(pid)
    t0 = time.monotonic()
    op = "WRITE" if scenario.startswith("write") else "READ"
    if op == "WRITE":
        for r, e in zip(cache.regions, peer.expected.regions, strict=True):
            r[:] = 255 - e  # differs from every byte the peer holds
    h = agent.initialize_xfer(op, agent.get_xfer_descs(ld, "DRAM"), agent.get_xfer_descs(rd, "DRAM"), name, b"")
    log(t0, f"posted: {agent.transfer(h)}; nonzero bytes {landed(cache)} of {int(ld[:, 1].sum())}")
    stop_s = float(os.environ.get("PROBE_STOP_S", "1"))
    time.sleep(stop_s)
    log(t0, f"peer stopped {stop_s:g} s: state {agent.check_xfer_state(h)}, nonzero {landed(cache)}")
    if scenario in ("release", "remove"):
        try:
            agent.release_xfer_handle(h)
            log(t0, "release_xfer_handle of the PROC handle: returned")
        except Exception as exc:
            log(t0, f"release_xfer_handle raised {type(exc).__name__}: {exc}")
        h = None
    if scenario in ("remove", "remove-keep"):
        agent.remove_remote_agent(name)
        log(t0, "remove_remote_agent returned")
        if h is not None:
            try:
                log(t0, f"state after remove: {agent.check_xfer_state(h)}")
            except Exception as exc:
                log(t0, f"check_xfer_state after remove raised {type(exc).__name__}: {exc}")
    if op == "WRITE":
        if scenario == "write-release":
            agent.release_xfer_handle(h)
            h = None
            log(t0, "released the PROC handle")
        os.kill(pid, signal.SIGCONT)
        tc = time.monotonic()
        state: str | None = "PROC"
        while h is not None and state == "PROC" and time.monotonic() - tc < 10:
            state = agent.check_xfer_state(h)
            time.sleep(0.001)
        log(t0, f"SIGCONT; handle state {state} after {time.monotonic() - tc:.3f}s")
        time.sleep(1.0)
        changed = [
            bytes(p) != bytes(e)
            for p, e in zip(
                cast("list[bytes]", peer.ask("pages", [(0, 50), (1, 7), (3, 62)])),
                [peer.expected.page(0, 50), peer.expected.page(1, 7), peer.expected.page(3, 62)],
                strict=True,
            )
        ]
        log(t0, f"peer pages overwritten by the WRITE: {changed}")
        return
    if scenario == "kill":
        os.kill(pid, signal.SIGKILL)
        tk = time.monotonic()
        state = "PROC"
        while state == "PROC" and time.monotonic() - tk < 30:
            try:
                state = agent.check_xfer_state(h)
            except Exception as exc:
                state = f"raised {type(exc).__name__}: {exc}"
            time.sleep(0.001)
        log(t0, f"SIGKILL: state {state} after {time.monotonic() - tk:.3f}s; nonzero {landed(cache)}")
        return
    before = landed(cache)
    os.kill(pid, signal.SIGCONT)
    tc = time.monotonic()
    log(t0, f"SIGCONT; nonzero bytes then {before}")
    state = None
    while time.monotonic() - tc < 3:
        if h is not None and state in (None, "PROC"):
            try:
                state = agent.check_xfer_state(h)
            except Exception as exc:
                state = f"raised {type(exc).__name__}: {exc}"
            if state != "PROC":
                log(t0, f"handle state {state}; nonzero {landed(cache)}")
                at_terminal = landed(cache)
        time.sleep(0.01)
    log(t0, f"3 s after SIGCONT: nonzero {landed(cache)} (were {before} at SIGCONT)")
    if h is not None and state not in (None, "PROC"):
        log(t0, f"changed after the terminal state: {landed(cache) != at_terminal}")


def mooncake(scenario: str) -> None:
    t = create_transport("mooncake", f"probe-{os.getpid()}", TransportConfig())
    cache = Cache(cache_layout(), None)
    t.register(cache.table)
    peer = Peer("mooncake", f"probe-peer-{os.getpid()}", 7)
    name = t.add_peer(peer.metadata)
    session = t._peers[name]  # type: ignore[attr-defined]
    eng = t._engine  # type: ignore[attr-defined]
    ld, rd, _ = descriptors(cache, peer)
    asyncio.run(t.read(name, ld, rd, timeout=30))  # the first contact opens the peer's segment
    for r in cache.regions:
        r[:] = 0
    pid = peer.proc.pid
    assert pid
    freeze(pid)
    t0 = time.monotonic()
    op = "WRITE" if scenario == "write" else "READ"
    if op == "WRITE":
        for r, e in zip(cache.regions, peer.expected.regions, strict=True):
            r[:] = 255 - e  # differs from every byte the peer holds
    opcode = t._ops[op]  # type: ignore[attr-defined]
    batch = int(eng.batch_transfer_async(session, ld[:, 0].tolist(), rd[:, 0].tolist(), ld[:, 1].tolist(), opcode))
    log(t0, f"batch {batch} posted ({ld.shape[0]} transfers, {int(ld[:, 1].sum())} B)")
    if scenario == "kill":
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        tk = time.monotonic()
        st = 0
        while st == 0 and time.monotonic() - tk < 30:
            st = int(eng.transfer_check_status(batch))
            time.sleep(0.005)
        log(t0, f"SIGKILL: transfer_check_status {st} after {time.monotonic() - tk:.3f}s; nonzero {landed(cache)}")
        return
    st, seen = 0, list[int]()
    while time.monotonic() - t0 < float(os.environ.get("PROBE_STOP_S", "8")):
        st = int(eng.transfer_check_status(batch))
        if not seen or seen[-1] != st:
            seen.append(st)
            log(t0, f"transfer_check_status -> {st}; nonzero {landed(cache)}")
        if st != 0:
            break
        time.sleep(0.05)
    before = landed(cache)
    os.kill(pid, signal.SIGCONT)
    log(t0, f"SIGCONT; nonzero then {before}")
    time.sleep(3)
    log(t0, f"3 s after SIGCONT: nonzero {landed(cache)} (were {before})")
    if op == "WRITE":
        pages = [(0, 50), (1, 7), (3, 62)]
        got = cast("list[bytes]", peer.ask("pages", pages))
        changed = [bytes(p) != bytes(peer.expected.page(*lb)) for p, lb in zip(got, pages, strict=True)]
        log(t0, f"peer pages overwritten by the WRITE: {changed}")
    if st == 0:
        log(t0, f"transfer_check_status now {int(eng.transfer_check_status(batch))}")


if __name__ == "__main__":
    {"nixl": nixl, "mooncake": mooncake}[sys.argv[1]](sys.argv[2])
    os._exit(0)

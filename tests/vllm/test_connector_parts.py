"""The vLLM connector's vLLM-free parts against real sidecar processes (NIXL on loopback).

vLLM itself runs in tests/vllm/test_vllm_pd.py; here the scheduler and worker halves are driven
directly, with torch tensors laid out as vLLM's CPU backend lays them out (per-layer views of one
allocation, (num_blocks, kv_heads, block_size, 2*head_size), HND), so that every branch (prefix-cache
hits, failures, aborts, lease expiry, restarts) is reached deterministically.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_MODULES", "^efa")

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvxfer.harness.cluster import LocalCluster
from kvxfer.integrations.vllm.kvcache import KVCacheDescriptionError, describe_kv_caches
from kvxfer.integrations.vllm.plan import StepPlan
from kvxfer.integrations.vllm.scheduler import SchedulerSide
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.worker import SidecarUnavailableError, WorkerSide
from kvxfer.layout import Order
from kvxfer.topology import RankInfo

LAYERS, BLOCKS, HEADS, BS, HEAD = 4, 64, 2, 16, 64


def vllm_cpu_caches(seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Per-layer views of one allocation, exactly as vLLM 0.32's CPU backend hands them over."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(LAYERS, BLOCKS, HEADS, BS, 2 * HEAD, generator=g).to(dtype)
    return {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(LAYERS)}


@dataclass
class Req:
    """The fields of ``vllm.v1.request.Request`` that the scheduler side reads (a plain record)."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    status: str = "FINISHED_LENGTH_CAPPED"
    num_computed_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(log_level="info") as c:
        yield c


@pytest.fixture
def pair(cluster: LocalCluster) -> Iterator[Callable[..., Any]]:
    """Start a prefill and a decode sidecar; build each side's connector halves on demand."""
    made: list[Any] = []

    def make(**settings: Any) -> tuple[Any, ...]:
        n = len(cluster.sidecars)
        p = cluster.start_sidecar(f"p{n}", "prefill-eng", "prefill", flags=settings.pop("p_flags", ()))
        d = cluster.start_sidecar(f"d{n}", "decode-eng", "decode")
        sp = ConnectorSettings(sidecar_socket=p.local_socket, **settings)
        sd = ConnectorSettings(sidecar_socket=d.local_socket, **settings)
        pw = WorkerSide(sp, rank=RankInfo(0, 1), local_rank=0, total_kv_heads=HEADS)
        dw = WorkerSide(sd, rank=RankInfo(0, 1), local_rank=0, total_kv_heads=HEADS)
        made.extend([pw, dw])
        pk, dk = vllm_cpu_caches(1), vllm_cpu_caches(2)
        pw.register(pk)
        dw.register(dk)
        ps = SchedulerSide(sp, engine_id="vllm-p", block_size=BS)
        ds = SchedulerSide(sd, engine_id="vllm-d", block_size=BS)
        made.extend([ps, ds])
        return p, d, ps, pw, pk, ds, dw, dk

    yield make
    for m in made:
        m.close()


def wait_for(
    worker: WorkerSide, *, sending: str | None = None, recving: str | None = None
) -> tuple[set[str], set[str]]:
    """Poll ``finished()`` like vLLM does every step, until the ids show up."""
    got_s: set[str] = set()
    got_r: set[str] = set()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        s, r = worker.finished()
        got_s |= s
        got_r |= r
        if (sending is None or sending in got_s) and (recving is None or recving in got_r):
            return got_s, got_r
        time.sleep(0.02)
    raise AssertionError(f"not finished in time: sending={got_s} recving={got_r}")


def pages(kv: dict[str, torch.Tensor], ids: list[int]) -> list[np.ndarray]:
    return [t.view(torch.uint8)[ids].numpy().copy() for t in kv.values()]


def prefill_request(ps: SchedulerSide, pw: WorkerSide, rid: str, blocks: list[int], tokens: int) -> dict[str, Any]:
    req = Req(rid, list(range(tokens)), {"do_remote_decode": True}, num_computed_tokens=tokens)
    keep, params = ps.request_finished(req, blocks)
    assert keep is True
    assert params is not None
    pw.on_step(ps.build_plan())
    return params


def test_publish_then_pull_moves_exact_bytes_and_frees_the_prefill_blocks(pair: Callable[..., Any]) -> None:
    p, _d, ps, pw, pk, ds, dw, dk = pair()
    p_blocks, d_blocks = [7, 8, 9, 3, 40], [10, 11, 12, 13, 50]
    tokens = 4 * BS + 5  # the last block is partly filled
    params = prefill_request(ps, pw, "p-req", p_blocks, tokens)
    assert params["remote_block_ids"] == [p_blocks]
    assert params["kvxfer_addresses"] == [p.peer_address]
    assert params["kvxfer_engine_id"] == "prefill-eng"
    assert params["remote_request_id"] == "p-req"
    assert params["remote_num_tokens"] == tokens
    assert params["remote_block_size"] == BS
    assert f"{params['remote_host']}:{params['remote_port']}" == p.peer_address
    req = Req("d-req", list(range(tokens)), dict(params), status="RUNNING")
    assert ds.matched_tokens(req, 0) == (tokens, True)
    ds.after_alloc(req, d_blocks, tokens)
    assert req.kv_transfer_params is not None
    assert req.kv_transfer_params["do_remote_prefill"] is False
    plan = ds.build_plan()
    assert [(s.local_blocks, s.remote_blocks) for s in plan.pulls] == [(tuple(d_blocks), tuple(p_blocks))]
    untouched = pages(dk, [0, 1])
    dw.on_step(plan)
    _, recving = wait_for(dw, recving="d-req")
    assert recving == {"d-req"}
    assert dw.load_errors() == set()
    for got, want in zip(pages(dk, d_blocks), pages(pk, p_blocks), strict=True):
        assert np.array_equal(got, want)
    for got, want in zip(pages(dk, [0, 1]), untouched, strict=True):
        assert np.array_equal(got, want)
    # The decode side confirmed: the prefill worker hands the blocks back to vLLM.
    sending, _ = wait_for(pw, sending="p-req")
    assert sending == {"p-req"}
    ds.loads_finished(recving)


def test_decode_prefix_cache_hit_pulls_only_the_missing_tail(pair: Callable[..., Any]) -> None:
    _p, _d, ps, pw, pk, ds, dw, dk = pair()
    p_blocks, d_blocks = [20, 21, 22, 23], [30, 31, 32, 33]
    tokens = 4 * BS
    params = prefill_request(ps, pw, "p-hit", p_blocks, tokens)
    req = Req("d-hit", list(range(tokens)), dict(params), status="RUNNING")
    # vLLM found the first two blocks in its own prefix cache.
    assert ds.matched_tokens(req, 2 * BS) == (2 * BS, True)
    before = pages(dk, d_blocks[:2])
    ds.after_alloc(req, d_blocks, 2 * BS)
    plan = ds.build_plan()
    assert [(s.local_blocks, s.remote_blocks) for s in plan.pulls] == [((32, 33), (22, 23))]
    dw.on_step(plan)
    wait_for(dw, recving="d-hit")
    for got, want in zip(pages(dk, [32, 33]), pages(pk, [22, 23]), strict=True):
        assert np.array_equal(got, want)
    for got, want in zip(pages(dk, d_blocks[:2]), before, strict=True):
        assert np.array_equal(got, want)


def test_decode_prefix_cache_covering_everything_frees_the_prefill_copy_at_once(pair: Callable[..., Any]) -> None:
    p, _d, ps, pw, _pk, ds, dw, _dk = pair(p_flags=("--lease-seconds", "600"))
    tokens = 3 * BS
    params = prefill_request(ps, pw, "p-full", [4, 5, 6], tokens)
    req = Req("d-full", list(range(tokens)), dict(params), status="RUNNING")
    # vLLM's own prefix cache covered the whole prompt: nothing to load.
    assert ds.matched_tokens(req, tokens) == (0, False)
    ds.after_alloc(req, [30, 31, 32], 0)
    plan = ds.build_plan()
    assert plan.pulls == []
    assert [(r.request_id, r.addresses) for r in plan.drops] == [("p-full", (p.peer_address,))]
    dw.on_step(plan)
    # The prefill worker gets its blocks back now, not after the 600 s lease.
    sending, _ = wait_for(pw, sending="p-full")
    assert sending == {"p-full"}
    assert pw.link.call(pw.link.client.status())["leases"] == 0
    assert dw.load_errors() == set()


def test_failed_load_reports_its_blocks_and_other_loads_complete(pair: Callable[..., Any]) -> None:
    _p, _d, ps, pw, pk, ds, dw, dk = pair()
    good = prefill_request(ps, pw, "p-good", [1, 2], 2 * BS)
    lost = dict(good, remote_request_id="never-published")
    r_lost = Req("d-lost", list(range(2 * BS)), lost, status="RUNNING")
    r_good = Req("d-good", list(range(2 * BS)), dict(good), status="RUNNING")
    for r, blocks in ((r_lost, [40, 41]), (r_good, [42, 43])):
        assert ds.matched_tokens(r, 0) == (2 * BS, True)
        ds.after_alloc(r, blocks, 2 * BS)
    dw.on_step(ds.build_plan())
    _, recving = wait_for(dw, recving="d-lost")
    _, more = wait_for(dw, recving="d-good") if "d-good" not in recving else (set(), recving)
    # A failed load still ends (vLLM must not wait forever) and names exactly its blocks.
    assert {"d-lost", "d-good"} <= recving | more
    assert dw.load_errors() == {40, 41}
    assert dw.load_errors() == set()
    for got, want in zip(pages(dk, [42, 43]), pages(pk, [1, 2]), strict=True):
        assert np.array_equal(got, want)


def test_request_aborted_while_loading_ends_without_load_errors(pair: Callable[..., Any]) -> None:
    _p, _d, ps, pw, _pk, ds, dw, _dk = pair()
    params = prefill_request(ps, pw, "p-ab", [5], BS)
    req = Req("d-ab", list(range(BS)), dict(params, remote_request_id="p-unknown"), status="RUNNING")
    ds.matched_tokens(req, 0)
    ds.after_alloc(req, [6], BS)
    plan = ds.build_plan()
    req.status = "FINISHED_ABORTED"
    assert ds.request_finished(req, [6]) == (False, None)
    abort_plan = ds.build_plan()
    assert abort_plan.aborts == ["d-ab"]
    dw.on_step(plan)
    dw.on_step(abort_plan)
    wait_for(dw, recving="d-ab")
    # vLLM frees an aborted request's blocks itself; naming them as failed could hit a new owner.
    assert dw.load_errors() == set()


def test_lease_expiry_hands_the_blocks_back(pair: Callable[..., Any]) -> None:
    _p, _d, ps, pw, _pk, _ds, _dw, _dk = pair(lease_seconds=0.5)
    prefill_request(ps, pw, "p-exp", [3, 4], 2 * BS)
    sending, _ = wait_for(pw, sending="p-exp")
    assert sending == {"p-exp"}


def test_unusable_params_make_the_decode_side_compute_the_prompt(pair: Callable[..., Any]) -> None:
    _p, _d, _ps, _pw, _pk, ds, _dw, _dk = pair()
    base = {"do_remote_prefill": True, "remote_request_id": "x", "remote_block_ids": [[1]],
            "kvxfer_addresses": ["127.0.0.1:1"]}  # fmt: skip
    cases = [
        {k: v for k, v in base.items() if k != "remote_request_id"},
        dict(base, remote_block_ids=[["a"]]),
        dict(base, kvxfer_addresses=[]),
        dict(base, remote_block_ids=[[1]], remote_num_tokens=3 * BS),  # one block cannot hold the prompt
        dict(base, remote_block_ids=[[1, 2, 3]], remote_block_size=2 * BS),  # pages of another size
        dict(base, remote_block_ids=[[1, 2, 3]], remote_block_size="16"),
        dict(base, remote_block_ids=[[1, 2, 3]], remote_num_tokens="lots"),
    ]
    for params in cases:
        req = Req("d", list(range(3 * BS)), params, status="RUNNING")
        assert ds.matched_tokens(req, 0) == (0, False), params
    assert ds.build_plan().pulls == []


def test_prefill_not_published_when_the_request_did_not_finish_normally(pair: Callable[..., Any]) -> None:
    _p, _d, ps, _pw, _pk, _ds, _dw, _dk = pair()
    for status in ("FINISHED_ABORTED", "FINISHED_ERROR"):
        req = Req("p-x", list(range(BS)), {"do_remote_decode": True}, status=status, num_computed_tokens=BS)
        assert ps.request_finished(req, [1]) == (False, None)
    assert ps.request_finished(Req("plain", [1], None), [1]) == (False, None)
    assert ps.build_plan() == StepPlan()


def test_sidecar_missing_is_a_clear_error(tmp_path: Path) -> None:
    sock = str(tmp_path / "nobody.sock")
    w = WorkerSide(ConnectorSettings(sidecar_socket=sock, startup_timeout_seconds=0.5), rank=RankInfo(0, 1),
                   local_rank=0, total_kv_heads=HEADS)  # fmt: skip
    try:
        expected = f"sidecar_socket: no kvxfer sidecar answers at {sock} after 0.5s"
        with pytest.raises(SidecarUnavailableError, match=expected):
            w.register(vllm_cpu_caches(3))
    finally:
        w.close()


def test_sidecar_restart_re_registers_the_same_memory(cluster: LocalCluster, pair: Callable[..., Any]) -> None:
    p, _d, ps, pw, pk, ds, dw, dk = pair()
    first = pw.registration["instance_id"]
    cluster.kill_sidecar(p)
    # Same socket and peer port, new process: the worker notices on its completion stream and
    # registers its (unchanged) shared memory again.
    cluster.start_sidecar(p.name, "prefill-eng", "prefill", port=int(p.peer_address.rsplit(":", 1)[1]))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and pw.registration.get("instance_id") == first:
        time.sleep(0.1)
    assert pw.registration["instance_id"] != first
    # ... and transfers work again, with the bytes vLLM wrote before the restart.
    ps._addresses = []
    params = prefill_request(ps, pw, "p-after", [9], BS)
    req = Req("d-after", list(range(BS)), dict(params), status="RUNNING")
    ds.matched_tokens(req, 0)
    ds.after_alloc(req, [19], BS)
    dw.on_step(ds.build_plan())
    wait_for(dw, recving="d-after")
    assert dw.load_errors() == set()
    for got, want in zip(pages(dk, [19]), pages(pk, [9]), strict=True):
        assert np.array_equal(got, want)


def test_describe_refuses_what_it_cannot_move() -> None:
    kv = vllm_cpu_caches(4)
    names = list(kv)
    odd = dict(kv)
    odd[names[2]] = torch.zeros(BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.float16)
    with pytest.raises(
        KVCacheDescriptionError, match=r"kv_caches\['model.layers.2.self_attn.attn'\]: shape .* differs"
    ):
        describe_kv_caches(odd, total_kv_heads=HEADS)
    strided = {n: t.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :, :HEAD] for n, t in kv.items()}
    with pytest.raises(KVCacheDescriptionError, match="stride"):
        describe_kv_caches(strided, total_kv_heads=HEADS)
    with pytest.raises(KVCacheDescriptionError, match="no KV-cache tensors"):
        describe_kv_caches({}, total_kv_heads=HEADS)


def test_describe_reads_vllm_layouts() -> None:
    desc = describe_kv_caches(vllm_cpu_caches(5), total_kv_heads=4)
    lay = desc.layout
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_size) == (
        LAYERS, BLOCKS, BS, HEADS, HEAD)  # fmt: skip
    assert lay.order is Order.HND
    assert not lay.cross_layer
    assert lay.total_kv_heads == 4
    assert lay.page_bytes == HEADS * BS * 2 * HEAD * 2
    # NHD: the same logical shape with tokens outside heads.
    whole = torch.zeros(LAYERS, BLOCKS, BS, HEADS, 2 * HEAD, dtype=torch.float16)
    nhd = {f"l{i}": whole[i].transpose(1, 2) for i in range(LAYERS)}
    assert describe_kv_caches(nhd, total_kv_heads=HEADS).layout.order is Order.NHD
    # vLLM's cross-layer layout (BLHNC): per-layer views of one block-major allocation.
    blk = torch.zeros(BLOCKS, LAYERS, HEADS, BS, 2 * HEAD, dtype=torch.float16)
    cross = describe_kv_caches({f"l{i}": blk[:, i] for i in range(LAYERS)}, total_kv_heads=HEADS)
    assert cross.layout.cross_layer
    assert cross.layout.num_regions == 1
    assert len(cross.regions) == 1
    assert cross.regions[0].numel() == blk.numel() * 2


def test_sharing_on_cpu_keeps_tensor_identity_and_contents(pair: Callable[..., Any]) -> None:
    _p, _d, _ps, pw, pk, _ds, _dw, _dk = pair()
    # pk was moved onto shared memory by register(): same tensor objects, same values as generated.
    fresh = vllm_cpu_caches(1)
    for name, t in pk.items():
        assert torch.equal(t, fresh[name])
    assert pw.shared is not None
    assert pw.shared.buffer is not None
    buf = pw.shared.buffer
    for i, t in enumerate(pk.values()):
        assert t.data_ptr() == buf.addresses[i]
        # The segment file holds what the tensor holds: another process (the sidecar) sees it.
        raw = np.fromfile(buf.path, dtype=np.uint8, count=t.numel() * 2, offset=buf.offsets[i])
        assert np.array_equal(raw, t.view(torch.uint8).numpy().reshape(-1))
    # Writes through the tensor land in the segment (vLLM computing KV after registration).
    first = next(iter(pk.values()))
    first[5].fill_(1.5)
    raw = np.fromfile(
        buf.path, dtype=np.uint8, count=first[5].numel() * 2, offset=buf.offsets[0] + 5 * first[5].numel() * 2
    )
    assert np.array_equal(raw, first[5].view(torch.uint8).numpy().reshape(-1))


def test_heterogeneous_tp_prefill2_decode1_through_both_halves(cluster: LocalCluster) -> None:
    """A TP-2 prefill instance (one sidecar per rank) and a TP-1 decode instance: each head slice lands in place."""
    p_socks = [cluster.start_sidecar(f"tp2p-{r}", "pre-tp2", "prefill") for r in range(2)]
    d_sock = cluster.start_sidecar("tp1d-0", "dec-tp1", "decode")
    template = str(Path(p_socks[0].local_socket).parent / "tp2p-{rank}.sock")
    sp = ConnectorSettings(sidecar_socket=template)
    sd = ConnectorSettings(sidecar_socket=str(Path(d_sock.local_socket).parent / "tp1d-{rank}.sock"))
    p_workers, p_caches = [], []
    made: list[Any] = []
    try:
        for r in range(2):
            w = WorkerSide(sp, rank=RankInfo(r, 2), local_rank=r, total_kv_heads=HEADS)
            made.append(w)
            g = torch.Generator().manual_seed(10 + r)
            whole = torch.randn(LAYERS, BLOCKS, HEADS // 2, BS, 2 * HEAD, generator=g).to(torch.bfloat16)
            kv = {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(LAYERS)}
            w.register(kv)
            p_workers.append(w)
            p_caches.append(kv)
        dw = WorkerSide(sd, rank=RankInfo(0, 1), local_rank=0, total_kv_heads=HEADS)
        made.append(dw)
        dk = vllm_cpu_caches(20)
        dw.register(dk)
        ps = SchedulerSide(sp, engine_id="vllm-p", block_size=BS, tp_size=2)
        ds = SchedulerSide(sd, engine_id="vllm-d", block_size=BS)
        made.extend([ps, ds])
        p_blocks, d_blocks = [3, 4, 5, 60], [7, 8, 9, 1]
        req = Req("p-tp", list(range(4 * BS)), {"do_remote_decode": True}, num_computed_tokens=4 * BS)
        keep, params = ps.request_finished(req, p_blocks)
        assert keep is True
        assert params is not None
        # Every prefill rank's sidecar, in rank order; one engine id that all of them answer with.
        assert params["kvxfer_addresses"] == [s.peer_address for s in p_socks]
        assert params["kvxfer_engine_id"] == "pre-tp2"
        assert params["tp_size"] == 2
        plan = ps.build_plan()
        for w in p_workers:
            w.on_step(plan)
        dreq = Req("d-tp", list(range(4 * BS)), dict(params), status="RUNNING")
        assert ds.matched_tokens(dreq, 0) == (4 * BS, True)
        ds.after_alloc(dreq, d_blocks, 4 * BS)
        dw.on_step(ds.build_plan())
        wait_for(dw, recving="d-tp")
        assert dw.load_errors() == set()
        for name, t in dk.items():
            for head in range(HEADS):
                src = p_caches[head][name][p_blocks][:, 0]
                assert torch.equal(t[d_blocks][:, head].view(torch.uint8), src.view(torch.uint8)), (name, head)
        # The decode rank read both prefill ranks: each frees its blocks.
        for w in p_workers:
            wait_for(w, sending="p-tp")
    finally:
        for m in made:
            m.close()

"""The connector's vLLM-free halves against real sidecar processes (NIXL on loopback), with vLLM-made caches.

vLLM itself runs in tests/vllm/test_vllm_pd.py; here the scheduler and worker halves are driven
directly, with caches that vLLM's own planner and allocator laid out for its CPU attention backend
(:mod:`tests.vllm_inproc.engine`) and vLLM's ``Request`` objects, so that every branch (prefix-cache
hits, failures, aborts, lease expiry, restarts, heterogeneous TP) is reached deterministically.
Pages are compared through vLLM's accessors.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout as VLayout
from vllm.v1.request import RequestStatus

from kvxfer.integrations.vllm import worker as vllm_worker
from kvxfer.integrations.vllm.plan import StepPlan
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.spec import KVCacheDescriptionError
from kvxfer.integrations.vllm.worker import SidecarUnavailableError, WorkerSide
from kvxfer.layout import Order, Packing
from kvxfer.topology import RankInfo
from tests.vllm_inproc.engine import (
    CPUAttentionBackend,
    Engine,
    FlashAttentionBackend,
    GroupDef,
    attention_spec,
    build_engine,
    default_layers,
)
from tests.vllm_inproc.pd import PD, Instance, block_rows, decode_request, fill_random, prefill_request

LAYERS = default_layers("self_attn.attn", 4)
BLOCKS, HEADS, BS, HEAD = 64, 2, 32, 64


def engine(seed: int, *, tp: int = 1, rank: int = 0, layout: VLayout = VLayout.LBHNC) -> Engine:
    """One rank's caches as vLLM's CPU backend has them (LBHNC, K transposed per block and head), random cells."""
    spec = attention_spec(block_size=BS, heads=HEADS // tp, head_size=HEAD)
    eng = build_engine([GroupDef(LAYERS, spec)], layout=layout, num_blocks=BLOCKS, backend=CPUAttentionBackend,
                       isa="vec", tp_rank=rank, tp_size=tp, total_kv_heads=HEADS)  # fmt: skip
    fill_random(eng, seed)
    return eng


def pages(eng: Engine, ids: list[int]) -> list[torch.Tensor]:
    """Every cell of these blocks of every layer, read through vLLM's accessors."""
    return [torch.stack([block_rows(eng, n, b) for b in ids]) for n in LAYERS]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def pair(pd: PD, **settings: Any) -> tuple[Instance, Instance]:
    return (pd.instance("prefill", [engine(1)], engine_id="vllm-p", **settings),
            pd.instance("decode", [engine(2)], engine_id="vllm-d", **settings))  # fmt: skip


def publish(pd: PD, pre: Instance, rid: str, blocks: list[int], tokens: int) -> dict[str, Any]:
    return pd.publish(pre, rid, tokens, [blocks])


def test_publish_then_pull_moves_exact_bytes_and_frees_the_prefill_blocks(pd: PD) -> None:
    pre, dec = pair(pd)
    p_blocks, d_blocks = [7, 8, 9, 3, 40], [10, 11, 12, 13, 50]
    tokens = 4 * BS + 5  # the last block is partly filled
    params = publish(pd, pre, "p-req", p_blocks, tokens)
    p_sc = pd.sidecars.sets["pre1"][0]
    assert params["remote_block_ids"] == [p_blocks]
    assert params["kvxfer_addresses"] == [p_sc.peer_address]
    assert params["kvxfer_engine_id"] == "pre1"
    assert params["remote_engine_id"] == "vllm-p"
    assert params["remote_request_id"] == "p-req"
    assert params["remote_num_tokens"] == tokens
    assert params["remote_block_size"] == BS
    assert params["kvxfer_groups"] == [{"name": "g0", "block_size": BS, "first_block": 0}]
    assert f"{params['remote_host']}:{params['remote_port']}" == p_sc.peer_address
    req = decode_request("d-req", tokens, params)
    # The decode instance loads every prompt token but the last, which it computes itself.
    assert dec.scheduler.matched_tokens(req, 0) == (tokens - 1, True)
    dec.scheduler.after_alloc(req, [d_blocks], tokens - 1)
    assert req.kv_transfer_params is not None
    assert req.kv_transfer_params["do_remote_prefill"] is False
    plan = dec.scheduler.build_plan()
    assert [(g.local_blocks, g.remote_blocks, g.num_tokens) for s in plan.pulls for g in s.groups] == [
        (tuple(d_blocks), tuple(p_blocks), tokens - 1)
    ]
    untouched = pages(dec.engines[0], [1, 2])
    for w in dec.workers:
        w.on_step(plan)
    _, recving, failed = dec.finished(recving="d-req")
    assert (recving, failed) == ({"d-req"}, set())
    assert dec.workers[0].load_errors() == set()
    assert same(pages(dec.engines[0], d_blocks), pages(pre.engines[0], p_blocks))
    assert same(pages(dec.engines[0], [1, 2]), untouched)
    # The decode side confirmed: the prefill worker hands the blocks back to vLLM.
    sending, _, _ = pre.finished(sending="p-req")
    assert sending == {"p-req"}
    dec.scheduler.loads_finished(recving)


def test_the_decode_scheduler_holds_the_request_by_the_publishers_id(pd: PD) -> None:
    """vLLM gives a request an id of its own on each instance: the scheduler's Expect names the prefill's
    (``remote_request_id``), so the publisher holds the request and the pull reads on that Hold's grant,
    with no lookup."""
    pre, dec = pair(pd)
    p_blocks, d_blocks = [16, 17], [26, 27]
    tokens = 2 * BS
    params = publish(pd, pre, "p-expected", p_blocks, tokens)

    def paths() -> dict[str, float]:
        return {p: pd.sidecars.counter("dec1", "kvxfer_pulls_by_path_total", path=p)
                for p in ("grant", "hold_answer", "ahead", "lookup")}  # fmt: skip

    before = paths()
    req = decode_request("d-expected", tokens, params)
    assert dec.scheduler.matched_tokens(req, 0) == (tokens - 1, True)  # the request is queued: Expect
    time.sleep(0.5)  # vLLM keeps it queued a while: the Hold's answer comes first
    dec.scheduler.after_alloc(req, [d_blocks], tokens - 1)
    dec.step()
    _, recving, failed = dec.finished(recving="d-expected")
    assert (recving, failed) == ({"d-expected"}, set())
    assert same(pages(dec.engines[0], d_blocks), pages(pre.engines[0], p_blocks))
    after = paths()
    assert {p: after[p] - before[p] for p in after} == {"grant": 1, "hold_answer": 0, "ahead": 0, "lookup": 0}
    pre.finished(sending="p-expected")
    dec.scheduler.loads_finished(recving)


def test_a_request_queued_past_the_prefill_lease_is_still_pulled(pd: PD, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill connector leases its publishes for 2 s (``lease_seconds``); the decode engine keeps the
    request queued for 3 s. The decode scheduler's Expect (by the publisher's id) keeps it held, at the
    pace of that 2 s lease rather than of the decode sidecar's own 30 s, and the pull reads it on a grant.

    The prefill worker, which heard no release, asks its sidecar before it hands the blocks back to
    vLLM (here 0.5 s after the lease Publish answered, instead of 10 s): the sidecar still holds them."""
    monkeypatch.setattr(vllm_worker, "RELEASE_GRACE_SECONDS", 0.5)
    monkeypatch.setattr(vllm_worker, "LEASE_CHECK_SECONDS", 0.1)
    pre = pd.instance("prefill", [engine(1)], engine_id="vllm-p", lease_seconds=2.0)
    dec = pd.instance("decode", [engine(2)], engine_id="vllm-d")
    p_blocks, d_blocks = [44, 45], [54, 55]
    tokens = 2 * BS
    params = publish(pd, pre, "p-queued", p_blocks, tokens)
    publish(pd, pre, "p-unqueued", [46], BS)
    req = decode_request("d-queued", tokens, params)
    assert dec.scheduler.matched_tokens(req, 0) == (tokens - 1, True)  # queued: Expect
    time.sleep(3.0)
    # Nobody expected the other publish: its lease ran out, and the prefill side got its blocks back.
    # The queued one is past its first lease and the grace too, but still held: vLLM keeps its blocks.
    sending, _, _ = pre.finished(sending="p-unqueued", timeout=5)
    assert sending == {"p-unqueued"}
    assert pre.finished()[0] == set()
    grants = pd.sidecars.counter("dec1", "kvxfer_pulls_by_path_total", path="grant")
    dec.scheduler.after_alloc(req, [d_blocks], tokens - 1)
    dec.step()
    _, recving, failed = dec.finished(recving="d-queued")
    assert (recving, failed) == ({"d-queued"}, set())
    assert same(pages(dec.engines[0], d_blocks), pages(pre.engines[0], p_blocks))
    assert pd.sidecars.counter("dec1", "kvxfer_pulls_by_path_total", path="grant") == grants + 1
    pre.finished(sending="p-queued")
    dec.scheduler.loads_finished(recving)


def test_pipeline_stages_each_hold_and_pull_their_own_layers(pd: PD, monkeypatch: pytest.MonkeyPatch) -> None:
    """PP 2 on both sides, queued past the lease: the decode scheduler's Expect goes to each stage's
    first sidecar with that stage's publishers (a publisher holds only for a reader of its own
    stage), so both stages' publishes outlive their lease and every layer arrives."""
    monkeypatch.setattr(vllm_worker, "RELEASE_GRACE_SECONDS", 0.5)
    monkeypatch.setattr(vllm_worker, "LEASE_CHECK_SECONDS", 0.1)
    spec = attention_spec(block_size=BS, heads=HEADS, head_size=HEAD)

    def stage(seed: int, pp: int) -> Engine:
        eng = build_engine([GroupDef(LAYERS[2 * pp : 2 * pp + 2], spec)], num_blocks=BLOCKS,
                           backend=CPUAttentionBackend, isa="vec", total_kv_heads=HEADS)  # fmt: skip
        fill_random(eng, seed + pp)
        return eng

    pre = pd.instance("prefill", [stage(10, 0), stage(10, 1)], sidecars="prepp2", pp=2, engine_id="vllm-p",
                      lease_seconds=2.0)  # fmt: skip
    dec = pd.instance("decode", [stage(20, 0), stage(20, 1)], sidecars="decpp2", pp=2, engine_id="vllm-d")
    p_blocks, d_blocks = [5, 6], [15, 16]
    tokens = 2 * BS
    params = publish(pd, pre, "p-pp", p_blocks, tokens)
    assert len(params["kvxfer_addresses"]) == 2  # stage 0's sidecar, then stage 1's
    req = decode_request("d-pp", tokens, params)
    assert dec.scheduler.matched_tokens(req, 0) == (tokens - 1, True)  # queued: Expect on each stage
    time.sleep(3.0)
    assert pre.finished()[0] == set()  # past the lease and its grace, still held on both stages
    dec.scheduler.after_alloc(req, [d_blocks], tokens - 1)
    dec.step()
    _, recving, failed = dec.finished(recving="d-pp")
    assert (recving, failed) == ({"d-pp"}, set())
    for pp in range(2):
        layers = LAYERS[2 * pp : 2 * pp + 2]
        got = [torch.stack([block_rows(dec.engines[pp], n, b) for b in d_blocks]) for n in layers]
        want = [torch.stack([block_rows(pre.engines[pp], n, b) for b in p_blocks]) for n in layers]
        assert same(got, want), f"stage {pp}"
    pre.finished(sending="p-pp")
    dec.scheduler.loads_finished(recving)


def test_pipeline_stages_holding_different_groups_publish_and_pull_their_own(pd: PD) -> None:
    """vLLM keeps every KV-cache group on every pipeline stage, with no layers where a stage has none of
    its kind (``_project_kv_cache_groups_to_worker``): here full attention lives on stage 0 and the
    sliding window on stage 1, so each stage's sidecar registers one group. Each rank publishes the
    groups its own sidecar holds (every publish was refused for naming rank 0's groups), the decode
    ranks pull theirs, and a failed load goes to vLLM per request (two groups)."""
    full = attention_spec(block_size=BS, heads=HEADS, head_size=HEAD)
    window = attention_spec(block_size=BS, heads=HEADS, head_size=HEAD, window=2 * BS)

    def stage(seed: int, pp: int) -> Engine:
        groups = [GroupDef(tuple(LAYERS[0:2]) if pp == 0 else (), full),
                  GroupDef(() if pp == 0 else tuple(LAYERS[2:4]), window)]  # fmt: skip
        eng = build_engine(groups, num_blocks=BLOCKS, backend=CPUAttentionBackend, isa="vec", total_kv_heads=HEADS)
        fill_random(eng, seed + pp)
        return eng

    pre = pd.instance("prefill", [stage(30, 0), stage(30, 1)], sidecars="prepp2", pp=2, engine_id="vllm-pg")
    dec = pd.instance("decode", [stage(40, 0), stage(40, 1)], sidecars="decpp2", pp=2, engine_id="vllm-dg")
    assert [w.sidecar.status()["groups"] for w in pre.workers] == [["g0"], ["g1"]]
    tokens = 2 * BS
    p_tables, d_tables = [[5, 6], [7, 8]], [[15, 16], [17, 18]]
    params = pd.publish(pre, "p-pg", tokens, p_tables)
    assert params["remote_block_ids"] == p_tables
    assert not dec.workers[0].block_errors  # two groups: vLLM takes failures per request
    assert pd.load(dec, "d-pg", tokens, params, d_tables) == set()
    for pp in range(2):
        layers, p_ids, d_ids = LAYERS[2 * pp : 2 * pp + 2], p_tables[pp], d_tables[pp]
        got = [torch.stack([block_rows(dec.engines[pp], n, b) for b in d_ids]) for n in layers]
        want = [torch.stack([block_rows(pre.engines[pp], n, b) for b in p_ids]) for n in layers]
        assert same(got, want), f"stage {pp}"
    pre.finished(sending="p-pg")


def test_decode_prefix_cache_hit_pulls_only_the_missing_tail(pd: PD) -> None:
    pre, dec = pair(pd)
    p_blocks, d_blocks = [20, 21, 22, 23], [30, 31, 32, 33]
    tokens = 4 * BS
    params = publish(pd, pre, "p-hit", p_blocks, tokens)
    req = decode_request("d-hit", tokens, params)
    # vLLM found the first two blocks in its own prefix cache.
    assert dec.scheduler.matched_tokens(req, 2 * BS) == (2 * BS - 1, True)
    before = pages(dec.engines[0], d_blocks[:2])
    dec.scheduler.after_alloc(req, [d_blocks], 2 * BS - 1)
    plan = dec.scheduler.build_plan()
    assert [(g.local_blocks, g.remote_blocks) for s in plan.pulls for g in s.groups] == [((32, 33), (22, 23))]
    dec.workers[0].on_step(plan)
    assert dec.finished(recving="d-hit")[2] == set()
    assert same(pages(dec.engines[0], [32, 33]), pages(pre.engines[0], [22, 23]))
    assert same(pages(dec.engines[0], d_blocks[:2]), before)
    pre.finished(sending="p-hit")


def test_decode_prefix_cache_covering_everything_frees_the_prefill_copy_at_once(pd: PD) -> None:
    pre, dec = pair(pd)
    tokens = 3 * BS
    params = publish(pd, pre, "p-full", [4, 5, 6], tokens)
    req = decode_request("d-full", tokens, params)
    # vLLM's own prefix cache covered the whole prompt: nothing to load.
    assert dec.scheduler.matched_tokens(req, tokens) == (0, False)
    dec.scheduler.after_alloc(req, [[30, 31, 32]], 0)
    plan = dec.scheduler.build_plan()
    assert plan.pulls == []
    assert [(r.request_id, r.addresses) for r in plan.drops] == [
        ("p-full", (pd.sidecars.sets["pre1"][0].peer_address,))
    ]
    dec.workers[0].on_step(plan)
    # The prefill worker gets its blocks back now, well before the sidecars' lease (20 s) ends.
    start = time.monotonic()
    sending, _, _ = pre.finished(sending="p-full", timeout=10)
    assert sending == {"p-full"}
    assert time.monotonic() - start < 10
    assert pre.workers[0].sidecar.status()["leases"] == 0
    assert dec.workers[0].load_errors() == set()


def test_failed_load_reports_its_blocks_and_other_loads_complete(pd: PD) -> None:
    pre, dec = pair(pd)
    good = publish(pd, pre, "p-good", [1, 2], 2 * BS)
    lost = dict(good, remote_request_id="never-published")
    r_lost = decode_request("d-lost", 2 * BS, lost)
    r_good = decode_request("d-good", 2 * BS, good)
    for r, blocks in ((r_lost, [40, 41]), (r_good, [42, 43])):
        assert dec.scheduler.matched_tokens(r, 0) == (2 * BS - 1, True)
        dec.scheduler.after_alloc(r, [blocks], 2 * BS - 1)
    dec.step()
    _, r1, f1 = dec.finished(recving="d-lost")
    _, r2, f2 = dec.finished(recving="d-good") if "d-good" not in r1 else (set(), set(), set())
    # A failed load still ends (vLLM must not wait forever) and names exactly its blocks (one
    # full-attention group: vLLM recomputes from the first), not the request.
    assert {"d-lost", "d-good"} <= r1 | r2
    assert f1 | f2 == set()
    assert dec.workers[0].block_errors
    assert dec.workers[0].load_errors() == {40, 41}
    assert dec.workers[0].load_errors() == set()
    assert same(pages(dec.engines[0], [42, 43]), pages(pre.engines[0], [1, 2]))
    pre.finished(sending="p-good")


def test_failed_load_of_a_model_with_two_groups_is_reported_per_request(pd: PD) -> None:
    """vLLM takes failed block ids from models with one KV-cache group only; with two, the request fails."""
    full = attention_spec(block_size=BS, heads=HEADS, head_size=HEAD)
    window = attention_spec(block_size=BS, heads=HEADS, head_size=HEAD, window=BS)
    groups = [GroupDef(LAYERS[::2], full), GroupDef(LAYERS[1::2], window)]
    dec = pd.instance("decode", [build_engine(groups, num_blocks=BLOCKS, backend=FlashAttentionBackend)])
    params = {"do_remote_prefill": True, "remote_request_id": "nobody", "remote_block_ids": [[1, 2], [1, 2]],
              "kvxfer_addresses": [pd.sidecars.sets["pre1"][0].peer_address], "remote_num_tokens": 2 * BS}  # fmt: skip
    req = decode_request("d-two", 2 * BS, params)
    assert dec.scheduler.matched_tokens(req, 0) == (2 * BS - 1, True)
    dec.scheduler.after_alloc(req, [[3, 4], [5, 6]], 2 * BS - 1)
    dec.step()
    _, recving, failed = dec.finished(recving="d-two")
    assert (recving, failed) == ({"d-two"}, {"d-two"})
    assert not dec.workers[0].block_errors
    assert dec.workers[0].load_errors() == set()


@pytest.mark.parametrize("model", ["sliding window only", "full attention, load that cannot start"])
def test_a_failed_load_vllm_cannot_recompute_from_a_block_is_reported_per_request(pd: PD, model: str) -> None:
    """Block ids make vLLM recompute from the first failed block over the blocks before it: null blocks
    for a sliding window (it would attend to zeros), and nothing at all for a load that never named
    its blocks (vLLM would take it as loaded). Both fail the request instead."""
    window = model == "sliding window only"
    spec = attention_spec(block_size=BS, heads=HEADS, head_size=HEAD, window=2 * BS if window else None)
    eng = build_engine([GroupDef(LAYERS, spec)], num_blocks=BLOCKS, backend=FlashAttentionBackend)
    dec = pd.instance("decode", [eng])
    assert dec.workers[0].block_errors is (not window)
    params = {"do_remote_prefill": True, "remote_request_id": "nobody", "remote_block_ids": [[1, 2, 3, 4]],
              "kvxfer_addresses": [pd.sidecars.sets["pre1"][0].peer_address], "remote_num_tokens": 4 * BS}  # fmt: skip
    req = decode_request("d-one", 4 * BS, params)
    assert dec.scheduler.matched_tokens(req, 0) == (4 * BS - 1, True)
    # A table one block short cannot even be planned (the PullSpec carries an error and no blocks).
    table = [0, 0, 5, 6] if window else [5, 6, 7]
    dec.scheduler.after_alloc(req, [table], 4 * BS - 1)
    dec.step()
    seen = vllm_sees(dec, "d-one")
    assert seen == {"finished_recving": {"d-one"}, "failed_recving": {"d-one"}, "invalid_block_ids": set()}


def vllm_sees(inst: Instance, rid: str, timeout: float = 20.0) -> dict[str, set[Any]]:
    """What vLLM's model runner hands its scheduler, polled through the connector's own methods until
    ``rid``'s load ends (one rank)."""
    from types import SimpleNamespace

    from kvxfer.integrations.vllm.connector import KvxferConnector

    conn = SimpleNamespace(_worker=inst.workers[0])
    seen: dict[str, set[Any]] = {"finished_recving": set(), "failed_recving": set(), "invalid_block_ids": set()}
    deadline = time.monotonic() + timeout
    while rid not in seen["finished_recving"]:
        assert time.monotonic() < deadline, seen
        res = KvxferConnector.get_transfer_results(conn, set())  # type: ignore[arg-type]
        seen["finished_recving"] |= res.finished_recving or set()
        seen["failed_recving"] |= res.failed_recving or set()
        seen["invalid_block_ids"] |= KvxferConnector.get_block_ids_with_load_errors(conn)  # type: ignore[arg-type]
        time.sleep(0.02)
    return seen


def test_request_aborted_while_loading_ends_without_load_errors(pd: PD) -> None:
    pre, dec = pair(pd)
    params = publish(pd, pre, "p-ab", [5], BS)
    req = decode_request("d-ab", BS, dict(params, remote_request_id="p-unknown"))
    dec.scheduler.matched_tokens(req, 0)
    dec.scheduler.after_alloc(req, [[6]], BS - 1)
    plan = dec.scheduler.build_plan()
    req.status = RequestStatus.FINISHED_ABORTED
    assert dec.scheduler.request_finished(req, [[6]]) == (False, None)
    abort_plan = dec.scheduler.build_plan()
    assert abort_plan.aborts == ["d-ab"]
    dec.workers[0].on_step(plan)
    dec.workers[0].on_step(abort_plan)
    _, _, failed = dec.finished(recving="d-ab")
    # vLLM frees an aborted request's blocks itself; naming them as failed could hit a new owner.
    assert failed == set()
    assert dec.workers[0].load_errors() == set()
    for w in pre.workers:  # nobody read p-ab
        w.sidecar.release("p-ab")


def test_lease_expiry_hands_the_blocks_back(pd: PD) -> None:
    pre = pd.instance("prefill", [engine(1)], lease_seconds=0.5)
    publish(pd, pre, "p-exp", [3, 4], 2 * BS)
    sending, _, _ = pre.finished(sending="p-exp", timeout=10)
    assert sending == {"p-exp"}


def test_unusable_params_make_the_decode_side_compute_the_prompt(pd: PD, caplog: pytest.LogCaptureFixture) -> None:
    dec = pd.instance("decode", [engine(2)])
    base = {"do_remote_prefill": True, "remote_request_id": "x", "remote_block_ids": [[1, 2, 3]],
            "kvxfer_addresses": ["127.0.0.1:1"]}  # fmt: skip
    cases = [
        ({k: v for k, v in base.items() if k != "remote_request_id"}, "remote_request_id: must be a non-empty string"),
        (dict(base, remote_block_ids=[["a"]]), "remote_block_ids: 'a' is not a block id"),
        (dict(base, kvxfer_addresses=[]), "kvxfer_addresses: must be a non-empty list"),
        (dict(base, remote_block_ids=[[1]], remote_num_tokens=3 * BS), "published 1 blocks for"),
        (dict(base, remote_block_size=BS + 8), f"block size {BS + 8} on the prefill side and {BS} here"),
        (dict(base, remote_block_size=str(BS)), "remote_block_size: must be an integer >= 0"),
        (dict(base, pp_size=2), "the prefill instance runs 2 pipeline stages, this one 1"),
        (dict(base, tp_size="2"), "tp_size: must be an integer >= 0"),
        (dict(base, remote_num_tokens="lots"), "remote_num_tokens: must be an integer >= 0"),
        (dict(base, remote_block_ids=[[1], [2]]), "KV-cache groups ['g0', 'g1'], this one ['g0']"),
        (dict(base, kvxfer_groups=[{"name": "g7", "block_size": BS}]), "KV-cache groups ['g7']"),
    ]
    for params, reason in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvxfer"):
            req = decode_request("d", 3 * BS, params)
            assert dec.scheduler.matched_tokens(req, 0) == (0, False), params
        assert any(reason in r.getMessage() and "computing the prompt here" in r.getMessage()
                   for r in caplog.records), (reason, caplog.text)  # fmt: skip
    one_token = decode_request("d1", 1, base)
    assert dec.scheduler.matched_tokens(one_token, 0) == (0, False)
    assert dec.scheduler.build_plan().pulls == []


def test_prefill_not_published_when_the_request_did_not_finish_normally(pd: PD) -> None:
    pre = pd.instance("prefill", [engine(1)])
    for status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
        req = prefill_request("p-x", BS)
        req.status, req.num_computed_tokens = status, BS
        assert pre.scheduler.request_finished(req, [[1]]) == (False, None)
    plain = prefill_request("plain", BS)
    plain.kv_transfer_params = None
    plain.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert pre.scheduler.request_finished(plain, [[1]]) == (False, None)
    assert pre.scheduler.build_plan() == StepPlan()


def test_sidecar_missing_is_a_clear_error(tmp_path: Path) -> None:
    sock = str(tmp_path / "nobody.sock")
    w = WorkerSide(ConnectorSettings(sidecar_socket=sock, startup_timeout_seconds=0.5), rank=RankInfo(0, 1),
                   local_rank=0)  # fmt: skip
    eng = engine(3)
    try:
        expected = f"sidecar_socket: no kvxfer sidecar answers at {sock} after 0.5s"
        with pytest.raises(SidecarUnavailableError, match=expected):
            w.register(eng.describe(), eng.kv_caches)
    finally:
        w.close()


def test_sidecar_restart_re_registers_the_same_memory(pd: PD, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_worker, "RELEASE_GRACE_SECONDS", 0.5)
    monkeypatch.setattr(vllm_worker, "LEASE_CHECK_SECONDS", 0.1)
    pre = pd.instance("prefill", [engine(1)], sidecars="prst", lease_seconds=1.0)
    dec = pd.instance("decode", [engine(2)])
    pw = pre.workers[0]
    publish(pd, pre, "p-before", [8], BS)  # the sidecar that holds it is killed: no release will come
    first, handle = pw.registration["instance_id"], pw.shared.lease.handle if pw.shared and pw.shared.lease else ""
    sc = pd.sidecars.sets["prst"][0]
    cluster = pd.sidecars.cluster
    cluster.kill_sidecar(sc)
    # Same socket and peer port, new process: the worker notices on its completion stream and
    # registers its (unchanged) shared memory again, handing the descriptors over again.
    new = cluster.start_sidecar(sc.name, "prst", "prefill", port=int(sc.peer_address.rsplit(":", 1)[1]))
    pd.sidecars.sets["prst"] = [new]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and pw.registration.get("instance_id") == first:
        time.sleep(0.1)
    assert pw.registration["instance_id"] != first
    assert pw.shared is not None
    assert pw.shared.lease is not None
    assert pw.shared.lease.handle != handle  # the descriptors were handed over again
    # ... and transfers work again, with the bytes vLLM wrote before the restart.
    params = publish(pd, pre, "p-after", [9], BS)
    assert pd.load(dec, "d-after", BS, params, [[19]]) == set()
    assert dec.workers[0].load_errors() == set()
    assert same(pages(dec.engines[0], [19]), pages(pre.engines[0], [9]))
    sending, _, _ = pre.finished(sending="p-after")
    # The publish from before the restart: its lease (and the grace) ran out, and the sidecar that
    # now answers does not hold it, so vLLM gets its blocks back (before p-after's or after).
    if "p-before" not in sending:
        sending |= pre.finished(sending="p-before", timeout=5)[0]
    assert "p-before" in sending


def test_describe_reads_vllms_layouts() -> None:
    (g,) = engine(5).describe()
    lay = g.layout
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_size) == (
        len(LAYERS), BLOCKS, BS, HEADS, HEAD)  # fmt: skip
    assert (lay.order, lay.cross_layer, lay.packing, lay.total_kv_heads) == (Order.HND, False, Packing.CPU_KT, HEADS)
    assert lay.page_bytes == HEADS * BS * 2 * HEAD * 2
    spec = attention_spec(block_size=BS, heads=HEADS, head_size=HEAD)
    (nhd,) = build_engine([GroupDef(LAYERS, spec)], layout=VLayout.LBNHC, backend=FlashAttentionBackend).describe()
    assert (nhd.layout.order, nhd.layout.packing) == (Order.NHD, Packing.KV)
    # vLLM's cross-layer layout (BLHNC): per-layer views of one block-major allocation, one region.
    (cross,) = build_engine([GroupDef(LAYERS, spec)], layout=VLayout.BLHNC, backend=FlashAttentionBackend).describe()
    assert cross.layout.cross_layer
    assert cross.layout.num_regions == 1
    assert len(cross.region_addresses) == 1


def test_describe_refuses_what_it_cannot_move() -> None:
    eng = engine(4)
    odd = dict(eng.kv_caches)
    odd[LAYERS[2]] = torch.zeros(BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16).transpose(1, 2)
    eng.kv_caches = odd
    with pytest.raises(KVCacheDescriptionError, match=r"kv_caches\['model.layers.2.self_attn.attn'\]: vLLM's view"):
        eng.describe()
    eng.kv_caches = {}
    with pytest.raises(KVCacheDescriptionError, match="no KV-cache tensors"):
        eng.describe()


def shm_mappings(pid: int) -> tuple[set[str], set[str]]:
    """Files under /dev/shm that process ``pid`` maps: (still named, already unlinked).

    A named one would outlive a crash of the process; the caches must be mapped from unlinked files only.
    """
    with open(f"/proc/{pid}/maps") as fh:
        paths = {line.split(maxsplit=5)[5].strip() for line in fh if " /dev/shm/" in line}
    return {p for p in paths if not p.endswith("(deleted)")}, {p for p in paths if p.endswith("(deleted)")}


def test_cpu_memory_is_shared_in_place(pd: PD) -> None:
    """register() moves vLLM's CPU storage into shared memory in place: same views, same bytes, no named segment."""
    eng = engine(1)
    before = {n: (t.shape, t.stride(), t.storage_offset(), t.clone()) for n, t in eng.kv_caches.items()}
    storage = eng.kv_caches[LAYERS[0]].untyped_storage()
    assert not storage.is_shared()
    pre = pd.instance("prefill", [eng])
    dec = pd.instance("decode", [engine(2)])
    for n, t in eng.kv_caches.items():
        assert t.untyped_storage().is_shared()
        shape, stride, offset, values = before[n]
        assert (t.shape, t.stride(), t.storage_offset()) == (shape, stride, offset)
        assert torch.equal(t.view(torch.int16), values.view(torch.int16))  # bit patterns (random cells hold NaNs)
    # Every view - the connector's and the attention layers' - still shares the one storage.
    ptrs = {t.untyped_storage().data_ptr() for t in eng.kv_caches.values()}
    ptrs |= {m.kv_cache.untyped_storage().data_ptr() for m in eng.vllm_config.compilation_config.static_forward_context
             .values()}  # fmt: skip
    assert len(ptrs) == 1
    sidecar_pid = pd.sidecars.sets["pre1"][0].proc.pid
    for pid in (os.getpid(), sidecar_pid):  # this worker and its sidecar map the same unlinked file
        named, unlinked = shm_mappings(pid)
        assert named == set()
        assert unlinked
    # Writes after registration (vLLM computing KV) are what the sidecar moves.
    fill_random(eng, 99)
    params = publish(pd, pre, "p-shm", [5, 6], 2 * BS)
    assert pd.load(dec, "d-shm", 2 * BS, params, [[7, 8]]) == set()
    assert same(pages(dec.engines[0], [7, 8]), pages(eng, [5, 6]))
    pre.finished(sending="p-shm")
    assert shm_mappings(os.getpid())[0] == shm_mappings(sidecar_pid)[0] == set()


def test_heterogeneous_tp_prefill2_decode1_through_both_halves(pd: PD) -> None:
    """A TP-2 prefill instance (one sidecar per rank) and a TP-1 decode instance: each head slice lands in place."""
    pre = pd.instance("prefill", [engine(10 + r, tp=2, rank=r) for r in range(2)])
    dec = pd.instance("decode", [engine(20)])
    p_blocks, d_blocks = [3, 4, 5, 60], [7, 8, 9, 1]
    params = pd.publish(pre, "p-tp", 4 * BS, [p_blocks])
    # Every prefill rank's sidecar, in rank order; one engine id that all of them answer with.
    assert params["kvxfer_addresses"] == [s.peer_address for s in pd.sidecars.sets["pre2"]]
    assert params["kvxfer_engine_id"] == "pre2"
    assert params["tp_size"] == 2
    assert pd.load(dec, "d-tp", 4 * BS, params, [d_blocks]) == set()
    # Head h of the decode rank is head h % 1 of prefill rank h (K transposed and V of the CPU kernels).
    for n in LAYERS:
        got = torch.stack([block_rows(dec.engines[0], n, b) for b in d_blocks])
        for head in range(HEADS):
            want = torch.stack([block_rows(pre.engines[head], n, b) for b in p_blocks])[:, :, 0]
            assert torch.equal(got[:, :, head], want), (n, head)
    # The decode rank read both prefill ranks: each frees its blocks.
    pre.finished(sending="p-tp")


def test_each_decode_rank_reads_on_the_plan_its_scheduler_prepared(pd: PD) -> None:
    """As vLLM allocates a request's blocks, the scheduler sends each rank's sidecar the Pull its worker
    then makes (Prepare); the workers' Pulls read on those plans, and the bytes are the same."""
    pre = pd.instance("prefill", [engine(1)], engine_id="vllm-p")
    dec = pd.instance("decode", [engine(2, tp=2, rank=0), engine(3, tp=2, rank=1)], engine_id="vllm-d")

    def count(outcome: str) -> float:
        return pd.sidecars.counter("dec2", "kvxfer_prepared_pulls_total", outcome=outcome)

    before = {o: count(o) for o in ("prepared", "used", "replanned")}
    for n, (p_blocks, d_blocks) in enumerate((([4, 5, 6], [20, 21, 22]), ([7, 8, 30], [23, 24, 25]))):
        tokens = 2 * BS + 9
        params = publish(pd, pre, f"p-prep{n}", p_blocks, tokens)
        req = decode_request(f"d-prep{n}", tokens, params)
        assert dec.scheduler.matched_tokens(req, 0) == (tokens - 1, True)  # the first asks the sidecars' groups
        deadline = time.monotonic() + 10
        while n == 0 and dec.scheduler._decode_groups() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        dec.scheduler.after_alloc(req, [d_blocks], tokens - 1)
        # The Prepares go on the scheduler's own connections; a Pull that overtook one would plan anew.
        while count("prepared") < before["prepared"] + 2 * (n + 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        dec.step()
        _, recving, failed = dec.finished(recving=f"d-prep{n}")
        assert (recving, failed) == ({f"d-prep{n}"}, set())
        for name in LAYERS:  # decode rank r holds head r of the prefill's two
            want = torch.stack([block_rows(pre.engines[0], name, b) for b in p_blocks])
            for r in range(2):
                got = torch.stack([block_rows(dec.engines[r], name, b) for b in d_blocks])
                assert torch.equal(got[:, :, 0], want[:, :, r]), (name, r)
        dec.scheduler.loads_finished(recving)
        assert pre.finished(sending=f"p-prep{n}")[0] == {f"p-prep{n}"}
    assert count("prepared") - before["prepared"] == 4  # two requests, two ranks
    assert (count("used") - before["used"], count("replanned") - before["replanned"]) == (4, 0)


@pytest.mark.parametrize("prefill_dropped_by", ["the prompt", "the prompt less one token"])
@pytest.mark.parametrize("kind", ["sliding window", "chunked local attention"])
def test_a_windowed_pull_is_promised_only_when_it_can_load(
    kind: str, prefill_dropped_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For every prompt length around the window (chunk), both block tables as vLLM's own manager
    leaves them (``get_num_skipped_tokens``), and the group's role read from vLLM's own spec: the
    decode scheduler either computes the prompt itself, because the prefill side dropped a block
    the decode side still attends to, or promises a load that plans without error and starts where
    vLLM's attention for the next token starts."""
    from types import SimpleNamespace

    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager, SlidingWindowManager
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from kvxfer.integrations.vllm.params import prefill_response
    from kvxfer.integrations.vllm.plan import published_blocks
    from kvxfer.integrations.vllm.scheduler import SchedulerSide
    from kvxfer.integrations.vllm.spec import transfer_groups

    span, bs = 32, 16
    full = attention_spec(block_size=bs, heads=HEADS, head_size=HEAD)
    if kind == "sliding window":
        windowed = attention_spec(block_size=bs, heads=HEADS, head_size=HEAD, window=span)
        manager, rule = SlidingWindowManager, SimpleNamespace(sliding_window=span, extra_retained_tokens=0)
    else:
        assert isinstance(full, FullAttentionSpec)
        fields = {k: getattr(full, k) for k in ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype")}
        windowed = ChunkedLocalAttentionSpec(attention_chunk_size=span, **fields)
        manager, rule = ChunkedLocalAttentionManager, SimpleNamespace(attention_chunk_size=span)  # type: ignore[assignment]
    specs = [KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["b"], windowed)]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=specs)
    groups = transfer_groups(config)
    assert [g.role for g in groups] == ["full", "window" if kind == "sliding window" else "chunked"]

    def skipped(computed: int) -> int:
        return int(manager.get_num_skipped_tokens(rule, computed))  # type: ignore[arg-type]

    def table(computed: int, first_id: int, blocks: int) -> list[int]:  # vLLM nulls the blocks wholly skipped
        return [0] * (skipped(computed) // bs) + list(range(first_id + skipped(computed) // bs, first_id + blocks))

    sched = SchedulerSide(ConnectorSettings(sidecar_socket="/nonexistent/{rank}.sock", prepare_pulls=False),
                          engine_id="d", groups=groups)  # fmt: skip
    monkeypatch.setattr(sched, "_expect", lambda rid, remote: None)  # no sidecar: nothing to hold
    promised = computed_here = 0
    for prompt in range(span + 2, span + 4 * bs + 2):
        blocks = -(-prompt // bs)
        dropped_at = prompt if prefill_dropped_by == "the prompt" else prompt - 1
        p_tables = [list(range(100, 100 + blocks)), table(dropped_at, 200, blocks)]
        pub = [published_blocks(g, t, prompt) for g, t in zip(groups, p_tables, strict=True)]
        needed = skipped(prompt - 1)
        if pub[1] is None:  # the prefill's last token began a chunk: it dropped every block, publishes nothing
            computed_here += 1
            assert skipped(dropped_at) > needed, prompt
            continue
        params = prefill_response(engine_id="p", request_id=f"p{prompt}", groups=pub, num_tokens=prompt,  # type: ignore[arg-type]
                                  addresses=["127.0.0.1:1"], sidecar_engine_id="pre", tp_size=1, pp_size=1)  # fmt: skip
        req = SimpleNamespace(request_id=f"d{prompt}", kv_transfer_params=params, prompt_token_ids=list(range(prompt)))
        n, is_async = sched.matched_tokens(req, 0)
        if n == 0:
            computed_here += 1
            assert pub[1] is not None
            assert pub[1].first_block * bs > needed, prompt  # only when it cannot load
            continue
        promised += 1
        assert (n, is_async) == (prompt - 1, True)
        sched.after_alloc(req, [list(range(300, 300 + blocks)), table(n, 400, blocks)], n)
        (spec,) = sched.build_plan().pulls
        assert spec.error == "", (prompt, spec.error)
        if needed >= n:  # the decode side's token begins a chunk: it attends to no loaded token of this group
            assert [g.group for g in spec.groups] == [0], prompt
            continue
        assert spec.groups[1].local_blocks[0] == 400 + needed // bs, prompt  # from the block of the first token needed
        assert spec.groups[1].local_skip == 0, prompt  # whole blocks from there
    assert promised > 0
    # Dropped by the prompt's length, the prefill side lacks the block holding the first token needed
    # where that one more token moved the window past a block (the chunk to the next chunk).
    if prefill_dropped_by == "the prompt less one token":
        assert computed_here == 0
    else:
        assert computed_here == (4 if kind == "sliding window" else 2)


def test_mamba_state_from_another_tp_size_is_computed_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecars refuse Mamba state between different TP sizes at the handshake: the decode scheduler
    says so up front instead of promising vLLM a load that can only fail."""
    from types import SimpleNamespace

    from kvxfer.integrations.vllm.scheduler import SchedulerSide
    from kvxfer.integrations.vllm.spec import TransferGroup

    groups = [TransferGroup(0, "g0", "full", BS), TransferGroup(1, "g1", "state", BS)]
    sched = SchedulerSide(ConnectorSettings(sidecar_socket="/nonexistent/{rank}.sock", prepare_pulls=False),
                          engine_id="d", groups=groups, tp_size=2)  # fmt: skip
    monkeypatch.setattr(sched, "_expect", lambda rid, remote: None)  # no sidecar: nothing to hold
    params = {"do_remote_prefill": True, "remote_request_id": "x", "remote_block_ids": [[1, 2, 3], [7]],
              "kvxfer_addresses": ["127.0.0.1:1"], "remote_num_tokens": 3 * BS - 1}  # fmt: skip
    for tp, want in ((1, (0, False)), (2, (3 * BS - 1, True)), (0, (3 * BS - 1, True))):  # 0: not given
        req = SimpleNamespace(request_id=f"d{tp}", kv_transfer_params=dict(params, tp_size=tp),
                              prompt_token_ids=list(range(3 * BS)))  # fmt: skip
        assert sched.matched_tokens(req, 0) == want, tp


def test_mamba_state_whose_tp_split_is_known_loads_from_another_tp_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mamba group whose split over TP is known (vLLM's DS conv layout, or a replicated state) moves
    between TP sizes: the decode scheduler promises the load."""
    from types import SimpleNamespace

    from kvxfer.integrations.vllm.scheduler import SchedulerSide
    from kvxfer.integrations.vllm.spec import TransferGroup

    groups = [TransferGroup(0, "g0", "full", BS), TransferGroup(1, "g1", "state", BS, tp_split=True)]
    sched = SchedulerSide(ConnectorSettings(sidecar_socket="/nonexistent/{rank}.sock", prepare_pulls=False),
                          engine_id="d", groups=groups, tp_size=2)  # fmt: skip
    monkeypatch.setattr(sched, "_expect", lambda rid, remote: None)  # no sidecar: nothing to hold
    params = {"do_remote_prefill": True, "remote_request_id": "x", "remote_block_ids": [[1, 2, 3], [7]],
              "kvxfer_addresses": ["127.0.0.1:1"], "remote_num_tokens": 3 * BS - 1}  # fmt: skip
    for tp in (1, 2, 4):
        req = SimpleNamespace(request_id=f"d{tp}", kv_transfer_params=dict(params, tp_size=tp),
                              prompt_token_ids=list(range(3 * BS)))  # fmt: skip
        assert sched.matched_tokens(req, 0) == (3 * BS - 1, True), tp
    # A prefill instance that says its state is opaque (another conv layout there): computed here.
    groups_params = [{"name": "g0", "block_size": BS}, {"name": "g1", "block_size": BS, "first_block": 2}]
    for split, want in ((False, (0, False)), (True, (3 * BS - 1, True))):
        groups_params[1]["tp_split"] = split
        req = SimpleNamespace(request_id=f"s{split}", prompt_token_ids=list(range(3 * BS)),
                              kv_transfer_params=dict(params, tp_size=1, kvxfer_groups=groups_params))  # fmt: skip
        assert sched.matched_tokens(req, 0) == want, split


@pytest.mark.parametrize("n_groups", [1, 2, 4])
def test_mamba2_state_is_promised_only_between_tp_sizes_the_sidecars_accept(
    monkeypatch: pytest.MonkeyPatch, n_groups: int
) -> None:
    """vLLM replicates a Mamba2 layer's B/C groups over the TP ranks when n_groups is not a multiple of
    the TP size (n_groups 1: every rank holds the one group), so the per-rank B and C are not slices of
    one state and the topology refuses that pair. The decode scheduler promises the load exactly where
    every decode rank's topology accepts the prefill side's layout (vLLM's own state shapes and split)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator, get_conv_state_layout
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvxfer.errors import KvxferError
    from kvxfer.integrations.vllm.params import prefill_response
    from kvxfer.integrations.vllm.plan import published_blocks
    from kvxfer.integrations.vllm.scheduler import SchedulerSide
    from kvxfer.integrations.vllm.spec import TransferGroup, mamba_tp_split, transfer_groups
    from kvxfer.layout import KVCacheLayout
    from kvxfer.topology import TransferTopology

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    get_conv_state_layout.cache_clear()

    def spec(tp: int) -> MambaSpec:
        shapes = MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=tp, intermediate_size=64, n_groups=n_groups, num_heads=8, head_dim=8, state_size=16,
            conv_kernel=4,
        )  # fmt: skip
        return MambaSpec(block_size=BS, shapes=shapes, dtypes=(torch.float16, torch.float32),
                         mamba_type=MambaAttentionBackendEnum.MAMBA2)  # fmt: skip

    def groups(tp: int) -> tuple[TransferGroup, ...]:
        return transfer_groups(SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec(tp))]), tp)

    def layout(tp: int) -> KVCacheLayout:
        return KVCacheLayout.mamba(num_layers=1, num_blocks=8, page_size_bytes=spec(tp).page_size_bytes,
                                   segments=mamba_tp_split(spec(tp), tp)[0])  # fmt: skip

    def accepted(p_tp: int, d_tp: int) -> bool:
        try:
            for d in range(d_tp):
                TransferTopology(layout(d_tp), layout(p_tp), RankInfo(d, d_tp), p_tp)
        except KvxferError:
            return False
        return True

    try:
        outcomes = set()
        for p_tp, d_tp in ((1, 2), (2, 1), (2, 4), (4, 2), (4, 4)):
            (pub,) = groups(p_tp)
            assert pub.tp_split
            remote = published_blocks(pub, [5], BS)
            assert remote is not None
            params = prefill_response(engine_id="p", request_id="x", groups=[remote], num_tokens=3 * BS - 1,
                                      addresses=["127.0.0.1:1"], sidecar_engine_id="p", tp_size=p_tp,
                                      pp_size=1)  # fmt: skip
            sched = SchedulerSide(ConnectorSettings(sidecar_socket="/nonexistent/{rank}.sock", prepare_pulls=False),
                                  engine_id="d", groups=list(groups(d_tp)), tp_size=d_tp)  # fmt: skip
            monkeypatch.setattr(sched, "_expect", lambda rid, remote: None)  # no sidecar: nothing to hold
            req = SimpleNamespace(request_id=f"d{p_tp}{d_tp}", kv_transfer_params=params,
                                  prompt_token_ids=list(range(3 * BS)))  # fmt: skip
            ok = accepted(p_tp, d_tp)
            outcomes.add(ok)
            assert sched.matched_tokens(req, 0) == ((3 * BS - 1, True) if ok else (0, False)), (p_tp, d_tp)
        assert outcomes == ({True, False} if n_groups < 4 else {True})
    finally:
        monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT")
        get_conv_state_layout.cache_clear()


def test_mamba_state_of_another_conv_layout_is_computed_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """An instance with vLLM's DS conv layout (its state's TP split known) and one with the SD layout
    (opaque) hold the same Mamba2 page size at equal TP, so the sidecars would move the page whole:
    the conv state would arrive transposed. The decode scheduler computes the prompt instead."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator, get_conv_state_layout
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvxfer.integrations.vllm.params import prefill_response
    from kvxfer.integrations.vllm.plan import published_blocks
    from kvxfer.integrations.vllm.scheduler import SchedulerSide
    from kvxfer.integrations.vllm.spec import transfer_groups

    def spec(conv_layout: str) -> MambaSpec:
        monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", conv_layout)
        get_conv_state_layout.cache_clear()
        shapes = MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=2, intermediate_size=64, n_groups=2, num_heads=8, head_dim=8, state_size=16, conv_kernel=4
        )
        return MambaSpec(block_size=BS, shapes=shapes, dtypes=(torch.float16, torch.float32),
                         mamba_type=MambaAttentionBackendEnum.MAMBA2)  # fmt: skip

    try:
        specs = {name: spec(name) for name in ("DS", "SD")}
        groups = {name: transfer_groups(SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec(name))]), 2)
                  for name in ("DS", "SD")}  # fmt: skip
    finally:
        monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT")
        get_conv_state_layout.cache_clear()
    assert specs["DS"].page_size_bytes == specs["SD"].page_size_bytes  # a whole-page move fits
    assert specs["DS"].shapes[0] == specs["SD"].shapes[0][::-1]  # (dim, state_len) against (state_len, dim)
    for pre, dec in (("SD", "DS"), ("DS", "SD"), ("DS", "DS"), ("SD", "SD")):
        remote = published_blocks(groups[pre][0], [5], BS)
        assert remote is not None
        params = prefill_response(engine_id="p", request_id="x", groups=[remote], num_tokens=3 * BS - 1,
                                  addresses=["127.0.0.1:1"], sidecar_engine_id="p", tp_size=2, pp_size=1)  # fmt: skip
        sched = SchedulerSide(ConnectorSettings(sidecar_socket="/nonexistent/{rank}.sock", prepare_pulls=False),
                              engine_id="d", groups=list(groups[dec]), tp_size=2)  # fmt: skip
        monkeypatch.setattr(sched, "_expect", lambda rid, remote: None)  # no sidecar: nothing to hold
        req = SimpleNamespace(request_id=f"{pre}{dec}", kv_transfer_params=params, prompt_token_ids=list(range(3 * BS)))
        want = (3 * BS - 1, True) if pre == dec else (0, False)
        assert sched.matched_tokens(req, 0) == want, (pre, dec)


def test_a_publish_whose_answer_came_too_late_is_released_before_vllm_frees_its_blocks(pd: PD) -> None:
    """The prefill sidecar stalls (SIGSTOP: a real stall, not a stand-in) past the scheduler's call
    timeout while a Publish is on its way: vLLM is told nothing was published and frees the blocks,
    so that Publish, which takes effect once the sidecar runs again, must not stay published."""
    import signal

    pre = pd.instance("prefill", [engine(5)], call_timeout_seconds=1.0)
    pre.scheduler._peer_identity()  # ask the sidecar who it is before it stalls
    (sidecar,) = pd.sidecars.sets["pre1"]
    before = pre.workers[0].sidecar.status()["leases"]
    req = prefill_request("p-late", 2 * BS)
    pre.scheduler.on_new_request(req)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = 2 * BS
    os.kill(sidecar.proc.pid, signal.SIGSTOP)
    try:
        assert pre.scheduler.request_finished(req, [[1, 2]]) == (False, None)
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
    leases = [pre.workers[0].sidecar.status()["leases"] for _ in range(3) if time.sleep(0.5) is None]
    assert leases == [before] * 3

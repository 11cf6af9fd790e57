"""Push mode through the connector's halves, on caches vLLM's spec and layout helpers made.

The decode instance allocates and offers its blocks before (or after) the prefill finishes; the
prefill sidecars WRITE; the decode caches must equal the prefill caches token by token, read back
as the attention backends read them (``token_rows``), exactly as for a pull (test_pull.py).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheSpec
from vllm.v1.request import Request, RequestStatus

from tests.vllm_inproc.engine import mla_spec
from tests.vllm_inproc.pd import PD, Instance, block_rows, decode_request, token_rows, write_tokens
from tests.vllm_inproc.runners import RUNNERS, scheduler_connector
from tests.vllm_inproc.test_pull import (
    D_POOL,
    LAYERS,
    MIXER_LAYERS,
    P_POOL,
    SW_LAYERS,
    assert_mamba_state_moved,
    blocks_for,
    engines,
    hybrid_groups,
    kv_spec,
    rows,
    sliding_window_groups,
)

HEADS, HEAD = 4, 64


@pytest.mark.parametrize(
    ("p_tp", "p_bs", "d_tp", "d_bs", "offer_first", "prompt"),
    [(1, 16, 1, 16, True, 75), (1, 16, 1, 16, False, 65), (2, 16, 1, 32, True, 75), (1, 32, 2, 16, True, 65),
     (1, 32, 1, 32, True, 33)],
)  # fmt: skip
def test_push_heterogeneous_tp_and_block_sizes(pd: PD, p_tp: int, p_bs: int, d_tp: int, d_bs: int,
                                               offer_first: bool, prompt: int) -> None:  # fmt: skip
    """``prompt``: a whole number of blocks plus one token publishes a block the decode side does not load."""
    pre = pd.instance(
        "prefill", engines(tp=p_tp, seed=1, spec_for=kv_spec(p_bs)), sidecars="pre1kv" if d_tp > p_tp else ""
    )
    dec = pd.instance("decode", engines(tp=d_tp, seed=11, spec_for=kv_spec(d_bs)))
    p_table, d_table = blocks_for(prompt, p_bs, P_POOL), blocks_for(prompt, d_bs, D_POOL)
    dset = f"dec{d_tp}"
    before = [pd.sidecars.counter(dset, "kvxfer_transfers_total", direction=d, outcome="ok") for d in ("push", "read")]
    assert pd.push(pre, dec, "pkv", prompt, [p_table], [d_table], offer_first=offer_first) == set()
    after = [pd.sidecars.counter(dset, "kvxfer_transfers_total", direction=d, outcome="ok") for d in ("push", "read")]
    assert after[0] - before[0] == d_tp  # every decode rank was written into...
    assert after[1] == before[1]  # ...and none read
    pre.finished(sending="pkv")  # the writers freed their publish once every decode rank landed
    for n in LAYERS:
        assert torch.equal(rows(dec.engines, n, d_table, range(prompt - 1)),
                           rows(pre.engines, n, p_table, range(prompt - 1)))  # fmt: skip


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_push_mla_written_once_per_decode_rank(pd: PD, p_tp: int, d_tp: int) -> None:
    def make(_heads: int) -> KVCacheSpec:
        return mla_spec(block_size=16)

    pre = pd.instance("prefill", engines(tp=p_tp, seed=6, spec_for=make, total_kv_heads=1),
                      sidecars="pre1mla" if d_tp > p_tp else "")  # fmt: skip
    dec = pd.instance("decode", engines(tp=d_tp, seed=16, spec_for=make, total_kv_heads=1))
    prompt = 60
    p_table, d_table = blocks_for(prompt, 16, P_POOL), blocks_for(prompt, 16, D_POOL)
    assert pd.push(pre, dec, "pmla", prompt, [p_table], [d_table]) == set()
    pre.finished(sending="pmla")  # the unwritten replica is freed too
    tokens = range(prompt - 1)
    for n in LAYERS:
        want = token_rows(pre.engines[0], n, p_table, tokens)  # one replica, never a mix
        for e in dec.engines:
            assert torch.equal(token_rows(e, n, d_table, tokens), want)


def test_push_sliding_window_and_full_attention_groups(pd: PD) -> None:
    """The window group's publish starts at its tail (its origin): the offer names request positions."""
    window, bs = 32, 16

    pre = pd.instance("prefill", engines(groups=sliding_window_groups(window, bs), seed=7))
    dec = pd.instance("decode", engines(groups=sliding_window_groups(window, bs), seed=17))
    prompt = 100
    p_full, p_sw = [5, 9, 2, 7, 13, 21, 17], [0, 0, 0, 0, 3, 11, 1]
    d_full, d_sw = [3, 11, 4, 20, 8, 6, 15], [0, 0, 0, 0, 7, 9, 13]  # the decode side allocates the window only
    assert pd.push(pre, dec, "psw", prompt, [p_full, p_sw], [d_full, d_sw]) == set()
    pre.finished(sending="psw")
    loaded = prompt - 1
    for n in SW_LAYERS[::2]:
        assert torch.equal(rows(dec.engines, n, d_full, range(loaded)), rows(pre.engines, n, p_full, range(loaded)))
    for n in SW_LAYERS[1::2]:
        tail = range(4 * bs, loaded)
        assert torch.equal(rows(dec.engines, n, d_sw, tail), rows(pre.engines, n, p_sw, tail))


def test_push_attention_and_mamba_groups(pd: PD) -> None:
    bs = 16
    layers = MIXER_LAYERS
    pre = pd.instance("prefill", engines(groups=hybrid_groups(bs), seed=8))
    dec = pd.instance("decode", engines(groups=hybrid_groups(bs), seed=18))
    prompt = 70
    p_attn, d_attn = blocks_for(prompt, bs, P_POOL), blocks_for(prompt, bs, D_POOL)
    p_state, d_state = 22, 23
    before = block_rows(dec.engines[0], layers[2], d_state)
    assert pd.push(pre, dec, "phyb", prompt, [p_attn, [p_state]], [d_attn, [d_state]]) == set()
    pre.finished(sending="phyb")
    for n in layers[:2]:
        loaded = range(prompt - 1)
        assert torch.equal(rows(dec.engines, n, d_attn, loaded), rows(pre.engines, n, p_attn, loaded))
    mamba = layers[2]
    assert not torch.equal(block_rows(dec.engines[0], mamba, d_state), before)
    assert_mamba_state_moved(pre.engines[0], dec.engines[0], mamba, p_state, d_state)


@pytest.mark.parametrize("runner", RUNNERS)
def test_layerwise_push_lands_while_the_prefill_computes(pd: PD, runner: str) -> None:
    """``push_layerwise`` driven by vLLM's own model-runner code (V1's mixin, V2's ``ActiveKVConnector``), in its
    call order: each step's metadata is bound, the attention layers write their KV and call ``save_kv_layer``
    (vLLM's ``maybe_transfer_kv_layer``), and only then come ``start_load_kv`` and ``wait_for_save``. Every
    layer of every step is signalled, and before the publish the decode cache already holds every loaded
    token of every layer, as the attention backend reads it."""
    bs, prompt = 16, 75
    pre = pd.instance("prefill", engines(seed=2, spec_for=kv_spec(bs)), push_layerwise=True, runner=runner)
    dec = pd.instance("decode", engines(seed=12, spec_for=kv_spec(bs)))
    p_table, d_table = blocks_for(prompt, bs, P_POOL), blocks_for(prompt, bs, D_POOL)
    pre_params, dec_params = pd.push_params(pre, "lw")
    pd.offer(dec, "lw-d", prompt, dec_params, [d_table])
    time.sleep(0.3)  # the offer reaches the prefill sidecar
    sched = scheduler_connector(pre.scheduler, pre.engines[0])
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(pre_params)})
    preq = Request("lw", list(range(100, 100 + prompt)), sp, None)
    sched.on_new_request(preq)
    gen = torch.Generator().manual_seed(22)
    # Chunked prefill, as vLLM's scheduler reports it: tokens [0, 40) of a new request, then [40, 75).
    first = SchedulerOutput.make_empty()
    first.scheduled_new_reqs = [NewRequestData.from_request(preq, (p_table[:3],))]
    second = SchedulerOutput.make_empty()
    second.scheduled_cached_reqs = CachedRequestData(
        req_ids=["lw"], resumed_req_ids=set(), new_token_ids=[], all_token_ids={}, new_block_ids=[(p_table[3:],)],
        num_computed_tokens=[40], num_output_tokens=[0],
    )  # fmt: skip
    for out, tokens in ((first, range(0, 40)), (second, range(40, prompt))):
        out.num_scheduled_tokens = {"lw": len(tokens)}
        out.total_num_scheduled_tokens = len(tokens)
        out.kv_connector_metadata = sched.build_connector_meta(out)
        # Each layer's kernel writes the step's tokens into the cache, then vLLM's hook signals the layer.
        pre.vllm_step(out, functools.partial(write_tokens, table=p_table, tokens=tokens, gen=gen))
        preq.num_computed_tokens = tokens.stop
    assert all(w.layer_signals == 2 * len(LAYERS) for w in pre.workers)
    loaded = range(prompt - 1)
    deadline = time.monotonic() + 10
    while not all(torch.equal(rows(dec.engines, n_, d_table, loaded), rows(pre.engines, n_, p_table, loaded))
                  for n_ in LAYERS):  # fmt: skip
        assert time.monotonic() < deadline, "the streamed layers never landed"
        time.sleep(0.02)
    # Only now does the prefill finish and publish (the next step has no forward); the decode load has ended.
    preq.status = RequestStatus.FINISHED_LENGTH_CAPPED
    keep, _ = sched.request_finished(preq, p_table)
    assert keep is True
    last = SchedulerOutput.make_empty()
    last.finished_req_ids = {"lw"}
    last.kv_connector_metadata = sched.build_connector_meta(last)
    pre.vllm_step(last)
    _, recving, failed = dec.finished(recving="lw-d")
    dec.scheduler.loads_finished(recving)
    assert failed == set()
    pre.finished(sending="lw")
    written = pd.sidecars.counter("pre1", "kvxfer_transfer_bytes_total", direction="write")
    assert written > 0


def _prefill_published(pre: Instance, rid: str, params: dict[str, Any], prompt: int, table: list[int]) -> None:
    """The prefill request ``rid`` ends normally and its scheduler publishes it (push-mode ``params``)."""
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(params)})
    req = Request(rid, list(range(100, 100 + prompt)), sp, None)
    pre.scheduler.on_new_request(req)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = prompt
    keep, _ = pre.scheduler.request_finished(req, [table])
    assert keep is True


def test_decode_abort_mid_push_fences_and_frees_the_prefill(pd: PD) -> None:
    """A decode request aborted while its offer waits: the load ends only after the offer is revoked,
    its blocks stay untouched, and the prefill's later publish is freed at once (not at lease expiry)."""
    bs, prompt = 16, 70
    pre = pd.instance("prefill", engines(seed=4, spec_for=kv_spec(bs)))
    dec = pd.instance("decode", engines(seed=14, spec_for=kv_spec(bs)))
    p_table, d_table = blocks_for(prompt, bs, P_POOL), blocks_for(prompt, bs, D_POOL)
    before = {n: [block_rows(dec.engines[0], n, b) for b in d_table] for n in LAYERS}
    pre_params, dec_params = pd.push_params(pre, "ab")
    dreq = pd.offer(dec, "ab-d", prompt, dec_params, [d_table])
    time.sleep(0.3)  # offered
    dreq.status = RequestStatus.FINISHED_ABORTED  # the client went away
    assert dec.scheduler.request_finished(dreq, [d_table]) == (False, None)
    dec.step()  # the workers abort the load: Revoke, then the load ends
    _, recving, failed = dec.finished(recving="ab-d")
    assert failed == set()  # an abort is no load failure (vLLM frees the blocks itself)
    dec.scheduler.loads_finished(recving)
    _prefill_published(pre, "ab", pre_params, prompt, p_table)
    pre.step()
    pre.finished(sending="ab", timeout=5.0)  # freed at once: its reader gave up before it was published
    time.sleep(0.2)
    for n_ in LAYERS:
        assert all(torch.equal(block_rows(dec.engines[0], n_, b), was) for b, was in zip(d_table, before[n_],
                                                                                      strict=True))  # fmt: skip


@pytest.mark.parametrize("offer_first", [True, False])
def test_prefill_aborted_before_publishing_fails_the_decode_load_at_once(pd: PD, offer_first: bool) -> None:
    """A push-mode prefill that vLLM aborts (its client went away) publishes nothing. Its scheduler tells
    every rank's sidecar, whose offers for the push id fail at once (``Landed`` with ABORTED), and an offer
    that comes after is refused: the decode load ends failed within a second or two, not at its 30 s
    deadline, with nothing written into its blocks (``offer_first``: the decode side offered before the abort)."""
    bs, prompt = 16, 70
    rid = f"pab{int(offer_first)}"
    pre = pd.instance("prefill", engines(tp=2, seed=5, spec_for=kv_spec(bs)))
    dec = pd.instance("decode", engines(seed=15, spec_for=kv_spec(bs)))
    assert dec.workers[0].settings.transfer_timeout_seconds == 30.0  # the deadline it would otherwise wait for
    p_table, d_table = blocks_for(prompt, bs, P_POOL), blocks_for(prompt, bs, D_POOL)
    before = {n: [block_rows(dec.engines[0], n, b) for b in d_table] for n in LAYERS}

    def failures() -> list[float]:
        return [pd.sidecars.counter("dec1", "kvxfer_transfers_total", direction="push", outcome="failed"),
                pd.sidecars.counter("dec1", "kvxfer_transfer_failures_total", reason="aborted"),
                pd.sidecars.counter("dec1", "kvxfer_transfer_failures_total", reason="timeout")]  # fmt: skip

    was = failures()
    pre_params, dec_params = pd.push_params(pre, rid)

    def prefill_aborted() -> None:
        sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(pre_params)})
        preq = Request(rid, list(range(100, 100 + prompt)), sp, None)
        pre.scheduler.on_new_request(preq)
        preq.status = RequestStatus.FINISHED_ABORTED
        assert pre.scheduler.request_finished(preq, [p_table]) == (False, None)
        pre.step()

    if offer_first:
        pd.offer(dec, f"{rid}-d", prompt, dec_params, [d_table])
        time.sleep(0.3)  # the offers wait at both prefill ranks
        t0 = time.monotonic()
        prefill_aborted()
    else:
        prefill_aborted()
        time.sleep(0.3)  # the prefill sidecars heard the abort
        t0 = time.monotonic()
        pd.offer(dec, f"{rid}-d", prompt, dec_params, [d_table])
    _, recving, failed = dec.finished(recving=f"{rid}-d", timeout=5.0)
    took = time.monotonic() - t0
    dec.scheduler.loads_finished(recving)
    assert took < 5.0
    assert failed == set()  # one full-attention group: vLLM takes the failed blocks (and recomputes them)
    assert dec.workers[0].load_errors() == set(d_table)
    now = failures()
    assert [now[0] - was[0], now[1] - was[1], now[2] - was[2]] == [1, 1, 0]  # ABORTED, not the deadline
    for n_ in LAYERS:
        assert all(torch.equal(block_rows(dec.engines[0], n_, b), w) for b, w in zip(d_table, before[n_],
                                                                                   strict=True))  # fmt: skip


@pytest.mark.parametrize("how", ["prefix_hit", "aborted_while_queued"])
def test_decode_drop_before_the_publish_frees_it_at_once(pd: PD, how: str) -> None:
    """The decode side gives up on a push request before its prefill published it: vLLM's local prefix cache
    covered every token to load (``prefix_hit``), or the request was aborted while it waited for blocks. Its
    drop reaches every prefill rank before the publish, which is then freed at once (the prefill worker hears
    the release) rather than held for the lease (20 s here)."""
    bs, prompt = 16, 70
    rid = f"pdrop{int(how == 'prefix_hit')}"
    pre = pd.instance("prefill", engines(tp=2, seed=9, spec_for=kv_spec(bs)))
    dec = pd.instance("decode", engines(seed=19, spec_for=kv_spec(bs)))
    p_table = blocks_for(prompt, bs, P_POOL)
    pre_params, dec_params = pd.push_params(pre, rid)
    dreq = decode_request(f"{rid}-d", prompt, dec_params)
    if how == "prefix_hit":
        assert dec.scheduler.matched_tokens(dreq, prompt - 1) == (0, False)  # vLLM found every token locally
        dec.scheduler.after_alloc(dreq, [], 0)
    else:
        assert dec.scheduler.matched_tokens(dreq, 0) == (prompt - 1, True)  # queued: no blocks for it yet
        dreq.status = RequestStatus.FINISHED_ABORTED
        assert dec.scheduler.request_finished(dreq, [[]]) == (False, None)
    dec.step()  # rank 0's worker has its sidecar drop it at every prefill rank
    time.sleep(1.0)  # the drop reached them
    _prefill_published(pre, rid, pre_params, prompt, p_table)
    pre.step()
    t0 = time.monotonic()
    pre.finished(sending=rid, timeout=5.0)  # released on every rank: its reader gave up before it existed
    assert time.monotonic() - t0 < 5.0
    assert pd.sidecars.counter("pre2", "kvxfer_leases_active") == 0

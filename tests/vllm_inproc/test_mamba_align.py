"""kvxfer moves the right Mamba state block under vLLM's "align" mamba cache mode, per vLLM's own block manager.

With prefix caching on, vLLM runs hybrid attention + Mamba models in ``mamba_cache_mode="align"``: a
request's Mamba block table has ``cdiv(num_tokens, block_size)`` entries (plus the speculative scratch
slots), the running state sits at index ``cdiv(num_tokens, block_size) - 1`` and the entries before it
are null or older states. kvxfer moves one block per request for such a group (``published_blocks`` on
the prefill side, ``group_pull`` on the decode side), chosen as the last non-null block before the
scratch slots. These tests build the tables with vLLM's real ``KVCacheManager`` (and its ``MambaManager``),
driven as vLLM's scheduler drives it, and check that kvxfer's choice is the block vLLM's worker uses:

* prefill side: a prompt of N tokens is truncated by kvxfer to P = N - 1 and computed in the steps
  vLLM's scheduler makes of it (its own ``Scheduler._mamba_block_aligned_split`` cuts every step); the
  published block must be the one ``mamba_get_block_table_tensor`` hands the Mamba kernels for
  ``seq_len = P`` (where the last step wrote the state of all P tokens), i.e. ``table[(P - 1) // block_size]``;
* decode side: the same N-token prompt, E = N - 1 tokens loaded asynchronously by the connector
  (``allocate_slots`` with ``num_external_computed_tokens=E, delay_cache_blocks=True`` as the scheduler
  calls it for ``load_kv_async``); the block kvxfer loads into must be the one the worker reads the state
  of E computed tokens from: ``preprocess_mamba`` (vllm/v1/worker/mamba_utils.py) copies a new request's
  state from ``prev_state_idx = (num_computed_tokens - 1) // block_size``, the same block
  ``mamba_get_block_table_tensor`` returns for ``seq_len = E``, i.e. ``table[(E - 1) // block_size]``.
  It must not be a cached (shared) block, and must still sit there once vLLM allocates the first decode
  step's slots (when ``preprocess_mamba`` reads it).

Each runs for prompts within the first block, at block boundaries and over several blocks; with 0 and 1
speculative scratch slots; with and without in-chunk prefill checkpoints (Mamba-2's spec asks for them);
cold, and warm: an earlier request sharing the prompt's first blocks left cached states behind, so the
table starts with a prefix-cache hit (the warm decode case whose hit covers all E tokens loads nothing).

``preprocess_mamba`` itself needs a model runner's input batch, so the worker-side index comes from
``mamba_get_block_table_tensor`` (plain torch, called here on CPU), whose ``(seq_lens - 1) // block_size``
is the same formula.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.request import Request

from kvxfer.integrations.vllm.groups import TransferGroup
from kvxfer.integrations.vllm.params import RemoteGroup
from kvxfer.integrations.vllm.plan import NULL_BLOCK, GroupPull, group_pull, published_blocks
from kvxfer.integrations.vllm.spec import transfer_groups
from tests.vllm_inproc.engine import attention_spec

BS = 16  # attention and Mamba block size, and the hash block size (as vLLM aligns them in "align" mode)
MAMBA = 1  # index of the Mamba group in the KV-cache config
MAX_MODEL_LEN = 1024
BUDGET = 2 * BS + 8  # tokens a step may schedule: vLLM cuts a prefill step at a block boundary
REMOTE_BLOCK = 7  # the block id the prefill side published

#: Prompt lengths N: P = N - 1 inside the first block, at block boundaries, over several blocks.
PROMPTS = [5, BS, BS + 1, 2 * BS + 1, 2 * BS + 9, 3 * BS + 7, 4 * BS]
#: The earlier request of the "warm" cases, and the prefix-cache hit it leaves for the longer prompts.
WARM = 2 * BS + 3
WARM_HIT = 2 * BS


def kv_cache_config(spec_blocks: int, checkpoint: bool) -> KVCacheConfig:
    """One full-attention group and one Mamba group in "align" mode, as a hybrid model has with prefix caching.

    ``checkpoint``: the Mamba layer exports block-boundary states from inside a prefill chunk, as
    ``MambaMixer2.get_kv_cache_spec`` declares (``num_prefill_checkpoint_blocks=1``): the last chunk of a
    prompt then spans several blocks and its table gets a checkpoint block just before the running state.
    """
    attn = attention_spec(block_size=BS, heads=2, head_size=8)
    mamba = MambaSpec(
        block_size=BS,
        shapes=((3, 24), (2, 8, 16)),
        dtypes=(torch.float16, torch.float32),
        mamba_cache_mode="align",
        num_speculative_blocks=spec_blocks,
        num_prefill_checkpoint_blocks=int(checkpoint),
        prefill_checkpoint_alignment=1 if checkpoint else None,
    )
    groups = [KVCacheGroupSpec(["attn"], attn), KVCacheGroupSpec(["mamba"], mamba)]
    return KVCacheConfig(num_blocks=128, kv_cache_tensors=[], kv_cache_groups=groups)


def manager(config: KVCacheConfig) -> KVCacheManager:
    """vLLM's scheduler-side KV-cache manager with prefix caching on."""
    return KVCacheManager(
        config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=BS, hash_block_size=BS, enable_caching=True
    )


def request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    """A request with the block hasher vLLM's engine core gives every request when prefix caching is on."""
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BS, hash_fn)
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, list(range(100, 100 + prompt_len)), params, None, block_hasher=hasher)


def mamba_table(kv: KVCacheManager, rid: str) -> list[int]:
    """The request's Mamba block table, as the connector is handed it."""
    return list(kv.get_blocks(rid).get_block_ids()[MAMBA])


def kernel_block(config: KVCacheConfig, table: list[int], seq_len: int) -> int:
    """The state block vLLM's worker hands the Mamba kernels for a request of ``seq_len`` tokens."""
    spec = config.kv_cache_groups[MAMBA].kv_cache_spec
    assert isinstance(spec, MambaSpec)
    padded = torch.tensor([table + [NULL_BLOCK] * (MAX_MODEL_LEN // BS + 2 - len(table))], dtype=torch.int32)
    picked = mamba_get_block_table_tensor(padded, torch.tensor([seq_len], dtype=torch.int32), spec, "align")
    return int(picked[0, 0])


def mamba_group(config: KVCacheConfig, spec_blocks: int) -> TransferGroup:
    """kvxfer's transfer group for the Mamba group: one state block, ``spec_blocks`` scratch slots after it."""
    group = transfer_groups(config)[MAMBA]
    assert (group.role, group.spec_blocks) == ("state", spec_blocks)
    return group


def first_local_hit(kv: KVCacheManager, req: Request) -> tuple[KVCacheBlocks, int]:
    """``get_computed_blocks``: (the cached blocks, the number of cached tokens); 0.32 and 0.33 add more after those."""
    got = kv.get_computed_blocks(req)
    return got[0], int(got[1])


def scheduler_view(config: KVCacheConfig) -> SimpleNamespace:
    """What vLLM's ``Scheduler._mamba_block_aligned_split`` reads of its scheduler, for ``config`` (no EAGLE,
    no partial-block hash hits, no shared-prefix checkpoints, a token budget of ``BUDGET``)."""
    spec = config.kv_cache_groups[MAMBA].kv_cache_spec
    assert isinstance(spec, MambaSpec)
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS),
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        block_size=BS,
        hash_block_size=BS,
        max_num_scheduled_tokens=BUDGET,
        use_eagle_block_drop=False,
        mamba_partial_cache_hit=False,
        mamba_shared_prefix_checkpoint=False,
        mamba_has_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks > 0,
        mamba_prefill_checkpoint_alignment=spec.prefill_checkpoint_alignment,
        num_hash_lookahead_tokens=0,
    )


def compute(kv: KVCacheManager, config: KVCacheConfig, req: Request, upto: int, spec_blocks: int) -> int:
    """Schedule ``req`` step by step until ``upto`` tokens are computed, as vLLM's scheduler does; its local hit.

    Each step takes up to ``BUDGET`` tokens, cut where vLLM's own ``_mamba_block_aligned_split`` cuts them.
    """
    view = scheduler_view(config)
    kv.new_step_starts()
    blocks, hit = first_local_hit(kv, req)
    first = True
    while req.num_computed_tokens + (hit if first else 0) < upto:
        done = req.num_computed_tokens + (hit if first else 0)
        wanted = min(BUDGET, upto - done)
        chunk = Scheduler._mamba_block_aligned_split(view, req, wanted, hit if first else 0, 0)  # type: ignore[arg-type]
        assert chunk > 0
        got = kv.allocate_slots(
            req,
            chunk,
            num_new_computed_tokens=hit if first else 0,
            new_computed_blocks=blocks if first else None,
            num_lookahead_tokens=spec_blocks,
        )
        assert got is not None
        first = False
        req.num_computed_tokens = done + chunk  # the scheduler's schedule() and _update_after_schedule
        kv.new_step_starts()
    return hit


def expected_hit(prompt_len: int) -> int:
    """The warm cases' local hit: the warm request's state after ``WARM_HIT`` tokens (its last block boundary,
    where vLLM ended a chunk or wrote a checkpoint), found for a prompt with a token past it."""
    return WARM_HIT if prompt_len - 1 >= WARM_HIT else 0


def warm_up(kv: KVCacheManager, config: KVCacheConfig, spec_blocks: int) -> None:
    """An earlier request that shares the prompts' first ``WARM`` tokens ran to its end: its states are cached."""
    req = request("warm", WARM, max_tokens=1)
    compute(kv, config, req, WARM, spec_blocks)
    kv.free(req)
    kv.new_step_starts()


@pytest.mark.parametrize("checkpoint", [False, True], ids=["split", "checkpoint"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("spec_blocks", [0, 1])
@pytest.mark.parametrize("prompt_len", PROMPTS)
def test_prefill_publishes_the_running_state(prompt_len: int, spec_blocks: int, warm: bool, checkpoint: bool) -> None:
    """The block kvxfer publishes is the one vLLM's worker wrote the state of all P computed tokens to."""
    config = kv_cache_config(spec_blocks, checkpoint)
    group = mamba_group(config, spec_blocks)
    kv = manager(config)
    if warm:
        warm_up(kv, config, spec_blocks)
    computed = prompt_len - 1  # kvxfer truncates the prefill's prompt by one token
    req = request("pre", computed, max_tokens=1)
    hit = compute(kv, config, req, computed, spec_blocks)
    assert hit == (expected_hit(computed) if warm else 0)
    table = mamba_table(kv, "pre")

    state = table[(computed - 1) // BS]
    assert state != NULL_BLOCK
    assert kernel_block(config, table, computed) == state
    published = published_blocks(group, table, computed)
    assert published is not None
    assert published.block_ids == (state,), table


@pytest.mark.parametrize("checkpoint", [False, True], ids=["split", "checkpoint"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("spec_blocks", [0, 1])
@pytest.mark.parametrize("prompt_len", PROMPTS)
def test_decode_loads_into_the_state_vllm_resumes_from(
    prompt_len: int, spec_blocks: int, warm: bool, checkpoint: bool
) -> None:
    """The block kvxfer loads into is the one vLLM's worker reads the state of E loaded tokens from."""
    config = kv_cache_config(spec_blocks, checkpoint)
    group = mamba_group(config, spec_blocks)
    kv = manager(config)
    if warm:
        warm_up(kv, config, spec_blocks)
    external = prompt_len - 1
    req = request("dec", prompt_len, max_tokens=8)
    blocks, hit = first_local_hit(kv, req)
    assert hit == (expected_hit(prompt_len) if warm else 0)
    if hit == external:
        return  # kvxfer's matched_tokens: the local prefix cache covers the prefill's tokens, nothing is loaded
    cached = set(blocks.get_block_ids()[MAMBA]) - {NULL_BLOCK}
    # The scheduler for a load_kv_async request (kvxfer's connector keeps vLLM's default
    # supports_divergent_local_hybrid_hits=False, so the lookup above is get_computed_blocks):
    # no new tokens, no lookahead, blocks cached once loaded.
    got = kv.allocate_slots(
        req,
        0,
        num_new_computed_tokens=hit,
        new_computed_blocks=blocks,
        num_lookahead_tokens=0,
        num_external_computed_tokens=external - hit,
        delay_cache_blocks=True,
        skip_zeroing_group_ids=(0, MAMBA),  # kvxfer's get_loaded_kv_cache_group_ids: every group is loaded
    )
    assert got is not None
    req.num_computed_tokens = external
    table = mamba_table(kv, "dec")

    state = table[(external - 1) // BS]
    assert state != NULL_BLOCK
    assert state not in cached  # a cached state is shared: a load must never write it
    assert kernel_block(config, table, external) == state
    remote = RemoteGroup("mamba", (REMOTE_BLOCK,), BS, (external - 1) // BS, None, None)
    pull = group_pull(group, remote, table, hit, external)
    assert isinstance(pull, GroupPull), pull
    assert (pull.local_blocks, pull.remote_blocks) == ((state,), (REMOTE_BLOCK,)), table

    # The load finished: vLLM caches the loaded tokens, then schedules token N (one new token).
    kv.new_step_starts()
    kv.cache_blocks(req, external)
    got = kv.allocate_slots(req, 1, num_lookahead_tokens=spec_blocks)
    assert got is not None
    after = mamba_table(kv, "dec")
    assert after[(external - 1) // BS] == state, (table, after)

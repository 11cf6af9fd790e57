"""group_offer (push mode) against group_pull (pull mode): the decode side offers exactly what it would pull.

Property test: for random block sizes, prompts, prefix-cache hits and sliding windows, the blocks
a push offers, its token span and its skip equal those of a pull from a publish of the whole
prompt, and the request position it names is where that pull starts reading.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.errors import KvxferError, Reason
from kvxfer.integrations.vllm.params import RemoteGroup
from kvxfer.integrations.vllm.plan import (
    NULL_BLOCK,
    GroupPull,
    attended_from,
    group_offer,
    group_pull,
    published_blocks,
    stage_addresses,
)
from kvxfer.integrations.vllm.spec import TransferGroup


@st.composite
def cases(draw: st.DrawFn) -> tuple[TransferGroup, list[int], int, int]:
    bs = draw(st.sampled_from([16, 32, 64]))
    role = draw(st.sampled_from(["full", "window", "chunked"]))
    window = draw(st.sampled_from([32, 100, 128])) if role == "window" else 0
    chunk = draw(st.sampled_from([64, 128, 256])) if role == "chunked" else 0
    prompt = draw(st.integers(2, 400))
    end = prompt - 1
    nblocks = math.ceil(prompt / bs)
    hit = draw(st.integers(0, max(0, end - 1) // bs)) * bs  # the local prefix cache: whole blocks
    table = list(range(1, nblocks + 1))
    group = TransferGroup(0, "g0", role, bs, window, chunk=chunk)
    # vLLM frees the blocks the window (chunk) left: null blocks in the table (get_num_skipped_tokens(end) // bs)
    first_needed = attended_from(group, end) // bs
    table = [NULL_BLOCK] * first_needed + table[first_needed:]
    return group, table, hit, end


@settings(max_examples=300, deadline=None)
@given(cases())
def test_an_offer_is_the_pull_it_replaces(case: tuple[TransferGroup, list[int], int, int]) -> None:
    group, table, start, end = case
    whole = RemoteGroup("g0", tuple(range(100, 100 + len(table))), group.block_size)
    pulled = group_pull(group, whole, table, start, end)
    offered = group_offer(group, table, start, end)
    if not isinstance(pulled, GroupPull):
        assert offered == pulled  # the same refusal (a reason) or nothing to load (None)
        return
    assert isinstance(offered, GroupPull)
    assert offered.remote_blocks == ()  # nothing is published yet
    assert (offered.local_blocks, offered.num_tokens, offered.local_skip) == (
        pulled.local_blocks,
        pulled.num_tokens,
        pulled.local_skip,
    )
    # The request position it names is where the pull reads from in the (whole) publish.
    assert offered.remote_skip == (pulled.remote_blocks[0] - 100) * group.block_size + pulled.remote_skip


def test_a_state_group_offers_its_one_block_whole() -> None:
    group = TransferGroup(1, "g1", "state", 96, spec_blocks=0)
    got = group_offer(group, [0, 0, 7], 0, 200)
    assert got == GroupPull(1, (7,), ())
    assert published_blocks(group, [0, 0, 7], 200) == RemoteGroup("g1", (7,), 96, 2, tp_split=False)
    split = TransferGroup(1, "g1", "state", 96, tp_split=True, segments=(48, 12, 12, 512))
    assert published_blocks(split, [0, 0, 7], 200) == RemoteGroup("g1", (7,), 96, 2, True, (48, 12, 12, 512))
    replicated = TransferGroup(1, "g1", "state", 96, tp_split=True)
    assert published_blocks(replicated, [0, 0, 7], 200) == RemoteGroup("g1", (7,), 96, 2, True, ())
    assert group_offer(group, [0, 0, 0], 0, 200) == "no state block is allocated for the request"


def test_addresses_that_do_not_split_into_stages_are_the_callers_mistake() -> None:
    # A plain KvxferError read as status and reason INTERNAL ("a bug").
    with pytest.raises(KvxferError) as refused:
        stage_addresses(["a:1", "b:1", "c:1"], 0, 2)
    assert (refused.value.status, refused.value.reason, refused.value.field) == (
        "INVALID_ARGUMENT", Reason.INVALID_FIELD, "kvxfer_addresses")  # fmt: skip

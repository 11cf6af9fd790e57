"""The decode scheduler's Prepare as vLLM allocates blocks: what it sends, and when it stops asking.

The Prepare's effect on a pull (a plan the Pull reads on) is tested against real sidecars in
tests/sidecar/test_prepare.py and, through both connector halves, in tests/vllm_inproc.
"""

from __future__ import annotations

import concurrent.futures as cf
from types import SimpleNamespace

import grpc

from kvxfer.client import KvxferRpcError
from kvxfer.client.types import TokenSpan
from kvxfer.integrations.vllm.params import RemotePrefill
from kvxfer.integrations.vllm.plan import GroupPull, PullSpec, pull_arguments, stage_addresses
from kvxfer.integrations.vllm.scheduler import SchedulerSide
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.spec import TransferGroup


def test_pull_arguments_name_every_sidecar_group_of_each_vllm_group() -> None:
    spec = PullSpec("r", None, (GroupPull(0, (5, 6), (1, 2), num_tokens=40, local_skip=0, remote_skip=8),
                                GroupPull(1, (9,), (3,))))  # fmt: skip
    args = pull_arguments(spec, lambda i: {0: ["g0.0", "g0.1"], 1: ["g1"]}[i])
    assert args.local_blocks == {"g0.0": (5, 6), "g0.1": (5, 6), "g1": (9,)}
    assert args.remote_blocks == {"g0.0": (1, 2), "g0.1": (1, 2), "g1": (3,)}
    assert args.spans == {"g0.0": TokenSpan(40, 0, 8), "g0.1": TokenSpan(40, 0, 8)}
    push = pull_arguments(PullSpec("r", None, spec.groups, push=True), lambda i: [f"g{i}"])
    assert push.remote_blocks is None  # the writer's ids are its publish


def test_each_pipeline_stage_reads_its_own_prefill_ranks() -> None:
    addresses = ("a:1", "b:1", "c:1", "d:1")
    assert stage_addresses(addresses, 0, 2) == ["a:1", "b:1"]
    assert stage_addresses(addresses, 1, 2) == ["c:1", "d:1"]


def test_a_sidecar_without_prepare_is_not_asked_again() -> None:
    # An older sidecar answers UNIMPLEMENTED (this one cannot be made to): the future as its client resolves it.
    sched = SchedulerSide(ConnectorSettings(), engine_id="d", groups=[TransferGroup(0, "attn", "full", 16)])
    failed: cf.Future[bool] = cf.Future()
    failed.set_exception(KvxferRpcError(grpc.StatusCode.UNAVAILABLE, "the sidecar restarted", "Prepare"))
    sched._prepared("r1", 0, failed)
    assert sched._prepare_supported  # any other failure: the next request is prepared again
    old: cf.Future[bool] = cf.Future()
    old.set_exception(KvxferRpcError(grpc.StatusCode.UNIMPLEMENTED, "method: no method 10", "Prepare"))
    sched._prepared("r2", 0, old)
    assert not sched._prepare_supported
    sched._rank_groups = [("g0",)]  # as the sidecar's status named them
    remote = RemotePrefill("p-r3", "p", ("10.0.0.1:5000",), ())
    sched._prepare(PullSpec("r3", remote, (GroupPull(0, (5,), (1,)),)))
    assert sched._clients is None  # no sidecar was called


def test_a_streamed_prefill_names_the_engine_its_publish_will_be_bound_to() -> None:
    """Layer-wise push: each step's StreamSpec carries the proxy's kvxfer_reader_engine_id (the worker puts it in
    StreamStep, and the prefill sidecar streams only into that engine's offers); without one it names none, and
    a reader that is not a string leaves the request unstreamed (its publish writes it whole)."""
    sched = SchedulerSide(ConnectorSettings(push_layerwise=True), engine_id="p",
                          groups=[TransferGroup(0, "attn", "full", 16)])  # fmt: skip

    def request(rid: str, **params: object) -> SimpleNamespace:
        kv = {"do_remote_decode": True, "kvxfer_push": True, "kvxfer_push_id": f"push-{rid}", **params}
        return SimpleNamespace(request_id=rid, kv_transfer_params=kv, num_prompt_tokens=40,
                               prompt_token_ids=list(range(40)))  # fmt: skip

    sched.on_new_request(request("a", kvxfer_reader_engine_id="decode-a"))
    sched.on_new_request(request("b"))
    sched.on_new_request(request("c", kvxfer_reader_engine_id=7))
    sched.step_streams([("a", [[5, 6, 7]], 0, 40, True), ("b", [[8, 9, 10]], 0, 40, True),
                        ("c", [[11, 12, 13]], 0, 40, True)])  # fmt: skip
    specs = sched.build_plan().streams
    assert [(s.request_id, s.reader, s.groups, s.start, s.end) for s in specs] == [
        ("push-a", "decode-a", (((5, 6, 7), 0),), 0, 40),
        ("push-b", "", (((8, 9, 10), 0),), 0, 40),
    ]
    sched.close()

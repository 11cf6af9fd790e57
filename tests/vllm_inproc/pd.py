"""A prefill and a decode "instance" made of the connector's vLLM-free halves and vLLM-made caches.

Each instance has one :class:`~kvxfer.integrations.vllm.worker.WorkerSide` per rank (registered
with that rank's sidecar through ``sidecar_socket`` with ``{rank}``) and one
:class:`~kvxfer.integrations.vllm.scheduler.SchedulerSide`; requests are vLLM's own ``Request``
objects, driven through the calls vLLM's scheduler makes (``on_new_request``,
``request_finished``, ``get_num_new_matched_tokens``, ``update_state_after_alloc``, one
``build_connector_meta`` per step, ``get_finished`` on every worker).
"""

from __future__ import annotations

import functools
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families
from vllm import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from kvxfer.client import Client
from kvxfer.harness.cluster import LocalCluster, SidecarProc
from kvxfer.integrations.vllm.connector import KvxferConnector, KvxferConnectorMetadata
from kvxfer.integrations.vllm.params import push_params
from kvxfer.integrations.vllm.scheduler import SchedulerSide
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.spec import reports_failed_blocks, transfer_groups
from kvxfer.integrations.vllm.worker import WorkerSide
from kvxfer.topology import RankInfo
from tests.vllm_inproc.engine import Engine, as_row_bytes, vllm_parts, write_random
from tests.vllm_inproc.runners import RankRunner, results, worker_connector

__all__ = [
    "PD",
    "SIDECAR_SETS",
    "Instance",
    "Sidecars",
    "block_rows",
    "decode_request",
    "fill_random",
    "prefill_request",
    "token_rows",
    "write_tokens",
]

Tables = Sequence[Sequence[int]]


def prefill_request(rid: str, prompt_len: int) -> Request:
    """A request the proxy sent to the prefill instance (``do_remote_decode``)."""
    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    return Request(rid, list(range(100, 100 + prompt_len)), params, None)


def decode_request(rid: str, prompt_len: int, params: dict[str, Any]) -> Request:
    """The same prompt sent to the decode instance with the prefill's ``kv_transfer_params``."""
    sp = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": dict(params)})
    return Request(rid, list(range(100, 100 + prompt_len)), sp, None)


#: Flags of a sidecar set whose workers run the data plane themselves.
WORKER_HOSTED = ("--backend", "worker")

#: The sidecar sets of the session: name -> (role, ranks). ``pre<tp>``/``dec<tp>`` serve instances of that TP
#: size by default. The others are for tests that need sidecars no other test has used: one where several decode
#: ranks read one prefill rank (a prefill sidecar keeps the identity of a decode sidecar from its last handshake: see
#: test_pull.py::test_reader_reconfigured_while_its_sidecar_ran), the two reconfiguration tests themselves, and the
#: restart test (which kills its sidecar).
SIDECAR_SETS = {
    "pre1": ("prefill", 1), "pre2": ("prefill", 2), "dec1": ("decode", 1), "dec2": ("decode", 2),
    "pre1kv": ("prefill", 1), "pre1fp4": ("prefill", 1), "pre1mla": ("prefill", 1), "pre1mamba": ("prefill", 1),
    "pre1cfg": ("prefill", 1), "dec2cfg": ("decode", 2), "pre2cfg": ("prefill", 2), "dec1cfg": ("decode", 1),
    "prst": ("prefill", 1), "pexit": ("prefill", 1),
    # Two pipeline stages of one rank each (a set's sockets are numbered by rank, stage by stage).
    "prepp2": ("prefill", 2), "decpp2": ("decode", 2),
    # --backend worker: each worker's own NIXL agent moves the bytes (connector data_plane "worker").
    "prew2": ("prefill", 2, WORKER_HOSTED), "decw1": ("decode", 1, WORKER_HOSTED),
}  # fmt: skip


@dataclass
class Sidecars:
    """Sets of sidecars (one per rank of an instance) shared by the session's tests.

    A set is named like its engine id; its ``sidecar_socket`` template is ``<set>-{rank}.sock``. A
    test's workers register their caches (replacing the previous test's registration) and close at
    the test's end. Instances of different TP sizes use different sets: a decode sidecar keeps its
    handshake with a prefill sidecar, which names that rank's place in its TP group.
    """

    cluster: LocalCluster
    sets: dict[str, list[SidecarProc]]

    @classmethod
    def start(cls, cluster: LocalCluster, sets: dict[str, tuple[Any, ...]], flags: Sequence[str] = ()) -> Sidecars:
        procs = {
            name: [
                cluster.start_sidecar(f"{name}-{r}", name, role, flags=(*flags, *(f for m in more for f in m)))
                for r in range(tp)
            ]
            for name, (role, tp, *more) in sets.items()
        }
        return cls(cluster, procs)

    def socket(self, name: str) -> str:
        """``sidecar_socket`` of set ``name``: a template with ``{rank}``."""
        assert name in self.sets, name
        return str(self.cluster.dir / f"{name}-{{rank}}.sock")

    def counter(self, name: str, sample: str, **labels: str) -> float:
        """Sum of one metric sample over the sidecars of set ``name`` (from their /metrics)."""
        total = 0.0
        for sc in self.sets[name]:
            with urllib.request.urlopen(f"http://127.0.0.1:{sc.metrics_port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            for family in text_string_to_metric_families(text):
                for smp in family.samples:
                    if smp.name == sample and all(smp.labels.get(k) == v for k, v in labels.items()):
                        total += smp.value
        return total

    def check_idle(self, wait_s: float = 5.0) -> None:
        """No publish left behind (a later test could not replace the registration).

        A reader's DONE notice frees its publish a few milliseconds after the pull's answer (notices
        wait ~5 ms for company), and a closed worker's publishes go when its sidecar sees it gone: wait
        up to ``wait_s`` for the count to reach 0.
        """
        for procs in self.sets.values():
            for sc in procs:
                if sc.proc.poll() is not None:
                    continue
                client = Client(sc.local_socket, timeout=5)
                try:
                    until = time.monotonic() + wait_s
                    while (leases := client.status()["leases"]) and time.monotonic() < until:
                        time.sleep(0.02)
                finally:
                    client.close()
                assert leases == 0, f"{sc.name}: {leases} publishes left behind"


@dataclass
class Instance:
    """One vLLM instance: its ranks' engines and workers, and its scheduler.

    ``connectors``: the connector class vLLM loads, around each rank's worker; ``runners``: vLLM's model-runner
    code driving them (:meth:`vllm_step`), for an instance made with a ``runner``.
    """

    engine_id: str
    engines: list[Engine]
    workers: list[WorkerSide]
    scheduler: SchedulerSide
    connectors: list[KvxferConnector] = field(default_factory=list)
    runners: list[RankRunner] = field(default_factory=list)
    #: Per rank: what vLLM's runner collected in :meth:`vllm_step` (its get_transfer_results), for finished().
    backlog: list[tuple[set[str], set[str], set[str]]] = field(default_factory=list)

    def finished(self, timeout: float = 20.0, **want: str) -> tuple[set[str], set[str], set[str]]:
        """Poll every worker's ``finished()`` (as vLLM does each step) until ``sending``/``recving`` ids show up.

        A request counts once every rank reported it. Returns (sending, recving, failed) of all ranks,
        with what the runner's steps collected before (failures there: those vLLM takes per request).
        """
        got: list[tuple[set[str], set[str], set[str]]] = [(set(), set(), set()) for _ in self.workers]
        for i, (s, r, f) in enumerate(self.backlog):
            got[i][0].update(s)
            got[i][1].update(r)
            got[i][2].update(f)
        self.backlog = [(set(), set(), set()) for _ in self.workers]
        deadline = time.monotonic() + timeout
        while True:
            for i, w in enumerate(self.workers):
                s, r, f = w.finished()
                got[i][0].update(s)
                got[i][1].update(r)
                got[i][2].update(f)
            done = all(
                (want.get("sending") is None or want["sending"] in g[0])
                and (want.get("recving") is None or want["recving"] in g[1])
                for g in got
            )
            if done:
                return (set.union(*(g[0] for g in got)), set.union(*(g[1] for g in got)),
                        set.union(*(g[2] for g in got)))  # fmt: skip
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.engine_id}: {want} not reported within {timeout}s: {got}")
            time.sleep(0.02)

    def step(self) -> None:
        """One engine step without a forward pass: the scheduler's plan goes to every worker through the
        connector's hooks, in the order vLLM's model runners call them (what ended is polled by finished())."""
        meta = KvxferConnectorMetadata(self.scheduler.build_plan())
        for conn in self.connectors:
            conn.bind_connector_metadata(meta)
            conn.start_load_kv(None)  # type: ignore[arg-type]  # kvxfer does not read the forward context
            conn.wait_for_save()
            conn.clear_connector_metadata()

    def vllm_step(self, out: SchedulerOutput, write_kv: Callable[[Engine, str], None] | None = None) -> None:
        """One engine step run by vLLM's model-runner code on every rank (:mod:`tests.vllm_inproc.runners`).

        ``out``: the scheduler's output, its ``kv_connector_metadata`` set; ``write_kv(engine, layer)``: what
        each attention layer's kernel writes into that rank's cache in the forward pass (None: no forward).
        """
        assert self.runners, "an instance made with runner=... runs vLLM's runner code"
        if not self.backlog:
            self.backlog = [(set(), set(), set()) for _ in self.workers]
        for i, runner in enumerate(self.runners):
            each = None if write_kv is None else functools.partial(write_kv, runner.engine)
            for have, new in zip(self.backlog[i], results(runner.step(out, each)), strict=True):
                have.update(new)


@dataclass
class PD:
    """Builds instances on the session's sidecars and closes them at the end of a test."""

    sidecars: Sidecars
    made: list[Any] = field(default_factory=list)

    def instance(
        self, role: str, engines: Sequence[Engine], *, sidecars: str = "", engine_id: str = "", pp: int = 1,
        runner: str = "", **settings: Any,
    ) -> Instance:  # fmt: skip
        """Workers for ``engines`` (one per rank, in rank order: pipeline stage by stage) registered with a
        sidecar set.

        ``sidecars``: the set's name (default ``pre<tp>`` or ``dec<tp>``); ``pp``: pipeline stages;
        ``runner``: ``v1`` or ``v2``, vLLM's model runner whose code drives the connector (``Instance.vllm_step``).
        """
        tp = len(engines) // pp
        cs = ConnectorSettings(sidecar_socket=self.sidecars.socket(sidecars or f"{role[:3]}{tp}"), **settings)
        workers, runners = [], []
        for r, eng in enumerate(engines):
            w = WorkerSide(
                cs,
                rank=RankInfo(r % tp, tp, r // tp, pp),
                local_rank=r,
                worker_id=f"{role}-{r}",
                block_errors=reports_failed_blocks(eng.kv_cache_config),
            )  # as the connector does
            self.made.append(w)
            if runner:  # registered as that vLLM model runner registers the caches: through the connector
                runners.append(RankRunner(runner, w, eng))
                runners[-1].register()
            else:
                w.register(eng.describe(), eng.kv_caches)
            workers.append(w)
        groups = transfer_groups(engines[0].kv_cache_config, tp)
        sched = SchedulerSide(cs, engine_id=engine_id or f"vllm-{role}", groups=groups, tp_size=tp, pp_size=pp)
        self.made.append(sched)
        connectors = [r.connector for r in runners] or [
            worker_connector(w, e) for w, e in zip(workers, engines, strict=True)
        ]
        return Instance(engine_id or f"vllm-{role}", list(engines), workers, sched, connectors, runners)

    def publish(self, p: Instance, rid: str, prompt_len: int, tables: Tables) -> dict[str, Any]:
        """Run a prefill request through the prefill scheduler: published on every rank; returns the params."""
        req = prefill_request(rid, prompt_len)
        p.scheduler.on_new_request(req)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        req.num_computed_tokens = len(req.prompt_token_ids or ())
        keep, params = p.scheduler.request_finished(req, [list(t) for t in tables])
        assert keep is True
        assert params is not None
        p.step()
        return params

    def load(
        self, d: Instance, rid: str, prompt_len: int, params: dict[str, Any], tables: Tables, *, computed: int = 0
    ) -> set[str]:
        """Run the decode request: match, allocate, one step, until every rank's load ended; returns failures."""
        req = decode_request(rid, prompt_len, params)
        n, is_async = d.scheduler.matched_tokens(req, computed)
        expected = min(prompt_len - 1, params.get("remote_num_tokens") or prompt_len) - computed
        assert (n, is_async) == (expected, True), (n, is_async, expected)
        d.scheduler.after_alloc(req, [list(t) for t in tables], n)
        d.step()
        _, recving, failed = d.finished(recving=rid)
        d.scheduler.loads_finished(recving)
        return failed

    def push(
        self, p: Instance, d: Instance, rid: str, prompt_len: int, p_tables: Tables, d_tables: Tables, *,
        computed: int = 0, offer_first: bool = True,
    ) -> set[str]:  # fmt: skip
        """One request in push mode, as a proxy runs it: the decode instance allocates and offers its blocks
        (``offer_first``: before the prefill finishes), the prefill publishes under the proxy's id and
        its sidecars WRITE; returns the decode side's failed loads once every rank's load ended.
        """
        pre_params, dec_params = self.push_params(p, rid)

        def decode_side() -> None:
            self.offer(d, f"{rid}-d", prompt_len, dec_params, d_tables, computed=computed)

        def prefill_side() -> None:
            sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(pre_params)})
            req = Request(rid, list(range(100, 100 + prompt_len)), sp, None)
            p.scheduler.on_new_request(req)
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            req.num_computed_tokens = len(req.prompt_token_ids or ())
            keep, params = p.scheduler.request_finished(req, [list(t) for t in p_tables])
            assert keep is True
            assert params is not None
            assert params["remote_request_id"] == f"push-{rid}"
            p.step()

        first, second = (decode_side, prefill_side) if offer_first else (prefill_side, decode_side)
        first()
        if offer_first:
            time.sleep(0.2)  # the offers are at the prefill sidecars before the publish
        second()
        _, recving, failed = d.finished(recving=f"{rid}-d")
        d.scheduler.loads_finished(recving)
        return failed

    @staticmethod
    def push_params(p: Instance, rid: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a push-mode proxy sends the prefill and the decode instance for ``rid`` (id ``push-<rid>``)."""
        addresses = [w.registration["peer_address"] for w in p.workers]
        return push_params(push_id=f"push-{rid}", addresses=addresses,
                           sidecar_engine_id=p.workers[0].registration["engine_id"])  # fmt: skip

    @staticmethod
    def offer(
        d: Instance, rid: str, prompt_len: int, params: dict[str, Any], d_tables: Tables, *, computed: int = 0
    ) -> Request:
        """The decode side of a push: match, allocate, one step (each rank's sidecar offers its blocks)."""
        req = decode_request(rid, prompt_len, params)
        n, is_async = d.scheduler.matched_tokens(req, computed)
        assert (n, is_async) == (prompt_len - 1 - computed, True), (n, is_async)
        d.scheduler.after_alloc(req, [list(t) for t in d_tables], n)
        d.step()
        return req

    def close(self) -> None:
        for m in reversed(self.made):
            m.close()
        self.made.clear()


# ------------------------------------------------------------------------------ reading caches
def fill_random(engine: Engine, seed: int) -> None:
    """Random bit patterns in every cell of every layer, written through vLLM's accessors."""
    gen = torch.Generator().manual_seed(seed)
    for name in engine.kv_caches:
        write_random(vllm_parts(engine, name), gen)


def _geometry(engine: Engine, layer: str) -> tuple[int, int, int]:
    """(block size, kernel blocks per block, tokens per kernel block) of a layer, from vLLM's spec and view."""
    bs = int(engine.spec_of(layer).block_size)
    view = engine.kv_caches[layer]
    r = view.shape[0] // engine.kv_cache_config.num_blocks if view.dim() == 4 else view.shape[1]
    return bs, r, bs // r


def token_rows(engine: Engine, layer: str, table: Sequence[int], tokens: range) -> torch.Tensor:
    """Bytes of every (token, head) of a request, read through vLLM's accessors: (tokens, heads, bytes)."""
    bs, r, nk = _geometry(engine, layer)
    rows = as_row_bytes(vllm_parts(engine, layer))
    out = []
    for t in tokens:
        block, pos = table[t // bs], t % bs
        out.append(rows[block * r + pos // nk, :, pos % nk])
    return torch.stack(out)


def write_tokens(engine: Engine, layer: str, table: Sequence[int], tokens: range, gen: torch.Generator) -> None:
    """Random bytes into every (token, head) cell of ``tokens`` of a request, through vLLM's accessors (what the
    attention kernel writes into the cache for the tokens a step computes)."""
    bs, r, nk = _geometry(engine, layer)
    parts = vllm_parts(engine, layer)
    for t in tokens:
        block, pos = table[t // bs], t % bs
        kb, n = block * r + pos // nk, pos % nk
        write_random({k: v[kb : kb + 1, :, n : n + 1] for k, v in parts.items()}, gen)


def block_rows(engine: Engine, layer: str, block: int) -> torch.Tensor:
    """Bytes of every cell of one (manager) block of a layer, read through vLLM's accessors."""
    _, r, _ = _geometry(engine, layer)
    return as_row_bytes(vllm_parts(engine, layer))[block * r : (block + 1) * r].clone()

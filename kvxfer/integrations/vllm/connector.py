"""``KvxferConnector``: vLLM's KV-connector v1 interface on top of kvxfer sidecars.

vLLM builds the class twice per engine: with role SCHEDULER in the engine-core process and with
role WORKER in each worker process. Each role delegates to its vLLM-free half
(:mod:`.scheduler`, :mod:`.worker`); this module only translates vLLM's objects, and
:mod:`.spec` reads vLLM's description of the caches.

It supports vLLM's hybrid KV-cache manager (``SupportsHMA``): models with several KV-cache groups
(full and sliding-window attention, attention and Mamba) move every group of a request in one pull.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvxfer.integrations.vllm.plan import StepPlan
from kvxfer.integrations.vllm.scheduler import SchedulerSide
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.spec import (
    SUPPORTED_VLLM,
    KVCacheDescriptionError,
    describe_caches,
    reports_failed_blocks,
    transfer_groups,
    vllm_version_supported,
)
from kvxfer.integrations.vllm.worker import WorkerSide
from kvxfer.logs import get_logger
from kvxfer.topology import RankInfo

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvxferConnector", "KvxferConnectorMetadata"]

log = get_logger("kvxfer.vllm")


class KvxferConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's :class:`~kvxfer.integrations.vllm.plan.StepPlan`, sent to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _adopt_vllm_logging() -> None:
    """kvxfer's lines go through vLLM's own handler, with its level, timestamp and format.

    vLLM configures only its ``vllm`` logger; records of other loggers would reach Python's
    last-resort handler (warnings only, bare text). Done once per process, after vLLM set up its
    logging (it has when a connector is built).
    """
    ours, theirs = logging.getLogger("kvxfer"), logging.getLogger("vllm")
    if getattr(ours, "_kvxfer_adopted", False) or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False
    ours._kvxfer_adopted = True  # type: ignore[attr-defined]


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector that moves prompt KV between instances through kvxfer sidecars."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _adopt_vllm_logging()
        import vllm

        if not vllm_version_supported(vllm.__version__):
            log.warning(
                f"vLLM {vllm.__version__} is not one kvxfer's connector was tested with ({', '.join(SUPPORTED_VLLM)})"
            )
        kt = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.load(kt.kv_connector_extra_config)
        par = vllm_config.parallel_config
        self.engine_id = str(kt.engine_id)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            groups = transfer_groups(kv_cache_config, par.tensor_parallel_size)
            self._scheduler = SchedulerSide(
                self.settings, engine_id=self.engine_id, groups=groups, tp_size=par.tensor_parallel_size,
                pp_size=par.pipeline_parallel_size, dp_rank=par.data_parallel_rank,
            )  # fmt: skip
        else:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            tp, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            pp = get_pp_group()
            self._rank = RankInfo(tp, tp_size, pp.rank_in_group, pp.world_size)
            self._worker = WorkerSide(
                self.settings, rank=self._rank, local_rank=pp.rank_in_group * tp_size + tp,
                dp_rank=par.data_parallel_rank, worker_id=f"{self.engine_id}/pid{os.getpid()}",
                failure_policy=str(getattr(kt, "kv_load_failure_policy", "fail")),
                block_errors=reports_failed_blocks(kv_cache_config),
            )  # fmt: skip

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """HND (LBHNC) by default: a head slice of a block is one span for heterogeneous TP."""
        mc = vllm_config.model_config
        if mc is None or mc.use_mla:
            return None
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config if vllm_config.kv_transfer_config else {}
        choice = ConnectorSettings.load(extra).kv_cache_layout
        return {"HND": "LBHNC", "cross_layer": "BLHNC", "auto": None}[choice]

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig | None = None) -> bool:
        """No: sleeping frees the KV memory a sidecar has registered (vLLM 0.33 asks)."""
        return False

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Share vLLM's cache memory with this rank's sidecar (CUDA IPC, or shared memory on a CPU)."""
        assert self._worker is not None
        groups = describe_caches(
            self._vllm_config, self._kv_cache_config, kv_caches, tp_rank=self._rank.tp_rank,
            tp_size=self._rank.tp_size,
        )  # fmt: skip
        self._worker.register(groups, kv_caches)
        self._check_bound(kv_caches)

    def _check_bound(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # The attention layers must compute on the memory that was shared, or the sidecar would
        # move stale bytes: on a CPU, the storage every view shares moved to shared memory in place.
        ctx = self._vllm_config.compilation_config.static_forward_context
        shared = {t.untyped_storage().data_ptr() for t in kv_caches.values()}
        for name in kv_caches:
            cache = getattr(ctx.get(name), "kv_cache", None)
            for t in cache if isinstance(cache, (list, tuple)) else (cache,):
                if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in shared:
                    raise KVCacheDescriptionError(
                        f"kv_caches[{name!r}]: the layer computes on memory at {t.data_ptr():#x}, outside what was "
                        "shared with the sidecar; this vLLM build keeps its own cache references",
                        field="kv_caches",
                    )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's plan, bound before the forward pass: its layer-wise streams are announced now.

        vLLM's model runners call ``start_load_kv`` after the forward when the step has no
        synchronous load (none of kvxfer's is), and ``wait_for_save`` right after it: the step's
        ``save_kv_layer`` calls all come between this call and those.
        """
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvxferConnectorMetadata):
            self._worker.bind_step(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's pulls (they complete asynchronously, between steps)."""
        assert self._worker is not None
        meta = self._get_connector_metadata()
        if isinstance(meta, KvxferConnectorMetadata) and meta.plan:
            self._worker.on_step(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request runs only once its whole load ended."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing to copy (the cache lives in memory the sidecar registered); with ``push_layerwise``
        the sidecar is told the layer is in the cache, and WRITEs it while the next layers compute."""
        if self._worker is not None:
            self._worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        """Nothing to wait for: the prefill's blocks stay held by its publish, not by the step."""
        if self._worker is not None:
            self._worker.step_saved()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """With ``push_layerwise`` the per-layer hooks must run, which full CUDA graphs skip."""
        return ConnectorSettings.load(extra_config).push_layerwise

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(published requests the decode side is done with, requests whose load ended)."""
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished sends and loads, and the loads that failed where vLLM takes them per request."""
        assert self._worker is not None
        sending, recving, failed = self._worker.finished()
        # Failed blocks go by get_block_ids_with_load_errors where vLLM can recompute from the first
        # (reports_failed_blocks); every other failed load is reported here, per request.
        return KVConnectorTransferResults(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed (one full-attention group only): vLLM recomputes from the first, or fails."""
        assert self._worker is not None
        return self._worker.load_errors()

    def shutdown(self) -> None:
        """Close the sidecar channels and let the sidecar forget the memory."""
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ================================================================== scheduler side
    def on_new_request(self, request: Request) -> None:
        """A prefill for a remote decode of a model with Mamba layers stops a token short."""
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every transfer group is loaded (vLLM must not zero their new blocks under the load)."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """For a remote prefill: the prompt tokens to load, asynchronously."""
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Queue the pull into the blocks vLLM allocated for the request (every transfer group)."""
        assert self._scheduler is not None
        tables = self._transfer_tables(blocks.get_block_ids()) if num_external_tokens > 0 else ()
        self._scheduler.after_alloc(request, tables, num_external_tokens)

    def _transfer_tables(self, block_ids: Any) -> tuple[list[int], ...]:
        return tuple(self._kv_cache_config.select_transfer_block_ids(block_ids))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's pulls, aborts, publishes and streamed prefills, for the workers."""
        assert self._scheduler is not None
        if self.settings.push_layerwise:
            self._scheduler.step_streams(self._scheduled(scheduler_output))
        plan = self._scheduler.build_plan()
        if not plan and scheduler_output.total_num_scheduled_tokens == 0 and self._scheduler.loading:
            # Nothing to run but loads to wait for: nap instead of spinning the engine, its workers and
            # a core the prefill next door (or this host's other work) could use; a load that ends
            # ends the nap.
            self._scheduler.idle_nap(self.settings.idle_wait_ms / 1000)
        return KvxferConnectorMetadata(plan)

    def _scheduled(self, out: SchedulerOutput) -> list[tuple[str, Any, int, int, bool]]:
        """(request, new blocks per transfer group, computed before, scheduled now, replace) of this step."""
        counts = out.num_scheduled_tokens
        rows: list[tuple[str, Any, int, int, bool]] = [
            (r.req_id, self._transfer_tables(r.block_ids), r.num_computed_tokens, counts.get(r.req_id, 0), True)
            for r in out.scheduled_new_reqs
        ]
        cached = out.scheduled_cached_reqs
        resumed: set[str] = set(getattr(cached, "resumed_req_ids", ()))
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            rows.append((rid, self._transfer_tables(new) if new is not None else None, cached.num_computed_tokens[i],
                         counts.get(rid, 0), rid in resumed))  # fmt: skip
        return rows

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forget loads that the workers reported as ended."""
        assert self._scheduler is not None
        self._scheduler.loads_finished(connector_output.finished_recving)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Publish a finished prefill's blocks (one KV-cache group) and answer with the decode params."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, [list(block_ids)])

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Publish every transfer group of a finished prefill and answer with the decode params."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, self._transfer_tables(block_ids))

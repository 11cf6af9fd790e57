"""``KvxferConnector``: vLLM's KV-connector v1 interface on top of kvxfer sidecars.

vLLM builds the class twice per engine: with role SCHEDULER in the engine-core process and with
role WORKER in each worker process. Each role delegates to its vLLM-free half
(:mod:`.scheduler`, :mod:`.worker`); this module only translates vLLM's objects.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvxfer.integrations.vllm.kvcache import KVCacheDescriptionError
from kvxfer.integrations.vllm.plan import StepPlan
from kvxfer.integrations.vllm.scheduler import SchedulerSide
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.worker import WorkerSide
from kvxfer.logs import get_logger
from kvxfer.topology import RankInfo

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
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


class KvxferConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM KV connector that moves prompt KV between instances through kvxfer sidecars."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kt = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.load(kt.kv_connector_extra_config)
        par = vllm_config.parallel_config
        self.engine_id = str(kt.engine_id)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                self.settings, engine_id=self.engine_id, block_size=vllm_config.cache_config.block_size,
                tp_size=par.tensor_parallel_size, pp_size=par.pipeline_parallel_size, dp_rank=par.data_parallel_rank,
            )  # fmt: skip
        else:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            tp, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            pp = get_pp_group()
            rank = RankInfo(tp, tp_size, pp.rank_in_group, pp.world_size)
            self._worker = WorkerSide(
                self.settings, rank=rank, local_rank=pp.rank_in_group * tp_size + tp, dp_rank=par.data_parallel_rank,
                total_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
                worker_id=f"{self.engine_id}/pid{os.getpid()}",
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

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Share vLLM's cache tensors with this rank's sidecar (CUDA IPC, or shared memory on a CPU)."""
        assert self._worker is not None
        self._worker.register(kv_caches)
        self._check_bound(kv_caches)

    def _check_bound(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # The attention layers must compute on the very tensors that were shared, or the sidecar
        # would move stale bytes: on a CPU the connector moved them onto shared memory in place.
        ctx = self._vllm_config.compilation_config.static_forward_context
        for name, t in kv_caches.items():
            layer = ctx.get(name)
            cache = getattr(layer, "kv_cache", None)
            bound = cache[0] if isinstance(cache, (list, tuple)) and cache else cache
            if isinstance(bound, torch.Tensor) and bound.data_ptr() != t.data_ptr():
                raise KVCacheDescriptionError(
                    f"kv_caches[{name!r}]: the attention layer computes on memory at {bound.data_ptr():#x}, not on "
                    f"the shared tensor at {t.data_ptr():#x}; this vLLM build keeps its own cache references",
                    field="kv_caches",
                )

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
        """Nothing to save: the cache already lives in memory the sidecar registered."""

    def wait_for_save(self) -> None:
        """Nothing to wait for (see :meth:`save_kv_layer`)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(published requests the decode side is done with, requests whose load ended)."""
        assert self._worker is not None
        sending, recving = self._worker.finished()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed: vLLM recomputes them (``kv_load_failure_policy``)."""
        assert self._worker is not None
        return self._worker.load_errors()

    def shutdown(self) -> None:
        """Close the sidecar channels and the shared-memory name."""
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """For a remote prefill: the prompt tokens to load, asynchronously."""
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Queue the pull into the blocks vLLM allocated for the request."""
        assert self._scheduler is not None
        ids = blocks.get_block_ids()
        self._scheduler.after_alloc(request, ids[0] if ids else [], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's pulls, aborts and publishes, for the workers."""
        assert self._scheduler is not None
        return KvxferConnectorMetadata(self._scheduler.build_plan())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forget loads that the workers reported as ended."""
        assert self._scheduler is not None
        self._scheduler.loads_finished(connector_output.finished_recving)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Publish a finished prefill's blocks (kept until released) and answer with the decode params."""
        assert self._scheduler is not None
        if block_ids and isinstance(block_ids[0], (list, tuple)):  # one list per KV-cache group
            block_ids = list(block_ids[0])
        return self._scheduler.request_finished(request, block_ids)

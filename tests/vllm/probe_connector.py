"""A do-nothing vLLM v1 KV connector that records every call vLLM makes to it.

Used to learn (and to re-check on a new vLLM release) what the connector API really receives on
the CPU backend: the call order on the scheduler and worker sides, the tensors handed to
``register_kv_caches`` (shapes, strides, dtypes, storage sharing), the block ids, and how the
``kv_transfer_params`` returned by ``request_finished`` reach the request output.

Load it in vLLM with::

    --kv-transfer-config '{"kv_connector": "ProbeConnector",
        "kv_connector_module_path": "tests.vllm.probe_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"probe_log": "/tmp/probe.jsonl"}}'

Each call appends one JSON line to ``probe_log`` (default ``$KVXFER_PROBE_LOG`` or
``/tmp/kvxfer-probe.jsonl``). It loads nothing and saves nothing, so outputs are unchanged.
``python -m tests.vllm.probe_connector MODEL_DIR`` runs a short offline session and prints the log.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_LOCK = threading.Lock()


class ProbeMetadata(KVConnectorMetadata):
    """Scheduler -> worker metadata: the step counter and the request ids seen this step."""

    def __init__(self, step: int, new_req_ids: list[str], finished_req_ids: list[str]) -> None:
        self.step = step
        self.new_req_ids = new_req_ids
        self.finished_req_ids = finished_req_ids


def _tensor_info(t: torch.Tensor) -> dict[str, Any]:
    st = t.untyped_storage()
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype),
        "device": str(t.device),
        "contiguous": t.is_contiguous(),
        "data_ptr": t.data_ptr(),
        "storage_ptr": st.data_ptr(),
        "storage_nbytes": st.nbytes(),
        "nbytes": t.nbytes,
        "element_size": t.element_size(),
    }


class ProbeConnector(KVConnectorBase_V1):
    """Records each call (role, pid, arguments' shape) to a JSON-lines file; transfers nothing."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._log_path = Path(extra.get("probe_log") or os.environ.get("KVXFER_PROBE_LOG") or "/tmp/kvxfer-probe.jsonl")
        self._step = 0
        self._max_step_logs = int(extra.get("probe_max_steps", 40))
        self._log(
            "__init__",
            kv_role=self._kv_transfer_config.kv_role,
            engine_id=self._kv_transfer_config.engine_id,
            block_size=vllm_config.cache_config.block_size,
            num_blocks=kv_cache_config.num_blocks,
            kv_cache_groups=[
                {
                    "layers": list(g.layer_names),
                    "spec": type(g.kv_cache_spec).__name__,
                    "spec_repr": repr(g.kv_cache_spec),
                }
                for g in kv_cache_config.kv_cache_groups
            ],
            kv_cache_tensors=[repr(t) for t in kv_cache_config.kv_cache_tensors],
        )

    # -- logging -------------------------------------------------------------------------
    def _log(self, method: str, **fields: Any) -> None:
        rec = {"t": time.time(), "pid": os.getpid(), "role": self.role.name, "method": method, **fields}
        line = json.dumps(rec, default=repr)
        with _LOCK, self._log_path.open("a") as f:
            f.write(line + "\n")

    def _quiet(self) -> bool:
        return self._step > self._max_step_logs

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Log every layer's cache tensor and whether layers share one storage."""
        infos = {name: _tensor_info(t) for name, t in kv_caches.items()}
        storages = sorted({i["storage_ptr"] for i in infos.values()})
        self._log("register_kv_caches", num_layers=len(kv_caches), distinct_storages=len(storages), layers=infos)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to load; log the bound metadata."""
        meta = self._get_connector_metadata()
        if not self._quiet():
            self._log(
                "start_load_kv",
                meta_step=getattr(meta, "step", None),
                kwargs=sorted(kwargs),
                has_attn_metadata=forward_context.attn_metadata is not None,
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for."""
        if not self._quiet():
            self._log("wait_for_layer_load", layer_name=layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Log the layer tensor handed over after the attention layer ran."""
        if not self._quiet():
            self._log(
                "save_kv_layer",
                layer_name=layer_name,
                kv_layer=_tensor_info(kv_layer),
                attn_metadata=type(attn_metadata).__name__,
                slot_mapping=getattr(attn_metadata, "slot_mapping", None).tolist()[:80]
                if getattr(attn_metadata, "slot_mapping", None) is not None
                else None,
            )

    def wait_for_save(self) -> None:
        """Nothing saved."""
        if not self._quiet():
            self._log("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Log the finished ids the worker is told about; nothing is in flight."""
        if finished_req_ids:
            self._log("get_finished", finished_req_ids=sorted(finished_req_ids))
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """No loads, no errors."""
        return set()

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Log the request as the scheduler first considers it; nothing is external."""
        self._log(
            "get_num_new_matched_tokens",
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=num_computed_tokens,
            kv_transfer_params=request.kv_transfer_params,
            status=str(request.status),
        )
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Log the blocks allocated for the request."""
        self._log(
            "update_state_after_alloc",
            request_id=request.request_id,
            num_external_tokens=num_external_tokens,
            block_ids=blocks.get_block_ids(),
            unhashed_block_ids=blocks.get_unhashed_block_ids_all_groups(),
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Log the step's scheduled requests and return the step's metadata."""
        self._step += 1
        new = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        fin = sorted(scheduler_output.finished_req_ids)
        if not self._quiet() and (new or fin or scheduler_output.total_num_scheduled_tokens):
            self._log(
                "build_connector_meta",
                step=self._step,
                new_reqs={
                    r.req_id: {"block_ids": r.block_ids, "num_computed_tokens": r.num_computed_tokens}
                    for r in scheduler_output.scheduled_new_reqs
                },
                num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
                finished_req_ids=fin,
            )
        return ProbeMetadata(self._step, new, fin)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Log non-empty worker outputs."""
        if connector_output.finished_sending or connector_output.finished_recving:
            self._log("update_connector_output", output=repr(connector_output))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Log the finished request's blocks; return params to see where they surface."""
        self._log(
            "request_finished",
            request_id=request.request_id,
            status=str(request.status),
            block_ids=list(block_ids),
            num_computed_tokens=request.num_computed_tokens,
            kv_transfer_params=request.kv_transfer_params,
        )
        return False, {"probe_request_id": request.request_id, "probe_block_ids": list(block_ids)}


def _main(model_dir: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    log = Path(os.environ.get("KVXFER_PROBE_LOG", "/tmp/kvxfer-probe.jsonl"))
    log.unlink(missing_ok=True)
    llm = LLM(
        model=model_dir,
        block_size=32,
        gpu_memory_utilization=0.1,
        enforce_eager=True,
        max_model_len=1024,
        kv_transfer_config=KVTransferConfig(
            kv_connector="ProbeConnector",
            kv_connector_module_path="tests.vllm.probe_connector",
            kv_role="kv_both",
            kv_connector_extra_config={"probe_log": str(log)},
        ),
    )
    outs = llm.generate(
        ["Return the number of items in a container. " * 6, "Split the string"],
        SamplingParams(max_tokens=3, temperature=0.0, extra_args={"kv_transfer_params": {"hello": 1}}),
    )
    for o in outs:
        print("OUTPUT", o.request_id, o.outputs[0].token_ids, "kv_transfer_params=", o.kv_transfer_params)
    print(log.read_text())


if __name__ == "__main__":
    _main(sys.argv[1])

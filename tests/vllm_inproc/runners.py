"""The connector driven by vLLM's own model-runner code, in vLLM's call order.

vLLM ships two model runners, and both call the KV connector around a step's forward pass:
V1's ``KVConnectorModelRunnerMixin._get_kv_connector_output`` and V2's ``ActiveKVConnector``
(``vllm/v1/worker/gpu/kv_connector.py``: ``pre_forward``, ``finish_forward``, ``post_forward``).
Either binds the step's metadata (``bind_connector_metadata``) before the forward, lets the attention
layers call ``save_kv_layer`` during it (through vLLM's ``maybe_transfer_kv_layer``, which reads the
layer's cache from the forward context), and only then starts the step's loads (``start_load_kv``:
after the forward when the step has no synchronous load, which kvxfer never has), waits for the
saves, collects the results and clears the metadata. :class:`RankRunner` runs that code here for
one worker rank; the forward pass itself is the test's (it writes each layer's KV of the step, as the
attention kernel would, through vLLM's accessors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from kvxfer.integrations.vllm.connector import KvxferConnector
from kvxfer.integrations.vllm.scheduler import SchedulerSide
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.integrations.vllm.worker import WorkerSide
from tests.vllm_inproc.engine import Engine

__all__ = ["RUNNERS", "RankRunner", "scheduler_connector", "worker_connector"]

#: vLLM's two model runners: V1 (the KV-connector mixin) and V2 (``ActiveKVConnector``).
RUNNERS = ("v1", "v2")

#: STAND-IN for a layer's attention metadata of the step, which only the attention kernels read (kvxfer's
#: ``save_kv_layer`` does not): vLLM's ``maybe_transfer_kv_layer`` calls the connector only for a layer that has some.
STEP_ATTENTION_METADATA = SimpleNamespace(stand_in="attention metadata of the step")


def worker_connector(worker: WorkerSide, engine: Engine) -> KvxferConnector:
    """The connector class vLLM loads, for one worker rank, around ``worker``.

    Built without ``__init__``, which reads the rank from vLLM's initialized TP/PP groups (this process
    holds every rank of both instances): the attributes it sets come from ``worker`` and ``engine``.
    """
    conn = _bare_connector(engine, KVConnectorRole.WORKER, worker.settings)
    conn._scheduler, conn._worker, conn._rank = None, worker, worker.rank
    return conn


def scheduler_connector(scheduler: SchedulerSide, engine: Engine) -> KvxferConnector:
    """The connector class vLLM loads, for an engine's scheduler, around ``scheduler`` (built as
    :func:`worker_connector` is: its ``__init__`` needs a whole ``VllmConfig``)."""
    conn = _bare_connector(engine, KVConnectorRole.SCHEDULER, scheduler.settings)
    conn._scheduler, conn._worker = scheduler, None
    return conn


def _bare_connector(engine: Engine, role: KVConnectorRole, settings: ConnectorSettings) -> KvxferConnector:
    """What ``KvxferConnector.__init__`` sets for every role, from ``engine`` (its halves come after)."""
    conn = KvxferConnector.__new__(KvxferConnector)
    conn._connector_metadata = None
    conn._vllm_config = engine.vllm_config
    conn._kv_cache_config = engine.kv_cache_config
    conn._role = role
    conn.settings = settings
    return conn


@maybe_transfer_kv_layer
def attention(layer_name: str, write_kv: Callable[[str], None]) -> None:
    """One attention layer's forward, wrapped in vLLM's own connector hooks: its kernel writes the
    step's KV into the layer's cache (``write_kv``), then vLLM calls the connector's ``save_kv_layer``."""
    write_kv(layer_name)


class RankRunner:
    """One worker rank's KV connector, driven by vLLM's model-runner code (``kind``: ``v1`` or ``v2``)."""

    def __init__(self, kind: str, worker: WorkerSide, engine: Engine) -> None:
        assert kind in RUNNERS, kind
        self.kind = kind
        self.engine = engine
        self.connector = worker_connector(worker, engine)
        # A VllmConfig whose forward context holds this rank's attention layers (and their caches).
        self.config = VllmConfig()
        layers = engine.vllm_config.compilation_config.static_forward_context
        self.config.compilation_config.static_forward_context = layers
        self.v2: ActiveKVConnector | None = None

    def register(self) -> None:
        """Hand the caches to the connector as the runner does (V2: building its ``ActiveKVConnector``)."""
        with self.installed():
            if self.kind == "v2":
                self.v2 = ActiveKVConnector(self.config, self.engine.kv_caches)
            else:  # V1's initialize_kv_cache
                self.connector.register_kv_caches(self.engine.kv_caches)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """This rank's connector as vLLM's process-wide one (what ``get_kv_transfer_group`` returns)."""
        before = kv_transfer_state._KV_CONNECTOR_AGENT
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        try:
            yield
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = before

    def step(self, out: SchedulerOutput, write_kv: Callable[[str], None] | None = None) -> KVConnectorOutput:
        """One step: with a forward pass over every attention layer (``write_kv`` writes a layer's KV of the
        step, as the attention kernel does), or without one (``write_kv`` None: vLLM's ``no_forward``)."""
        with self.installed():
            if write_kv is None:
                ran = (KVConnectorModelRunnerMixin.kv_connector_no_forward(out, self.config) if self.kind == "v1"
                       else self._v2().no_forward(out))  # fmt: skip
                return ran.kv_connector_output or KVConnectorOutput()  # vLLM sends none when nothing ended
            layers = list(self.engine.kv_caches)
            meta = {n: STEP_ATTENTION_METADATA for n in layers}
            if self.kind == "v1":  # GPUModelRunner.execute_model
                with set_forward_context(meta, self.config), \
                        KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(out) as output:  # fmt: skip
                    for name in layers:
                        attention(name, write_kv)
                assert output is not None
                return output
            v2 = self._v2()  # vllm/v1/worker/gpu/model_runner.py, eager mode
            with set_forward_context(meta, self.config):
                v2.pre_forward(out)
                for name in layers:
                    attention(name, write_kv)
            v2.finish_forward()
            result = v2.post_forward(out.finished_req_ids)
            assert result is not None
            return result

    def _v2(self) -> ActiveKVConnector:
        assert self.v2 is not None, "register() first"
        return self.v2


def results(output: KVConnectorOutput) -> tuple[set[str], set[str], set[str]]:
    """(finished sending, finished receiving, failed receiving) of one step's connector output."""
    return set(output.finished_sending or ()), set(output.finished_recving or ()), set(output.failed_recving or ())


def scheduled(out: SchedulerOutput, **fields: Any) -> SchedulerOutput:
    """``out`` with ``fields`` set (vLLM's scheduler fills a ``SchedulerOutput`` the same way)."""
    for k, v in fields.items():
        setattr(out, k, v)
    return out

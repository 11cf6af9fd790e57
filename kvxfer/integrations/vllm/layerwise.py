"""Layer-wise push, worker side: announce each step's streamed requests, signal each layer's KV.

With ``push_layerwise``, a prefill's KV is written to the decode instance layer by layer while the
forward pass runs: before the forward, the step's plan names the requests that stream
(:meth:`LayerwisePush.bind_step`, which announces them to the sidecar); after each attention layer
vLLM's ``save_kv_layer`` hands the sidecar that layer's signal (:meth:`LayerwisePush.layer_saved`),
without copying or waiting. On GPUs each layer also has an interprocess CUDA event
(:func:`layer_events`), recorded on the compute stream, that the sidecar waits for before the
layer's WRITE. The publish at the end of the prefill still writes whatever the stream missed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvxfer.client import Client
from kvxfer.errors import KvxferError
from kvxfer.integrations.vllm.plan import StepPlan, StreamSpec
from kvxfer.integrations.vllm.spec import CacheGroup
from kvxfer.logs import get_logger
from kvxfer.wire import common_pb2, local_pb2

__all__ = ["LAYER_SIGNAL_LOG_EVERY", "LayerwisePush", "layer_events"]

#: How often (in layer signals) the worker logs what they cost the forward pass.
LAYER_SIGNAL_LOG_EVERY = 64

# The worker's logger: these lines are the worker side's, as they were before this module was split from it.
log = get_logger("kvxfer.vllm.worker")


class LayerwisePush:
    """One worker rank's part of layer-wise push: the step that streams, and its layers' signals.

    ``names``: the kvxfer groups of a vLLM transfer group (by index), as the worker registered them.
    """

    def __init__(self, sidecar: Client, names: Callable[[int], Sequence[str]]) -> None:
        self.sidecar = sidecar
        self._names = names
        self.layers: dict[str, tuple[str, int]] = {}  # vLLM layer name -> (kvxfer group, layer index)
        #: GPU workers: one interprocess CUDA event per layer, recorded after it wrote its KV.
        self.events: dict[str, tuple[Any, local_pb2.LayerEvent]] = {}
        #: The step being computed (0: none streams), the plan it was bound with, and what the signals cost.
        self._stream_step = 0
        self._bound: StepPlan | None = None
        self._steps = 0
        self.signals = 0
        self.signal_seconds = 0.0

    def register(self, groups: Sequence[CacheGroup], kv_caches: Mapping[str, Any], *, events: bool) -> None:
        """Learn the registered groups' layers; with ``events`` (``push_layerwise``), make their CUDA events."""
        self.layers = {}
        for g in groups:
            for i, layer in enumerate(g.layer_names):
                self.layers[layer] = (g.name, i)
        self.events = layer_events(self.layers, kv_caches) if events else {}

    def bind_step(self, plan: StepPlan) -> None:
        """The step's plan, before its forward pass (vLLM's ``bind_connector_metadata``).

        Announces the requests the step computes whose KV streams layer by layer, so that the
        layers' signals during the forward (:meth:`layer_saved`) name this step. It cannot wait for
        :meth:`~kvxfer.integrations.vllm.worker.WorkerSide.on_step`: vLLM calls ``start_load_kv`` only
        after the forward when no load of the step is synchronous, as none of kvxfer's is. Binding the
        same plan again announces nothing.
        """
        if plan is self._bound:
            return
        self._bound = plan
        self._stream_step = 0
        if plan.streams:
            self._steps += 1
            self._stream_step = self._steps
            self.sidecar.submit(self._announce(self._steps, plan.streams))

    async def _announce(self, step: int, streams: Sequence[StreamSpec]) -> None:
        reqs = []
        for spec in streams:
            lists = [
                common_pb2.BlockList(group=name, block_ids=list(ids), skip_tokens=origin)
                for gi, (ids, origin) in enumerate(spec.groups) for name in self._names(gi)
                if ids
            ]  # fmt: skip
            reqs.append(local_pb2.StreamedRequest(request_id=spec.request_id, blocks=lists, start_token=spec.start,
                                                  end_token=spec.end, reader_engine_id=spec.reader))  # fmt: skip
        try:
            await self.sidecar.aio.stream_step(step, reqs, [e for _ev, e in self.events.values()])
        except KvxferError as exc:  # the publish still writes the whole request
            log.warning(f"step {step}: could not announce the streamed requests: {exc.message}")

    def layer_saved(self, layer_name: str) -> None:
        """A layer's KV of this step is in the cache: its WRITEs may start (layer-wise push).

        Called on the forward path after each attention layer: it only hands the signal to the
        client's loop thread and returns (no copy, no waiting).
        """
        if not self._stream_step:
            return
        t0 = time.perf_counter()
        where = self.layers.get(layer_name)
        if where is not None:
            event = self.events.get(layer_name)
            if event is not None:
                event[0].record()  # on the compute stream: the sidecar waits for it, this thread does not
            self.sidecar.submit(self._layer_done(self._stream_step, *where))
        self.signals += 1
        self.signal_seconds += time.perf_counter() - t0
        if self.signals % LAYER_SIGNAL_LOG_EVERY == 0:
            self.log_signals()

    def log_signals(self) -> None:
        """Log how many layer signals were given and what each cost the forward pass."""
        each = 1e6 * self.signal_seconds / self.signals
        log.info(f"layer-wise push: {self.signals} layer signals over {self._steps} steps, {each:.1f} us each "
                 "on the forward path")  # fmt: skip

    def step_saved(self) -> None:
        """The step's forward pass ended: no more layer signals until the next streamed step."""
        self._stream_step = 0

    async def _layer_done(self, step: int, group: str, layer: int) -> None:
        try:
            await self.sidecar.aio.layer_done(step, group, layer)
        except KvxferError as exc:  # the publish writes what the stream missed
            log.debug(f"step {step}: layer signal {group}/{layer} not taken: {exc.message}")


def layer_events(layers: Mapping[str, tuple[str, int]], kv_caches: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """One interprocess CUDA event per layer whose cache is on a GPU (empty on a CPU worker).

    Made once at registration: ``save_kv_layer`` only records it on the compute stream, and the
    sidecar opens each handle once and waits for the latest record before the layer's WRITE.
    """
    out: dict[str, tuple[Any, Any]] = {}
    for name, (group, index) in layers.items():
        tensor = kv_caches.get(name)
        if tensor is None or not getattr(tensor, "is_cuda", False):
            continue
        import torch

        with torch.cuda.device(tensor.device):
            ev = torch.cuda.Event(enable_timing=False, interprocess=True)  # type: ignore[no-untyped-call]
            ev.record()  # an event must be recorded once before its handle can be exported
            handle = bytes(ev.ipc_handle())  # type: ignore[no-untyped-call]
        out[name] = (ev, local_pb2.LayerEvent(group=group, layer=index, ipc_handle=handle, device=tensor.device.index))
    return out

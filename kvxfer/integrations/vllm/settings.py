"""The connector's settings: ``kv_connector_extra_config`` first, then ``KVXFER_*`` environment.

Everything has a default that matches the Helm chart and docs/sidecar-contract.md, so a vLLM
command line needs only ``kv_connector`` and ``kv_connector_module_path``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import KvxferError, Reason

__all__ = ["DEFAULT_SOCKET", "ConnectorSettings", "ConnectorSettingsError", "env_var"]

#: One sidecar per worker rank; ``{rank}`` is the worker's rank inside its vLLM instance.
DEFAULT_SOCKET = "/run/kvxfer/kvxfer-{rank}.sock"
_PLACEHOLDERS = ("rank", "tp_rank", "pp_rank", "dp_rank")


class ConnectorSettingsError(KvxferError):
    """A connector setting is missing or malformed; the message names it."""

    status = "INVALID_ARGUMENT"
    default_reason = Reason.INVALID_FIELD


@dataclass(frozen=True)
class ConnectorSettings:
    """What the vLLM connector needs to find and use its sidecars."""

    #: Unix socket (or ``host:port``) of each rank's sidecar; may hold ``{rank}``, ``{tp_rank}``,
    #: ``{pp_rank}`` and ``{dp_rank}``.
    sidecar_socket: str = DEFAULT_SOCKET
    #: File holding the shared token of the local API (``KVXFER_TOKEN_FILE``); empty: no token.
    token_file: str = ""
    #: Lease of a published request (0: the sidecar's ``--lease-seconds``).
    lease_seconds: float = 0.0
    #: Deadline of one pull (the sidecar caps it at its ``--transfer-timeout-seconds``).
    transfer_timeout_seconds: float = 30.0
    #: How long a worker waits for its sidecar at start-up.
    startup_timeout_seconds: float = 60.0
    #: Deadline of one control call (register, publish, abort, status).
    call_timeout_seconds: float = 10.0
    #: KV cache layout asked of vLLM: ``HND`` (LBHNC, head slices contiguous: heterogeneous TP
    #: moves one span per block and head slice), ``cross_layer`` (BLHNC: one region, one
    #: descriptor per block run for all layers) or ``auto`` (vLLM's choice).
    kv_cache_layout: str = "HND"
    #: Where the bytes move: ``sidecar`` (the sidecar's own agent, on memory the worker shares with
    #: it) or ``worker`` (an agent in this worker's process registers the KV tensors and the
    #: sidecar drives it: the route to an RDMA NIC for GPU memory; the sidecar runs ``--backend worker``).
    data_plane: str = "sidecar"
    #: The library of the worker's agent with ``data_plane: worker`` (a kvxfer backend name).
    worker_backend: str = "nixl"
    #: Who launches a same-host GPU pull's gather with ``data_plane: sidecar``: ``sidecar`` (its
    #: own CUDA context), or ``worker``: this decode worker, in its own context, launched on the
    #: client's loop thread, copies over 2 ms waited for off it (``kvxfer.client.gather``; no GPU
    #: context switch, the worker's CPU instead).
    #: GPU caches only; anything the sidecar cannot hand over as one gather it moves itself.
    gather: str = "sidecar"
    #: Prefill instance, push mode: stream each request's KV layer by layer while the prefill
    #: computes (the sidecar WRITEs a layer as soon as the worker says it is in the cache). Needs
    #: vLLM's per-layer hooks: CUDA graphs run piecewise.
    push_layerwise: bool = False
    #: Decode instance: when a step schedules nothing and loads are on their way, the engine naps
    #: up to this long before its next step instead of spinning (vLLM steps without pause while a
    #: request waits for remote KV, which in push mode lasts the whole remote prefill). A load that
    #: ends ends the nap at once; a request that arrives meanwhile waits for its end. 0: no nap.
    idle_wait_ms: float = 20.0
    #: Decode instance: as vLLM allocates a request's blocks, the scheduler sends every rank's
    #: sidecar the Pull its worker is about to make (``Prepare``), so the sidecar checks and plans it
    #: before the worker asks, off the pull's critical path. Nothing moves until the Pull.
    prepare_pulls: bool = True

    def __post_init__(self) -> None:
        if not self.sidecar_socket.strip():
            raise ConnectorSettingsError("sidecar_socket: must not be empty", field="sidecar_socket")
        unknown = sorted(set(re.findall(r"{([^{}]*)}", self.sidecar_socket)) - set(_PLACEHOLDERS))
        if unknown:
            raise ConnectorSettingsError(
                f"sidecar_socket: unknown placeholder {{{unknown[0]}}} in {self.sidecar_socket!r}; "
                f"known: {', '.join('{' + p + '}' for p in _PLACEHOLDERS)}",
                field="sidecar_socket",
            )
        for name in ("lease_seconds", "transfer_timeout_seconds", "idle_wait_ms"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConnectorSettingsError(f"{name}: must be a number >= 0, got {value!r}", field=name)
        for name in ("startup_timeout_seconds", "call_timeout_seconds"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConnectorSettingsError(f"{name}: must be a number > 0, got {value!r}", field=name)
        if self.kv_cache_layout not in ("HND", "cross_layer", "auto"):
            raise ConnectorSettingsError(
                f"kv_cache_layout: {self.kv_cache_layout!r} is not one of HND, cross_layer, auto",
                field="kv_cache_layout",
            )
        if self.data_plane not in ("sidecar", "worker"):
            raise ConnectorSettingsError(
                f"data_plane: {self.data_plane!r} is not one of sidecar, worker", field="data_plane"
            )
        if self.gather not in ("sidecar", "worker"):
            raise ConnectorSettingsError(f"gather: {self.gather!r} is not one of sidecar, worker", field="gather")
        if self.gather == "worker" and self.data_plane != "sidecar":
            raise ConnectorSettingsError(
                f"gather: 'worker' needs data_plane 'sidecar' (the sidecar hands the gather over), got "
                f"{self.data_plane!r}", field="gather",
            )  # fmt: skip
        if not self.worker_backend or self.worker_backend == "worker":
            raise ConnectorSettingsError(
                f"worker_backend: {self.worker_backend!r} is not a library backend (e.g. nixl)", field="worker_backend"
            )

    @classmethod
    def load(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorSettings:
        """From vLLM's ``kv_connector_extra_config`` (wins) and the environment.

        Unknown keys are refused, so a typo does not silently fall back to a default.
        """
        env = os.environ if env is None else env
        extra = dict(extra or {})
        # vLLM's own keys that may appear beside ours (e.g. copied from a NixlConnector config).
        for ignored in ("backends", "num_threads"):
            extra.pop(ignored, None)
        fields = cls.__dataclass_fields__
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ConnectorSettingsError(
                f"kv_connector_extra_config: unknown key {unknown[0]!r}; known: {', '.join(sorted(fields))}",
                field=unknown[0],
            )
        values: dict[str, Any] = {}
        from_env: set[str] = set()
        try:
            for name, f in fields.items():
                raw: Any = extra.get(name)
                if raw is None and env_var(name) in env:
                    raw = env[env_var(name)]
                    from_env.add(name)
                if raw is None:
                    continue
                values[name] = _coerce(name, raw, type(f.default))
            return cls(**values)
        except ConnectorSettingsError as exc:
            if exc.field not in from_env:
                raise
            # The user set the variable, not the key: name what they set.
            message = f"{env_var(exc.field)}: {exc.message.removeprefix(exc.field + ': ')}"
            raise ConnectorSettingsError(message, field=exc.field, reason=exc.reason) from None

    def socket_for(self, *, rank: int, tp_rank: int = 0, pp_rank: int = 0, dp_rank: int = 0) -> str:
        """The sidecar address of one worker rank."""
        return self.sidecar_socket.format(rank=rank, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank)

    def token(self) -> str | None:
        """The shared token, read from ``token_file`` (None when no file is set)."""
        if not self.token_file:
            return None
        try:
            with open(self.token_file, encoding="utf-8") as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise ConnectorSettingsError(
                f"token_file: cannot read {self.token_file!r}: {exc.strerror}", field="token_file"
            ) from None
        if not token:
            raise ConnectorSettingsError(f"token_file: {self.token_file!r} is empty", field="token_file")
        return token


# The sidecar's own variables where both sides of the pod share one meaning.
_ENV = {"sidecar_socket": "KVXFER_LOCAL_SOCKET", "token_file": "KVXFER_TOKEN_FILE"}


def env_var(name: str) -> str:
    """The environment variable of the connector setting ``name`` (``KVXFER_VLLM_<NAME>`` or the sidecar's)."""
    return _ENV.get(name, "KVXFER_VLLM_" + name.upper())


def _coerce(name: str, raw: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return raw.strip().lower() in ("1", "true", "yes", "on")
        raise ConnectorSettingsError(f"{name}: must be true or false, got {raw!r}", field=name)
    if kind is str:
        if not isinstance(raw, str):
            raise ConnectorSettingsError(f"{name}: must be a string, got {raw!r}", field=name)
        return raw
    if isinstance(raw, bool):
        raise ConnectorSettingsError(f"{name}: must be a number, got {raw!r}", field=name)
    try:
        return float(raw)
    except (TypeError, ValueError):
        raise ConnectorSettingsError(f"{name}: must be a number, got {raw!r}", field=name) from None

"""Making the NIXL agent of :class:`kvxfer.transport.nixl_backend.NixlTransport`.

The process's UCX settings, the agent's config (``NIXL_THREAD_SYNC_RW`` when posts may come from a
second thread), its backends, and its progress thread's delay; NIXL's logger moved off stdout.

GPU memory: the UCX backend is created with :data:`UCX_DEFAULTS` as its ``engine_config``. Without
``CUDA_IPC_ENABLE_GET_ZCOPY=y``, UCX turns the cuda_ipc transport's READ (get) off whenever NVML
reports no NVLink (PCIe cards, GPUs passed through into a VM) and a VRAM READ crawls through host
memory over tcp (0.5 GB/s against 1300 GB/s on the lent H100; docs/notes/gpu.md). A ``UCX_<KEY>``
variable in the environment always wins: that key is left out of ``engine_config``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from kvxfer import cuda_ipc
from kvxfer.transport.base import TransportConfig
from kvxfer.transport.errors import BackendUnavailableError

__all__ = ["UCX_DEFAULTS", "nixl_logs_to_stderr", "ucx_engine_config"]

# UCX settings (without the UCX_ prefix) that kvxfer needs for GPU memory; harmless on CPUs.
UCX_DEFAULTS: dict[str, str] = {
    # READ of VRAM over cuda_ipc even when NVML shows no NVLink (see the module docstring).
    "CUDA_IPC_ENABLE_GET_ZCOPY": "y",
    # Let two agents of one process (library mode, tests) use cuda_ipc between them.
    "CUDA_IPC_ENABLE_SAME_PROCESS": "y",
}


def ucx_engine_config(env: Mapping[str, str] | None = None) -> str:
    """The UCX backend's ``engine_config``: :data:`UCX_DEFAULTS` minus keys the user set as ``UCX_<KEY>``."""
    env = os.environ if env is None else env
    return ",".join(f"{k}={v}" for k, v in UCX_DEFAULTS.items() if f"UCX_{k}" not in env)


def _prepare_ucx_env(env: dict[str, str] | os._Environ[str] | None = None) -> None:
    """Process-wide UCX settings that must be in the environment before UCX loads (a ``UCX_*`` set wins).

    ``UCX_MEMTYPE_CACHE=n``: UCX's memory-type cache only learns of GPU memory allocated after it
    loaded through the allocation calls it hooks, and takes anything it has not seen for host
    memory. A sidecar maps its worker's GPU memory by CUDA IPC long after its agent started, so with
    the cache on NIXL refuses it ("VRAM memory is detected as host by UCX"). Without the cache UCX
    asks the driver, once per registration.
    """
    env = os.environ if env is None else env
    env.setdefault("UCX_MEMTYPE_CACHE", "n")


def _make_agent(name: str, config: TransportConfig) -> tuple[Any, bool]:
    """The agent, and whether it runs in NIXL_THREAD_SYNC_RW mode (posts may come from a second thread)."""
    _prepare_ucx_env()
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise BackendUnavailableError("NIXL is not installed", backend="nixl", detail=str(exc)) from None
    nixl_logs_to_stderr()
    # UCX enumerates GPUs only in a process where CUDA is initialized (see cuda_ipc.try_init).
    cuda_ipc.try_init()
    # Backends are created below rather than by the constructor, which cannot pass init params.
    conf, threaded = _agent_config(nixl_agent_config, threaded=config.nixl_thread_post_bytes > 0)
    agent = _with_progress_delay(nixl_agent, name, conf, config.nixl_progress_delay_us)
    plugins = agent.get_plugin_list()
    for backend in config.nixl_backends:
        if backend not in plugins:
            continue  # reported by the caller with the list of plugins found
        engine_config = ucx_engine_config() if backend == "UCX" else ""
        agent.create_backend(backend, {"engine_config": engine_config} if engine_config else {})
    return agent, threaded


def _agent_config(factory: Any, *, threaded: bool) -> tuple[Any, bool]:
    """The agent's config, and whether it is NIXL_THREAD_SYNC_RW (asked with ``threaded``)."""
    if threaded:
        try:
            from nixl._api import nixl_thread_sync_t

            return factory(backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW), True
        except (ImportError, AttributeError, TypeError):
            pass  # a NIXL without sync modes: every post stays on the caller's thread (see NixlTransport)
    return factory(backends=[]), False


def nixl_logs_to_stderr() -> None:
    """NIXL's Python logger writes to stdout, where it breaks ``--json`` output: send it to stderr."""
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _with_progress_delay(factory: Any, name: str, conf: Any, delay_us: int) -> Any:
    """Create the agent with its progress thread sleeping ``delay_us`` between rounds.

    The Python wrapper hard-codes a zero delay, which makes every agent's progress thread spin a
    whole core even when idle. The binding's config has the knob; a subclass whose setter keeps
    our value is installed only for the duration of the constructor call.
    """
    api = sys.modules.get(factory.__module__)
    found = getattr(getattr(api, "nixlBind", None), "nixlAgentConfig", None)
    if found is None or delay_us <= 0:
        return factory(name, conf)
    base: Any = found

    class _Config(base):  # type: ignore[misc]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - the binding's name
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, delay_us)

    api.nixlBind.nixlAgentConfig = _Config  # type: ignore[union-attr]
    try:
        return factory(name, conf)
    finally:
        api.nixlBind.nixlAgentConfig = base  # type: ignore[union-attr]

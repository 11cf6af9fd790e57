"""``kv_transfer_params``: what a prefill instance answers and a decode instance reads.

The keys are the ones vLLM's P/D proxies already pass through verbatim (vLLM's NixlConnector
uses the same names), plus two of kvxfer's own, so existing routers work unchanged:

* proxy -> prefill: ``{"do_remote_decode": true, ...}``;
* prefill -> proxy (the response's ``kv_transfer_params``): ``do_remote_prefill``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``, ``remote_host``,
  ``remote_port``, ``remote_num_tokens``, ``remote_block_size``, ``tp_size``, ``pp_size``, and
  ``kvxfer_addresses`` (the peer API address of every prefill rank's sidecar, in rank order) and
  ``kvxfer_engine_id`` (the engine id those sidecars handshake with);
* proxy -> decode: that dict, unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import KvxferError

__all__ = ["ParamsError", "RemotePrefill", "prefill_response", "wants_remote_decode", "wants_remote_prefill"]


class ParamsError(KvxferError):
    """``kv_transfer_params`` that cannot drive a transfer; the message names the key."""

    status = "INVALID_ARGUMENT"


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """The proxy asked this (prefill) instance to keep the KV for a remote decode."""
    return bool(params and params.get("do_remote_decode"))


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """The proxy asked this (decode) instance to load the prompt's KV from a prefill instance."""
    return bool(params and params.get("do_remote_prefill"))


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode instance finds a request's KV: the prefill side's request and sidecars."""

    request_id: str
    engine_id: str
    addresses: tuple[str, ...]
    block_ids: tuple[int, ...]
    num_tokens: int = 0
    sidecar_engine_id: str = ""
    block_size: int = 0  # 0: not given

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> RemotePrefill:
        """Validate a decode request's params; raises :class:`ParamsError` naming the bad key."""
        request_id = _string(params, "remote_request_id")
        engine_id = str(params.get("remote_engine_id") or "")
        blocks = _block_ids(params.get("remote_block_ids"))
        addresses = params.get("kvxfer_addresses")
        if addresses is None:
            # A prefill instance of one rank needs no list: remote_host/remote_port is its sidecar.
            tp = params.get("tp_size", 1) or 1
            if tp != 1:
                raise ParamsError(
                    f"kvxfer_addresses: missing, and tp_size is {tp}: the sidecar address of every prefill rank "
                    "is needed (was the prefill instance running kvxfer's connector?)",
                    field="kvxfer_addresses",
                )
            host, port = params.get("remote_host"), params.get("remote_port")
            if not host or not port:
                raise ParamsError(
                    "kvxfer_addresses: missing, and so are remote_host/remote_port", field="kvxfer_addresses"
                )
            addresses = [f"{host}:{port}"]
        if isinstance(addresses, str) or not isinstance(addresses, Sequence) or not addresses:
            raise ParamsError(
                f"kvxfer_addresses: must be a non-empty list of 'host:port', got {addresses!r}",
                field="kvxfer_addresses",
            )
        if not all(isinstance(a, str) and a for a in addresses):
            raise ParamsError(f"kvxfer_addresses: every entry must be 'host:port', got {addresses!r}",
                              field="kvxfer_addresses")  # fmt: skip
        num_tokens = params.get("remote_num_tokens") or 0
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ParamsError(f"remote_num_tokens: must be an integer >= 0, got {num_tokens!r}",
                              field="remote_num_tokens")  # fmt: skip
        sidecar_engine = params.get("kvxfer_engine_id") or ""
        if not isinstance(sidecar_engine, str):
            raise ParamsError(f"kvxfer_engine_id: must be a string, got {sidecar_engine!r}", field="kvxfer_engine_id")
        block_size = params.get("remote_block_size") or 0
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0:
            raise ParamsError(f"remote_block_size: must be an integer >= 0, got {block_size!r}",
                              field="remote_block_size")  # fmt: skip
        return cls(request_id, engine_id, tuple(addresses), blocks, num_tokens, sidecar_engine, block_size)


def prefill_response(
    *, engine_id: str, request_id: str, block_ids: Sequence[int], num_tokens: int, block_size: int,
    addresses: Sequence[str], sidecar_engine_id: str, tp_size: int, pp_size: int,
) -> dict[str, Any]:  # fmt: skip
    """The params a prefill instance returns for a request whose blocks it published."""
    host, _, port = addresses[0].rpartition(":")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [list(block_ids)],  # one list per KV-cache group, as vLLM's connectors send
        "remote_host": host,
        "remote_port": int(port),
        "remote_num_tokens": num_tokens,
        "remote_block_size": block_size,
        "tp_size": tp_size,
        "pp_size": pp_size,
        "kvxfer_addresses": list(addresses),
        "kvxfer_engine_id": sidecar_engine_id,
    }


def _string(params: Mapping[str, Any], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise ParamsError(f"{key}: must be a non-empty string, got {value!r}", field=key)
    return value


def _block_ids(value: Any) -> tuple[int, ...]:
    # One list per KV-cache group ([[...]]) or, from older routers, one flat list.
    if isinstance(value, Sequence) and value and all(isinstance(g, Sequence) for g in value):
        if len(value) != 1:
            raise ParamsError(
                f"remote_block_ids: {len(value)} KV-cache groups; kvxfer's vLLM connector moves one (no hybrid "
                "allocator)",
                field="remote_block_ids",
            )
        value = value[0]
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise ParamsError(f"remote_block_ids: must be a non-empty list of block ids, got {value!r}",
                          field="remote_block_ids")  # fmt: skip
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in value):
        bad = next(b for b in value if isinstance(b, bool) or not isinstance(b, int) or b < 0)
        raise ParamsError(f"remote_block_ids: {bad!r} is not a block id", field="remote_block_ids")
    return tuple(value)

"""``kv_transfer_params``: what a prefill instance answers and a decode instance reads.

The keys are the ones vLLM's P/D proxies already pass through verbatim (vLLM's NixlConnector
uses the same names), plus a few of kvxfer's own, so existing routers work unchanged:

* proxy -> prefill: ``{"do_remote_decode": true, ...}``;
* prefill -> proxy (the response's ``kv_transfer_params``): ``do_remote_prefill``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids`` (one list per KV-cache
  transfer group, in vLLM's group order), ``remote_host``, ``remote_port``, ``remote_num_tokens``,
  ``remote_block_size``, ``tp_size``, ``pp_size``, and kvxfer's ``kvxfer_addresses`` (the peer
  API address of every prefill rank's sidecar, in rank order), ``kvxfer_engine_id`` (the engine
  id those sidecars handshake with) and ``kvxfer_groups`` (per group: its name, block size and
  the position of its first listed block in the request's block table, since sliding-window
  groups publish only their tail and Mamba groups only their state block, and for a Mamba group
  ``tp_split``: whether its state's split over TP ranks is known, so that it moves between TP sizes,
  and then ``segments``: the prefill rank's byte size of each TP segment, empty for a replicated state);
* proxy -> decode: that dict, unchanged.

**Push mode** (:func:`push_params`): the proxy sends the request to both instances at once, with
an id of its choosing for the transfer (``kvxfer_push_id``) and the prefill instance's sidecar
addresses (fixed per instance: any earlier prefill response's ``kvxfer_addresses``, or the
router's configuration):

* proxy -> prefill: ``{"do_remote_decode": true, "kvxfer_push": true, "kvxfer_push_id": X}``;
  the prefill publishes under ``X`` when it finishes, and its sidecars WRITE into the blocks the
  decode side offered for ``X``;
* proxy -> decode: ``{"do_remote_prefill": true, "kvxfer_push": true, "kvxfer_push_id": X,
  "kvxfer_addresses": [...], "kvxfer_engine_id": ..., "remote_engine_id": ...}``; the decode
  instance allocates the prompt's blocks at once and offers them; it starts when every block
  landed. The prefill's response is not needed (a proxy may still wait for it, and fall back to a
  pull with it: it carries the usual params).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import KvxferError, Reason

__all__ = [
    "ParamsError",
    "RemoteGroup",
    "RemotePrefill",
    "prefill_response",
    "push_id",
    "push_params",
    "reader_engine_id",
    "wants_push",
    "wants_remote_decode",
    "wants_remote_prefill",
]


class ParamsError(KvxferError):
    """``kv_transfer_params`` that cannot drive a transfer; the message names the key."""

    status = "INVALID_ARGUMENT"
    default_reason = Reason.INVALID_FIELD


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """The proxy asked this (prefill) instance to keep the KV for a remote decode."""
    return bool(params and params.get("do_remote_decode"))


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """The proxy asked this (decode) instance to load the prompt's KV from a prefill instance."""
    return bool(params and params.get("do_remote_prefill"))


@dataclass(frozen=True)
class RemoteGroup:
    """One KV-cache group of a published request: its blocks and what they cover."""

    name: str
    block_ids: tuple[int, ...]
    block_size: int  # tokens per block on the prefill side (0: not given)
    first_block: int = 0  # position of block_ids[0] in the request's block table
    #: Mamba state: whether the prefill side knows the state's split over TP (it then moves between
    #: TP sizes); None: not a state group, or not given (a prefill instance that predates the key).
    tp_split: bool | None = None
    #: Mamba state whose split is known: the prefill rank's byte size of each TP segment (empty: a
    #: replicated state); None: not given.
    segments: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode instance finds a request's KV: the prefill side's request, sidecars and groups."""

    request_id: str
    engine_id: str
    addresses: tuple[str, ...]
    groups: tuple[RemoteGroup, ...]
    num_tokens: int = 0
    sidecar_engine_id: str = ""
    #: Push mode: the prefill side WRITEs; ``groups`` is empty (nothing is published yet).
    push: bool = False
    #: The prefill instance's parallel sizes (0: not given).
    tp_size: int = 0
    pp_size: int = 0

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The first group's block ids (a model with one group)."""
        return self.groups[0].block_ids

    @property
    def block_size(self) -> int:
        """The first group's block size on the prefill side (0: not given)."""
        return self.groups[0].block_size

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> RemotePrefill:
        """Validate a decode request's params; raises :class:`ParamsError` naming the bad key."""
        request_id = _string(params, "remote_request_id")
        engine_id = str(params.get("remote_engine_id") or "")
        lists = _block_lists(params.get("remote_block_ids"))
        addresses = _addresses(params)
        num_tokens = _count(params, "remote_num_tokens")
        sidecar_engine = params.get("kvxfer_engine_id") or ""
        if not isinstance(sidecar_engine, str):
            raise ParamsError(f"kvxfer_engine_id: must be a string, got {sidecar_engine!r}", field="kvxfer_engine_id")
        block_size = _count(params, "remote_block_size")
        groups = _groups(params.get("kvxfer_groups"), lists, block_size)
        tp_size, pp_size = _count(params, "tp_size"), _count(params, "pp_size")
        return cls(request_id, engine_id, addresses, groups, num_tokens, sidecar_engine, False, tp_size, pp_size)

    @classmethod
    def parse_push(cls, params: Mapping[str, Any]) -> RemotePrefill:
        """Validate a decode request's push-mode params (no block ids: the prefill has not run yet)."""
        request_id = push_id(params)
        if params.get("kvxfer_addresses") is None:
            raise ParamsError("kvxfer_addresses: push mode needs the sidecar address of every prefill rank, in "
                              "rank order", field="kvxfer_addresses")  # fmt: skip
        addresses = _addresses(params)
        sidecar_engine = params.get("kvxfer_engine_id") or ""
        if not isinstance(sidecar_engine, str):
            raise ParamsError(f"kvxfer_engine_id: must be a string, got {sidecar_engine!r}", field="kvxfer_engine_id")
        engine_id = str(params.get("remote_engine_id") or "")
        return cls(request_id, engine_id, addresses, (), 0, sidecar_engine, push=True)


def wants_push(params: Mapping[str, Any] | None) -> bool:
    """The proxy runs this request in push mode (both instances at once; the prefill side WRITEs)."""
    return bool(params and params.get("kvxfer_push"))


def push_id(params: Mapping[str, Any]) -> str:
    """The transfer's id in push mode (``kvxfer_push_id``), checked."""
    value = _string(params, "kvxfer_push_id")
    if len(value) > 256 or any(c.isspace() for c in value):
        raise ParamsError(f"kvxfer_push_id: at most 256 characters and no spaces, got {value!r}",
                          field="kvxfer_push_id")  # fmt: skip
    return value


def push_params(
    *, push_id: str, addresses: Sequence[str], sidecar_engine_id: str = "", engine_id: str = ""
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill params, decode params) of one request in push mode (what a proxy sends; see the module docs)."""
    prefill = {"do_remote_decode": True, "kvxfer_push": True, "kvxfer_push_id": push_id}
    decode = {
        "do_remote_prefill": True, "kvxfer_push": True, "kvxfer_push_id": push_id,
        "kvxfer_addresses": list(addresses), "kvxfer_engine_id": sidecar_engine_id, "remote_engine_id": engine_id,
    }  # fmt: skip
    return prefill, decode


def prefill_response(
    *, engine_id: str, request_id: str, groups: Sequence[RemoteGroup], num_tokens: int, addresses: Sequence[str],
    sidecar_engine_id: str, tp_size: int, pp_size: int,
) -> dict[str, Any]:  # fmt: skip
    """The params a prefill instance returns for a request whose blocks it published."""
    host, _, port = addresses[0].rpartition(":")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [list(g.block_ids) for g in groups],  # one list per KV-cache group, as vLLM's connectors
        "remote_host": host,
        "remote_port": int(port),
        "remote_num_tokens": num_tokens,
        "remote_block_size": groups[0].block_size,
        "tp_size": tp_size,
        "pp_size": pp_size,
        "kvxfer_addresses": list(addresses),
        "kvxfer_engine_id": sidecar_engine_id,
        "kvxfer_groups": [_group_params(g) for g in groups],
    }


def _group_params(g: RemoteGroup) -> dict[str, Any]:
    out: dict[str, Any] = {"name": g.name, "block_size": g.block_size, "first_block": g.first_block}
    if g.tp_split is not None:
        out["tp_split"] = g.tp_split
    if g.segments is not None:
        out["segments"] = list(g.segments)
    return out


def reader_engine_id(params: Mapping[str, Any]) -> str:
    """The decode engine a prefill's publish is for (``kvxfer_reader_engine_id``; "": the proxy named none)."""
    value = params.get("kvxfer_reader_engine_id") or ""
    if not isinstance(value, str):
        raise ParamsError(f"kvxfer_reader_engine_id: must be a string, got {value!r}", field="kvxfer_reader_engine_id")
    return value


def _string(params: Mapping[str, Any], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise ParamsError(f"{key}: must be a non-empty string, got {value!r}", field=key)
    return value


def _count(params: Mapping[str, Any], key: str) -> int:
    value = params.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ParamsError(f"{key}: must be an integer >= 0, got {value!r}", field=key)
    return value


def _addresses(params: Mapping[str, Any]) -> tuple[str, ...]:
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
            raise ParamsError("kvxfer_addresses: missing, and so are remote_host/remote_port", field="kvxfer_addresses")
        addresses = [f"{host}:{port}"]
    if isinstance(addresses, str) or not isinstance(addresses, Sequence) or not addresses:
        raise ParamsError(
            f"kvxfer_addresses: must be a non-empty list of 'host:port', got {addresses!r}", field="kvxfer_addresses"
        )
    if not all(isinstance(a, str) and a for a in addresses):
        raise ParamsError(f"kvxfer_addresses: every entry must be 'host:port', got {addresses!r}",
                          field="kvxfer_addresses")  # fmt: skip
    return tuple(addresses)


def _block_lists(value: Any) -> list[tuple[int, ...]]:
    # One list per KV-cache group ([[...], [...]]) or, from older routers, one flat list.
    if isinstance(value, Sequence) and value and all(isinstance(g, Sequence) for g in value):
        lists = list(value)
    else:
        lists = [value]
    out = []
    for i, ids in enumerate(lists):
        where = "remote_block_ids" if len(lists) == 1 else f"remote_block_ids[{i}]"
        if isinstance(ids, str) or not isinstance(ids, Sequence) or not ids:
            raise ParamsError(f"{where}: must be a non-empty list of block ids, got {ids!r}", field="remote_block_ids")
        bad = next((b for b in ids if isinstance(b, bool) or not isinstance(b, int) or b < 0), None)
        if bad is not None:
            raise ParamsError(f"{where}: {bad!r} is not a block id", field="remote_block_ids")
        out.append(tuple(ids))
    return out


def _groups(value: Any, lists: list[tuple[int, ...]], block_size: int) -> tuple[RemoteGroup, ...]:
    if value is None:
        # A router or prefill instance that predates kvxfer_groups: vLLM's group order, whole tables.
        return tuple(RemoteGroup(f"g{i}", ids, block_size) for i, ids in enumerate(lists))
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != len(lists):
        raise ParamsError(
            f"kvxfer_groups: must list the {len(lists)} groups of remote_block_ids, got {value!r}",
            field="kvxfer_groups",
        )
    out = []
    for i, (g, ids) in enumerate(zip(value, lists, strict=True)):
        if not isinstance(g, Mapping) or not isinstance(g.get("name"), str) or not g["name"]:
            raise ParamsError(f"kvxfer_groups[{i}]: must be {{name, block_size, first_block}}, got {g!r}",
                              field="kvxfer_groups")  # fmt: skip
        nums = {k: g.get(k, 0) for k in ("block_size", "first_block")}
        for k, v in nums.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ParamsError(f"kvxfer_groups[{i}].{k}: must be an integer >= 0, got {v!r}", field="kvxfer_groups")
        tp_split = g.get("tp_split")
        if tp_split is not None and not isinstance(tp_split, bool):
            raise ParamsError(f"kvxfer_groups[{i}].tp_split: must be a bool, got {tp_split!r}", field="kvxfer_groups")
        segments = g.get("segments")
        if segments is not None:
            if (
                isinstance(segments, str)
                or not isinstance(segments, Sequence)
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in segments)
            ):
                raise ParamsError(f"kvxfer_groups[{i}].segments: must be a list of byte sizes, got {segments!r}",
                                  field="kvxfer_groups")  # fmt: skip
            segments = tuple(segments)
        out.append(RemoteGroup(g["name"], ids, nums["block_size"], nums["first_block"], tp_split, segments))
    return tuple(out)

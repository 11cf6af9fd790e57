"""Why a Mooncake data plane starts off loopback only with ``--insecure`` (``Transport.serves_memory_openly``).

Mooncake's P2P handshake port answers any caller with the segment descriptor (the registered
buffers' addresses), and its data port serves READs and WRITEs into them: no kvxfer token or
certificate is ever asked. Here a bare Mooncake TransferEngine that kvxfer never authenticated reads
and overwrites memory a kvxfer transport registered. If a Mooncake release ever asks for credentials,
this test fails and the flag (and the refusal in ``kvxfer.config``) can go.
"""

from __future__ import annotations

import json

import numpy as np

from kvxfer.topology import RegionTable
from kvxfer.transport import TransportConfig, create_transport, transport_class


def test_mooncake_serves_registered_memory_to_a_stranger() -> None:
    from mooncake.engine import TransferEngine

    victim = create_transport("mooncake", "victim", TransportConfig(listen_host="127.0.0.1"))
    secret = np.frombuffer(b"SECRET-KV-BYTES!" * 64, dtype=np.uint8).copy()
    base = np.array([secret.ctypes.data], dtype=np.uint64)
    size = np.array([secret.size], dtype=np.uint64)
    reg = victim.register(RegionTable(base=base, size=size, device=np.zeros(1, dtype=np.uint64)))
    stranger = TransferEngine()
    try:
        assert stranger.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        mine = np.zeros(secret.size, dtype=np.uint8)
        assert stranger.register_memory(mine.ctypes.data, mine.size) == 0
        session = json.loads(victim.metadata())["session"]
        # Only the victim's host and handshake port are needed (a port scan finds them).
        assert stranger.transfer_sync_read(session, mine.ctypes.data, secret.ctypes.data, secret.size) == 0
        assert mine.tobytes() == secret.tobytes()
        mine[:6] = np.frombuffer(b"PWNED!", dtype=np.uint8)
        assert stranger.transfer_sync_write(session, mine.ctypes.data, secret.ctypes.data, 6) == 0
        assert secret[:6].tobytes() == b"PWNED!"
    finally:
        stranger.unregister_memory(mine.ctypes.data)
        victim.deregister(reg)
        victim.close()
    assert transport_class("mooncake").serves_memory_openly
    assert not transport_class("nixl").serves_memory_openly

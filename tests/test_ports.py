"""free_port: bindable ports, not handed out twice, below the ephemeral range when asked (local clusters)."""

from __future__ import annotations

import socket

from kvxfer.ports import _ephemeral_low, free_port


def _bind(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_local_cluster_ports_are_bindable_distinct_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = [free_port(below_ephemeral=True) for _ in range(50)]
    assert len(set(ports)) == len(ports)  # a cluster's listeners never get the same port
    for port in ports:
        if low - 20000 >= 1000:  # room below the ephemeral range (else: the kernel's pick)
            assert 20000 <= port < low
        _bind(port)


def test_default_ports_come_from_the_kernel() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert port >= low  # bind(0): the deployment's own ports below are left alone
        _bind(port)

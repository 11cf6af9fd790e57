"""free_port: a bindable port, outside the kernel's ephemeral range (where outgoing connections take theirs)."""

from __future__ import annotations

import socket

from kvxfer.ports import _ephemeral_low, free_port


def test_free_ports_are_bindable_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # random, so two listeners started together rarely pick the same one
    for port in ports:
        assert 20000 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))

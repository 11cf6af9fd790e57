"""Picking a free TCP port for a listener that another process (or library) binds a moment later.

The usual trick, bind port 0 and close, hands out a port from the kernel's ephemeral range, the
same range outgoing connections take their source ports from. A busy test run or demo opens many
connections, and one of them can take the port before the listener binds it (a sidecar binds after
its data plane is up, a second or so later). Ports below the ephemeral range are never handed to
outgoing connections, so local clusters (tests, the demo, benches) ask for those. A deployment
should not: that range holds other services' ports (Kubernetes NodePorts are 30000-32767 and are
not bound sockets, so a bind test cannot see them).
"""

from __future__ import annotations

import random
import socket
from collections import deque

__all__ = ["free_port"]

_FLOOR = 20000  # below this live well-known and registered service ports
_recent: deque[int] = deque(maxlen=512)  # handed out by this process: not again while they may be unbound


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # the Linux default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", *, below_ephemeral: bool = False) -> int:
    """A TCP port on ``host`` that is free now.

    ``below_ephemeral``: pick it below the kernel's ephemeral range (when there is room), for
    listeners on a test machine; see the module docstring.
    """
    low = _ephemeral_low()
    if below_ephemeral and low - _FLOOR >= 1000:
        rng = random.Random()
        for _ in range(64):
            port = rng.randrange(_FLOOR, low)
            if port not in _recent and _bindable(host, port):
                _recent.append(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _recent.append(port)
    return port

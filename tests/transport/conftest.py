"""The transport tests load NIXL in this process and in their peers' (spawned, same environment).

NIXL's UCX loads ``libuct_ib_efa``, which brings the system libibverbs and a second libnl; the two
libnl copies crash in their exit-time destructors (SIGSEGV, exit code 139 after a green run; see
tests/sidecar/conftest.py). EFA is of no use on loopback, so it is left out before NIXL loads.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_MODULES", "^efa")

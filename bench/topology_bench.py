"""Descriptor-building benchmark; same as `kvxfer bench topology`. Usage: python bench/topology_bench.py [--json]"""

from __future__ import annotations

import sys

from kvxfer.cli import app

if __name__ == "__main__":
    app(["bench", "topology", *sys.argv[1:]])

"""``python -m kvxfer.server [flags]``: the sidecar (same flags as ``kvxfer serve``)."""

import sys

from kvxfer.server.cli import main

sys.exit(main())

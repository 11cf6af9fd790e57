"""tests/vllm_inproc needs vLLM in the test process (its own environment, .venv-vllm): it is collected only in the
runs that say which vLLM release they bring (``KVXFER_VLLM_INPROC``, set by ``make test``)."""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("KVXFER_VLLM_INPROC") else ["vllm_inproc"]

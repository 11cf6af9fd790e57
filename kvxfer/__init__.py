"""kvxfer: KV-cache transfer sidecar for disaggregated prefill/decode serving."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 2

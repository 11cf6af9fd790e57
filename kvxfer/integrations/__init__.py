"""Integrations of kvxfer with inference engines (vLLM first).

Each integration depends on kvxfer's public client and core; nothing in kvxfer depends on them.
"""

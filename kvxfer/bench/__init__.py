"""Benchmarks run by `kvxfer bench ...` (scripts under bench/ call the same functions)."""

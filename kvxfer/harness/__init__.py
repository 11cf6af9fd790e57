"""What the demo, the benchmarks and the tests run around real sidecars; nothing here is deployed.

* :mod:`kvxfer.harness.cluster`: :class:`~kvxfer.harness.cluster.LocalCluster`, sidecar and
  synthetic worker processes on loopback.
* :mod:`kvxfer.harness.worker_sim`: a synthetic worker (``python -m kvxfer.harness.worker_sim``)
  that registers caches, fills, publishes, pulls and verifies blocks byte for byte.
* :mod:`kvxfer.harness.demo`: ``kvxfer demo``.
"""

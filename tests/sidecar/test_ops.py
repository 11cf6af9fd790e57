"""What the deployment relies on: health, reflection, metrics names, settings, SIGTERM and `kvxfer drain`."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvxfer.client import AsyncClient, KvxferRpcError, PullItem
from kvxfer.config import ConfigError, Settings, load_settings, parse_address
from kvxfer.errors import InvalidArgumentError, Reason
from kvxfer.memory import SharedKVBuffer
from kvxfer.ports import free_port
from kvxfer.server.cli import drain_main
from kvxfer.wire import peer_pb2, peer_pb2_grpc
from tests.sidecar.conftest import JsonLogs, reset_kvxfer_logging
from tests.sidecar.helpers import Harness, attention, expect_error, transfer

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# docs/sidecar-contract.md, "Metrics": name -> labels.
CONTRACT_METRICS = {
    "kvxfer_build_info": {"version", "protocol"},
    "kvxfer_transfer_bytes_total": {"direction", "backend"},
    "kvxfer_transfers_total": {"direction", "outcome"},
    "kvxfer_transfer_failures_total": {"reason"},
    "kvxfer_transfer_duration_seconds": {"direction"},
    "kvxfer_transfer_descriptors": {"direction"},
    "kvxfer_transfers_in_flight": set(),
    "kvxfer_leases_active": set(),
    "kvxfer_lease_expirations_total": set(),
    "kvxfer_handshakes_total": {"outcome"},
    "kvxfer_prepared_pulls_total": {"outcome"},
    "kvxfer_pulls_by_path_total": {"path"},
    "kvxfer_peers": set(),
    "kvxfer_data_plane_unfenced_total": {"op"},
    "kvxfer_gc_pause_seconds": {"generation"},
    "kvxfer_registered_bytes": set(),
}


async def _health(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(resp.status)


async def test_health_follows_registration_and_drain(harness: Harness) -> None:
    s = await harness.sidecar(role="both")
    assert await _health(s.peer_address, "") == NOT_SERVING  # no caches yet
    assert await _health(s.peer_address, "liveness") == SERVING
    w = await harness.worker(s, {"kv": attention()})
    await asyncio.sleep(0.05)
    for svc in ("", "kvxfer.v1.Peer"):
        assert await _health(s.peer_address, svc) == SERVING
    await w.client.drain(0.1)
    await asyncio.sleep(0.05)
    assert await _health(s.peer_address, "") == NOT_SERVING
    assert await _health(s.peer_address, "liveness") == SERVING


async def test_reflection_lists_the_services(harness: Harness) -> None:
    s = await harness.sidecar()

    async def services(target: str) -> set[str]:
        async with grpc.aio.insecure_channel(target) as ch:
            call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(timeout=5)
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            resp = await call.read()
            await call.done_writing()
            return {svc.name for svc in resp.list_services_response.service}

    reflection = "grpc.reflection.v1alpha.ServerReflection"
    assert await services(s.peer_address) == {"kvxfer.v1.Peer", "grpc.health.v1.Health", reflection}
    assert await services(s.local_target) == {"kvxfer.v1.Local", "grpc.health.v1.Health", reflection}


async def test_metrics_endpoint_has_every_contract_metric(harness: Harness) -> None:
    lay = attention()
    ps, pw, ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, metrics_listen="127.0.0.1:0")
    await transfer(pw, ps, dw, "m1", {"kv": [1, 2, 3]}, {"kv": [4, 5, 6]}, salt=1)
    with pytest.raises(Exception, match="NOT_FOUND"):
        await dw[0].client.pull("missing", [ps[0].peer_address], {"kv": [1]})
    port = ds[0].metrics_port
    assert port
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read())
    body = text.decode()
    for name, labels in CONTRACT_METRICS.items():
        assert f"# TYPE {name.removesuffix('_total')}" in body or f"# TYPE {name}" in body, name
        samples = [ln for ln in body.splitlines() if ln.startswith(name) and not ln.startswith("#")]
        assert samples, f"no samples of {name}"
        for ln in samples:
            got = set(re.findall(r'(\w+)="', ln)) - {"le"}
            assert got == labels, (name, ln)
    assert "_created" not in body
    assert ":" not in "".join(re.findall(r"^(kvxfer_\S+?)[{ ]", body, re.M))
    assert 'kvxfer_transfers_total{direction="read",outcome="ok"} 1.0' in body
    assert 'kvxfer_transfer_failures_total{reason="not_found"} 1.0' in body
    assert f'kvxfer_transfer_bytes_total{{backend="nixl",direction="read"}} {3 * lay.page_bytes * 4}.0' in body
    assert "kvxfer_registered_bytes " in body
    # Each sidecar has its own registry: the prefill side counted no reads.
    assert ps[0].metrics is not None
    assert b'outcome="ok"} 0.0' in ps[0].metrics.exposition()
    # State gauges are read when scraped: one lease held, one peer on each side, nothing in flight.
    for _ in range(500):  # m1's DONE notice frees it (it may still be on its way on a loaded machine)
        if (await pw[0].client.status())["leases"] == 0:
            break
        await asyncio.sleep(0.01)
    await pw[0].prefill("held", {"kv": [7]}, salt=2)
    prefill_text = ps[0].metrics.exposition().decode()
    for line in ("kvxfer_leases_active 1.0", "kvxfer_peers 1.0", "kvxfer_transfers_in_flight 0.0"):
        assert line in prefill_text.splitlines(), line
    assert "kvxfer_peers 1.0" in body.splitlines()
    assert float(body.split("kvxfer_registered_bytes ")[-1].split()[0]) == lay.total_bytes


def test_settings_precedence_and_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "kvxfer.yaml"
    cfg.write_text("lease-seconds: 5\ndrain_seconds: 7\nnixl_backends: [UCX, GDS]\nrole: prefill  # comment\n")
    env = {"KVXFER_CONFIG": str(cfg), "KVXFER_LEASE_SECONDS": "9", "KVXFER_ROLE": "decode"}
    s = load_settings({"role": "both"}, env=env)
    assert (s.lease_seconds, s.drain_seconds, s.role, s.nixl_backends) == (9.0, 7.0, "both", ("UCX", "GDS"))
    assert load_settings({}, env={}).lease_seconds == Settings().lease_seconds == 30.0
    (tmp_path / "c.json").write_text(json.dumps({"lease_seconds": 3, "bogus": 1}))
    with pytest.raises(ConfigError, match="unknown setting 'bogus'") as info:
        load_settings({"config": str(tmp_path / "c.json")}, env={})
    assert info.value.field == "bogus"
    # A file that does not parse: one line (kvxfer's error style) with where it broke, not PyYAML's drawing.
    (tmp_path / "broken.yaml").write_text("lease_seconds: 5\nrole: [prefill\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML at line 3, column 1: ") as info3:
        load_settings({"config": str(tmp_path / "broken.yaml")}, env={})
    assert "\n" not in info3.value.message, info3.value.message
    with pytest.raises(ConfigError, match=r"KVXFER_TRANSFER_TIMEOUT_SECONDS: .*greater than 0") as info2:
        load_settings({}, env={"KVXFER_TRANSFER_TIMEOUT_SECONDS": "-1"})
    assert info2.value.field == "transfer_timeout_seconds"
    with pytest.raises(ConfigError, match=r"--peer-listen: 'nowhere' is not host:port"):
        load_settings({"peer_listen": "nowhere"}, env={})
    with pytest.raises(ConfigError, match="--tls-key"):
        load_settings({"tls_cert": str(cfg)}, env={})
    with pytest.raises(ConfigError, match=r"--token-file: .*does not exist"):
        load_settings({"token_file": str(tmp_path / "nope")}, env={})


KVXFER = [sys.executable, "-m", "kvxfer.cli"]  # the `kvxfer` console script, in this interpreter


def _serve(tmp: Path, *extra: str, cli: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port(below_ephemeral=True)
    sock = str(tmp / "sc.sock")
    proc = subprocess.Popen(
        [*(cli or [sys.executable, "-m", "kvxfer.server"]), "--engine-id", "ops", "--peer-listen", f"127.0.0.1:{port}",
         "--local-socket", sock, "--metrics-listen", "", "--drain-seconds", "3", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "UCX_MODULES": "^efa"},
    )  # fmt: skip
    return proc, f"127.0.0.1:{port}", sock


async def test_kvxfer_serve_on_uvloop_sigterm_drains_and_exits_zero(harness: Harness) -> None:
    proc, addr, sock = _serve(harness.sock_dir, cli=[*KVXFER, "serve"])
    lay = attention()
    buf = SharedKVBuffer.create(lay)
    try:
        c = AsyncClient(sock)
        await c.wait_ready(60)
        await c.register_caches({"kv": (lay, buf.ref())})
        await c.publish("held", {"kv": [1, 2]})
        assert await _health(addr, "") == SERVING
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert await _health(addr, "") == NOT_SERVING  # draining: the lease is still held
        with pytest.raises(Exception, match="UNAVAILABLE"):
            await c.publish("new", {"kv": [3]})
        code = await asyncio.to_thread(proc.wait, 20)
        assert code == 0
        assert time.monotonic() - t0 < 3 + 5  # --drain-seconds 3, then the lease is released
        out = proc.stdout.read().decode() if proc.stdout else ""
        events = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
        assert "NIXL INFO" not in out  # NIXL's own stdout handler was replaced by the JSON one
        assert any(e["logger"].startswith("nixl.") and "Initialized NIXL agent" in e["msg"] for e in events)
        settings = next(e for e in events if e["msg"] == "settings")["settings"]
        assert (settings["engine_id"], settings["drain_seconds"]) == ("ops", 3.0)
        started = next(e for e in events if e["msg"] == "sidecar started")
        assert (started["event_loop"], started["engine_id"]) == ("uvloop", "ops")
        assert any(e["msg"] == "drained" and e["released_leases"] == 1 for e in events), out[-2000:]
        released = [e for e in events if e["msg"] == "lease released by the drain"]
        assert [e["request_id"] for e in released] == ["held"]
        await c.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        buf.close()


async def _serve_with_token(harness: Harness, tmp_path: Path, secret: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """`python -m kvxfer.server` with a token file, once its local API answers: (process, socket, token file)."""
    token = tmp_path / "token"
    token.write_text(secret + "\n")
    proc, _addr, sock = _serve(harness.sock_dir, "--token-file", str(token))
    c = AsyncClient(sock, token=secret)
    try:
        await c.wait_ready(60)
    except BaseException:
        proc.kill()
        raise
    finally:
        await c.close()
    return proc, sock, token


async def test_kvxfer_drain_ends_the_process(harness: Harness, tmp_path: Path) -> None:
    proc, sock, token = await _serve_with_token(harness, tmp_path, "abc123")
    try:
        result = await asyncio.to_thread(drain_main, sock, token_file=str(token))
        assert result == {"completed": 0, "abandoned": 0, "released_leases": 0}
        assert await asyncio.to_thread(proc.wait, 20) == 0
        out = proc.stdout.read().decode() if proc.stdout else ""
        assert "abc123" not in out  # the token is never logged
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_socket_is_group_writable_and_kvxfer_drain_reads_the_sidecar_env(
    harness: Harness, tmp_path: Path
) -> None:
    proc, sock, token = await _serve_with_token(harness, tmp_path, "tok-env")
    try:
        # A worker in another container shares the pod's group, not the sidecar's user.
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
        # `kvxfer drain` as a preStop hook in the sidecar's own container: socket and token from its env.
        env = {**os.environ, "KVXFER_LOCAL_SOCKET": sock, "KVXFER_TOKEN_FILE": str(token)}
        out = await asyncio.to_thread(
            subprocess.run, [*KVXFER, "drain"], capture_output=True, text=True, timeout=60, env=env
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"completed": 0, "abandoned": 0, "released_leases": 0}
        assert await asyncio.to_thread(proc.wait, 20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("cli", [[sys.executable, "-m", "kvxfer.server"], [*KVXFER, "serve"]], ids=["module", "kvxfer"])
def test_invalid_setting_stops_startup_naming_it(cli: list[str], tmp_path: Path) -> None:
    # kvxfer's one error style (before logging starts, so never JSON): `error: <setting>: <message>`, exit 2.
    out = subprocess.run([*cli, "--lease-seconds", "-5"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr == "error: --lease-seconds: Input should be greater than 0 (got '-5')\n"
    env = {**os.environ, "KVXFER_ROLE": "sideways"}
    out = subprocess.run(cli, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert out.stderr == "error: KVXFER_ROLE: Input should be 'prefill', 'decode' or 'both' (got 'sideways')\n"
    cfg = tmp_path / "kvxfer.yaml"
    cfg.write_text("drain_seconds: lots\n")
    out = subprocess.run([*cli, "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith(f"error: drain_seconds (in {cfg}): Input should be a valid number")
    for argv, line in (
        (["--lease-seconds", "nan"], "--lease-seconds: Input should be a finite number (got 'nan')"),
        (["--peer-listen", "127.0.0.1:99999"], "--peer-listen: port 99999 in '127.0.0.1:99999' is not in [0, 65535]"),
        (["--advertise-host", "10.0.0.1:50051"],
         "--advertise-host: '10.0.0.1:50051' has a port; give the host alone (peers use --peer-listen's port)"),
        (["--advertise-host", "0.0.0.0"],
         "--advertise-host: '0.0.0.0' is a wildcard address, which peers cannot dial; give the pod IP or a host name"),
        (["--bogus", "1"], "--bogus: unknown flag (kvxfer serve --help lists the flags)"),
        (["--role"], "--role: expected one argument"),
    ):  # fmt: skip
        out = subprocess.run([*cli, *argv], capture_output=True, text=True, timeout=60)
        assert (out.returncode, out.stderr) == (2, f"error: {line}\n"), argv


def _start_fails(tmp_path: Path, *flags: str) -> dict[str, object]:
    """Run `kvxfer serve` expecting it not to start; returns its "cannot start" log line."""
    out = subprocess.run(
        [*KVXFER, "serve", "--role", "decode", "--local-socket", str(tmp_path / "k.sock"), "--metrics-listen",
         "127.0.0.1:0", *flags],
        capture_output=True, text=True, timeout=60, env={**os.environ, "UCX_MODULES": "^efa"},
    )  # fmt: skip
    # Exit 2 (not a traceback and a crash in native destructors), one JSON line naming the setting.
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    line: dict[str, object] = next(
        json.loads(x) for x in (out.stdout + out.stderr).splitlines() if '"cannot start"' in x
    )
    return line


def test_a_sidecar_that_cannot_start_exits_2_naming_the_setting(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _start_fails(tmp_path, "--peer-listen", f"127.0.0.1:{port}")
    assert line["setting"] == "peer_listen"
    assert str(line["error"]).startswith(f"--peer-listen: cannot listen on 127.0.0.1:{port}")
    line = _start_fails(tmp_path, "--peer-listen", "127.0.0.1:0", "--nixl-backends", "NOSUCH")
    assert line["setting"] == "backend"
    assert "backend plugins ['NOSUCH'] are not available" in str(line["error"])


def test_generated_code_is_up_to_date() -> None:
    out = subprocess.run([sys.executable, "-m", "kvxfer.tools.genproto", "--check"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_generated_code_check_covers_the_typing_stubs(tmp_path: Path) -> None:
    from kvxfer.tools import genproto

    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    # protoc in a process of its own: grpc_tools' compiler crashes a process that already loaded NIXL.
    code = (
        "import sys; from pathlib import Path; from kvxfer.tools import genproto; genproto.generate(Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", code, str(fresh)], cwd=ROOT, check=True, capture_output=True, timeout=120)
    shutil.copytree(fresh, stale)
    assert genproto.differences(fresh, stale) == []
    stub = stale / "kvxfer" / "v1" / "local_pb2.pyi"
    stub.write_text(stub.read_text().replace("request_id", "request_key", 1))
    (stale / "kvxfer" / "v1" / "peer_pb2_grpc.pyi").unlink()
    assert genproto.differences(fresh, stale) == [
        "missing: kvxfer/v1/peer_pb2_grpc.pyi", "differs: kvxfer/v1/local_pb2.pyi",
    ]  # fmt: skip


def _certs(d: Path, names: str = "IP:127.0.0.1,DNS:localhost") -> tuple[str, str, str]:
    """A throwaway CA and a certificate for ``names`` (127.0.0.1/localhost) signed by it (openssl CLI)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=kvxfer-test-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "s.key", "-out", "s.csr", "-subj", "/CN=localhost")
    # A cluster certificate (it names no kvxfer://engine/): both sidecars share it.
    (d / "ext").write_text(f"subjectAltName={names}\n")
    run("x509", "-req", "-in", "s.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "s.pem",
        "-days", "1", "-extfile", "ext")  # fmt: skip
    return str(d / "s.pem"), str(d / "s.key"), str(d / "ca.pem")


async def test_mutual_tls_on_the_peer_api(harness: Harness, tmp_path: Path) -> None:
    cert, key, ca = _certs(tmp_path)
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, tls_cert=cert, tls_key=key, tls_ca=ca)
    await transfer(pw, ps, dw, "tls1", {"kv": [1, 2, 3]}, {"kv": [4, 5, 6]}, salt=1)
    # A plaintext client cannot talk to the TLS peer port, and an untrusted client certificate is refused.
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    no_client_cert = grpc.ssl_channel_credentials(root_certificates=await asyncio.to_thread(Path(ca).read_bytes))
    async with grpc.aio.secure_channel(ps[0].peer_address, no_client_cert) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_peers_sharing_a_certificate_without_their_addresses_check_the_tls_server_name(
    harness: Harness, tmp_path: Path
) -> None:
    """Pods advertise their IPs, which one shared certificate cannot list: with --tls-server-name the
    sidecars check the name it carries instead, on the peer API and on the peer frames alike."""
    cert, key, ca = _certs(tmp_path, "DNS:kvxfer-peer")
    lay = attention()
    ps, pw, ds, dw = await harness.deployment(
        {"kv": lay}, {"kv": lay}, tls_cert=cert, tls_key=key, tls_ca=ca, tls_server_name="kvxfer-peer"
    )
    await transfer(pw, ps, dw, "name1", {"kv": [1, 2, 3]}, {"kv": [4, 5, 6]}, salt=1)
    assert ds[0].core is not None
    for _ in range(500):  # the frames connection opens beside the first handshake
        if ds[0].core.peers.framed(ps[0].peer_address):
            break
        await asyncio.sleep(0.01)
    assert ds[0].core.peers.framed(ps[0].peer_address)
    await transfer(pw, ps, dw, "name2", {"kv": [7]}, {"kv": [8]}, salt=2)


async def test_a_peer_certificate_without_the_dialed_address_is_refused(harness: Harness, tmp_path: Path) -> None:
    cert, key, ca = _certs(tmp_path, "DNS:kvxfer-peer")
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay}, tls_cert=cert, tls_key=key, tls_ca=ca)
    await pw[0].prefill("name3", {"kv": [1]}, salt=1)
    with pytest.raises(Exception, match="UNAVAILABLE"):
        await dw[0].pull("name3", ps, {"kv": [2]})


def test_tls_server_name_needs_tls_and_a_name() -> None:
    with pytest.raises(ConfigError, match="--tls-server-name needs --tls-cert") as info:
        load_settings({"tls_server_name": "kvxfer-peer"}, env={})
    assert info.value.field == "tls_server_name"
    with pytest.raises(ConfigError, match="KVXFER_TLS_SERVER_NAME") as bad:
        load_settings({}, env={"KVXFER_TLS_SERVER_NAME": "a name with spaces"})
    assert bad.value.field == "tls_server_name"


async def test_sidecar_logs_carry_request_transfer_and_peer(harness: Harness, json_logs: JsonLogs) -> None:
    lay = attention()
    ps, pw, _ds, dw = await harness.deployment({"kv": lay}, {"kv": lay})
    await pw[0].prefill("r-log", {"kv": [1, 2]}, salt=1)
    res = await dw[0].pull("r-log", ps, {"kv": [3, 4]}, remote_engine_id="prefill")
    with pytest.raises(Exception, match="NOT_FOUND"):
        await dw[0].pull("r-missing", ps, {"kv": [3, 4]})
    await pw[0].prefill("r-short", {"kv": [5]}, salt=2, lease=0.1)
    await asyncio.sleep(0.3)
    records = json_logs.records()

    def one(msg: str, request_id: str) -> dict[str, object]:
        found = [r for r in records if r["msg"] == msg and r.get("request_id") == request_id]
        assert len(found) == 1, (msg, request_id, json_logs.text[-3000:])
        return found[0]

    done = one("pull done", "r-log")
    assert (done["transfer_id"], done["peer"], done["bytes"]) == (res.transfer_id, "prefill", res.bytes)
    failed = one("pull ended", "r-missing")
    assert failed["peer"] == ps[0].peer_address  # no engine id given: the addresses name the peer
    assert str(failed["transfer_id"]).startswith(dw[0].sidecar.core.instance_id[:8])  # type: ignore[union-attr]
    assert failed["outcome"] == "failed"
    assert "'r-missing' is not published" in str(failed["error"])
    assert one("lease expired", "r-short")["level"] == "info"
    for r in records:
        assert {"ts", "level", "logger", "msg"} <= r.keys()


def test_json_logs_carry_context_and_never_a_token() -> None:
    import io

    from kvxfer.logs import configure_logging, get_logger, log_context

    buf = io.StringIO()
    configure_logging("info", "json", stream=buf)
    try:
        with log_context(request_id="r-9", transfer_id="t-1", peer="prefill[tp 0/2]"):
            get_logger("kvxfer.test").info("metadata was authorization: Bearer s3cret", extra={"bytes": 5})
        line = json.loads(buf.getvalue().splitlines()[-1])
    finally:
        reset_kvxfer_logging()
    got = (line["request_id"], line["transfer_id"], line["peer"], line["bytes"])
    assert got == ("r-9", "t-1", "prefill[tp 0/2]", 5)
    assert "s3cret" not in json.dumps(line)
    assert line["level"] == "info"


# ------------------------------------------------------------------------------ Drain's budget
@pytest.mark.parametrize(
    ("budget", "shown"),
    [(-5.0, "got -5.0"), (math.nan, "got nan"), (math.inf, "got inf"), (-math.inf, "got -inf"), (6.0, "got 6.0")],
    ids=["negative", "nan", "inf", "-inf", "above-drain-seconds"],
)
async def test_drain_refuses_a_bad_budget_and_drains_nothing(harness: Harness, budget: float, shown: str) -> None:
    s = await harness.sidecar(role="both")  # --drain-seconds 5
    w = await harness.worker(s, {"kv": attention()})
    await w.client.publish("held", {"kv": [1, 2]})
    exc = await expect_error(
        grpc.StatusCode.INVALID_ARGUMENT, w.client.drain(budget),
        "timeout_seconds: must be in [0, 5] (0: the sidecar's --drain-seconds, 5s; a Drain may shorten the budget, "
        "not extend it), " + shown,
    )  # fmt: skip
    assert (exc.reason, exc.field) == (Reason.INVALID_FIELD, "timeout_seconds")
    status = await w.client.status()
    assert (status["draining"], status["leases"]) == (False, 1)  # nothing was released, nothing refused
    assert await _health(s.peer_address, "") == SERVING
    await w.client.publish("after", {"kv": [3]})
    assert await w.client.drain(0.2) == {"completed": 0, "abandoned": 0, "released_leases": 2}


async def test_a_drain_finishes_when_its_caller_stops_waiting(harness: Harness) -> None:
    s = await harness.sidecar(role="both")
    w = await harness.worker(s, {"kv": attention()})
    await w.client.publish("held", {"kv": [1, 2]})
    with pytest.raises(KvxferRpcError) as info:  # the caller gives up long before the 1 s budget is spent
        await w.client.drain(1.0, deadline=0.2)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert s.core is not None
    await asyncio.wait_for(s.core.drain_done.wait(), timeout=5)  # not left half drained
    status = await w.client.status()
    assert (status["draining"], status["leases"]) == (True, 0)
    assert await w.client.drain() == {"completed": 0, "abandoned": 0, "released_leases": 1}  # the same drain's answer


# ------------------------------------------------------------------------------ addresses
BAD_ADDRESSES = [
    ("127.0.0.1:0", "port 0 in '127.0.0.1:0' cannot be dialled (0 only means 'any free port' to a listener)"),
    ("127.0.0.1:70000", "port 70000 in '127.0.0.1:70000' is not in [1, 65535]"),
    (":50051", "':50051' has no host; give the host name or IP peers reach"),
    ("0.0.0.0:50051", "'0.0.0.0:50051' names the wildcard host '0.0.0.0', which only a listener can use"),
    ("foo", "'foo' is not host:port (use [addr]:port for IPv6)"),
    ("host:abc", "'host:abc' has port 'abc', not a number (host:port, port in [1, 65535])"),
    ("unix:///run/kvxfer/kvxfer.sock", "'unix:///run/kvxfer/kvxfer.sock' is a path or URL; this is a TCP address"),
    ("256.0.0.1:50051", "'256.0.0.1' in '256.0.0.1:50051' is not an IPv4 address"),
    ("[fe80::zz]:50051", "'fe80::zz' in '[fe80::zz]:50051' is not an IPv6 address"),
]


@pytest.mark.parametrize(("address", "message"), BAD_ADDRESSES, ids=[a for a, _ in BAD_ADDRESSES])
async def test_an_unusable_peer_address_is_invalid_argument(harness: Harness, address: str, message: str) -> None:
    ps, pw, _ds, dw = await harness.deployment({"kv": attention()}, {"kv": attention()})
    await pw[0].prefill("r1", {"kv": [1, 2]}, salt=1)
    # Pull, as the second address too: refused before anything is dialled, naming the field and the value.
    for addresses, where in (
        ([address], "remote_addresses[0]"),
        ([ps[0].peer_address, address], "remote_addresses[1]"),
    ):
        exc = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, dw[0].client.pull("r1", addresses, {"kv": [3, 4]}),
                                 f"{where}: {message}")  # fmt: skip
        assert (exc.reason, exc.field) == (Reason.INVALID_FIELD, where)
    (item,) = await dw[0].client.pull_batch([PullItem("r1", [address], {"kv": [3, 4]})])
    assert isinstance(item, KvxferRpcError)
    assert (item.code, item.field) == (grpc.StatusCode.INVALID_ARGUMENT, "remote_addresses[0]")
    assert f"remote_addresses[0]: {message}" in item.details
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, dw[0].client.drop_remote("r1", [address]),
                       f"remote_addresses[0]: {message}")  # fmt: skip
    # The publish is untouched: the corrected pull reads it.
    await transfer(pw, ps, dw, "r2", {"kv": [5]}, {"kv": [6]}, salt=2)
    assert (await dw[0].client.pull("r1", [ps[0].peer_address], {"kv": [3, 4]})).done


async def test_a_handshake_with_an_unusable_address_is_invalid_argument(harness: Harness) -> None:
    ps, _pw, ds, _dw = await harness.deployment({"kv": attention()}, {"kv": attention()})
    assert ds[0].core is not None
    info = ds[0].core.identity().to_proto()
    async with grpc.aio.insecure_channel(ps[0].peer_address) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        for address, message in [("", "'' is not host:port"), *BAD_ADDRESSES]:
            info.address = address
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Handshake(peer_pb2.HandshakeRequest(info=info), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, address
            assert (err.value.details() or "").startswith(f"info.address: {message}"), err.value.details()


def test_listen_and_advertise_settings_are_checked() -> None:
    # Listening may leave the host empty (every interface) and take port 0 (any free port): the tests do.
    assert parse_address(":0") == ("0.0.0.0", 0)
    assert load_settings({"peer_listen": "127.0.0.1:0", "metrics_listen": "[::1]:0"}, env={}).peer_listen == (
        "127.0.0.1:0"
    )
    assert load_settings({"advertise_host": "[fd00::1]"}, env={}).advertise_address(50051) == "[fd00::1]:50051"
    for flags, message in (
        ({"peer_listen": "127.0.0.1:65536"}, "--peer-listen: port 65536 in '127.0.0.1:65536' is not in [0, 65535]"),
        ({"metrics_listen": "foo"}, "--metrics-listen: 'foo' is not host:port"),
        ({"local_listen": "bad host:1"}, "--local-listen: 'bad host' in 'bad host:1' is not a host name"),
        ({"advertise_host": "10.0.0.1:50051"}, "--advertise-host: '10.0.0.1:50051' has a port"),
        ({"advertise_host": "::"}, "--advertise-host: '::' is a wildcard address, which peers cannot dial"),
        ({"advertise_host": "http://pod"}, "--advertise-host: 'http://pod' is a URL or path"),
    ):
        with pytest.raises(ConfigError) as info:
            load_settings(flags, env={})
        assert info.value.message.startswith(message), info.value.message
        assert info.value.field == next(iter(flags))


async def test_bad_seconds_from_the_client_are_refused_by_name(harness: Harness) -> None:
    # Lease and drain budget are checked by the sidecar (NaN, infinite, negative), a raw Pull's
    # timeout_seconds too (bench/bad_inputs.py); the client's own deadlines, a pull's included, are
    # refused by the client naming ``deadline``, and never become a gRPC timeout that ends the call at
    # once as DEADLINE_EXCEEDED.
    ps, pw, _ds, dw = await harness.deployment({"kv": attention()}, {"kv": attention()})
    await pw[0].prefill("r1", {"kv": [1, 2]}, salt=1)
    for bad in (math.nan, math.inf, -1.0):
        await expect_error(grpc.StatusCode.INVALID_ARGUMENT, pw[0].client.publish("r2", {"kv": [3]}, lease_seconds=bad),
                           f"lease_seconds: must be in [0, 86400], got {bad}")  # fmt: skip
        pull = dw[0].client.pull("r1", [ps[0].peer_address], {"kv": [3, 4]}, deadline=bad)
        exc = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, pull,
                                 f"deadline: must be a finite number of seconds > 0 (None: the sidecar's "
                                 f"--transfer-timeout-seconds), got {bad}")  # fmt: skip
        assert exc.field == "deadline"
        (item,) = await dw[0].client.pull_batch([PullItem("r1", [ps[0].peer_address], {"kv": [3, 4]}, deadline=bad)])
        assert isinstance(item, KvxferRpcError)
        assert (item.code, item.field) == (grpc.StatusCode.INVALID_ARGUMENT, "deadline")
        exc = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, pw[0].client.release("r1", deadline=bad),
                                 f"deadline: must be a finite number of seconds > 0, got {bad}")  # fmt: skip
        assert exc.field == "deadline"
        with pytest.raises(InvalidArgumentError, match=r"timeout: must be a finite number of seconds > 0"):
            AsyncClient(ps[0].local_target, timeout=bad)
    # Nothing was lost on the way: the publish is still there to pull.
    assert (await dw[0].client.pull("r1", [ps[0].peer_address], {"kv": [3, 4]})).done


async def test_kvxfer_health_is_an_exec_probe_on_the_local_socket(harness: Harness) -> None:
    sc = await harness.sidecar("probed", role="prefill")

    def health(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*KVXFER, "health", *argv], capture_output=True, text=True, timeout=60, check=False)

    target = f"--target={sc.settings.local_socket}"
    live, ready = await asyncio.gather(asyncio.to_thread(health, target, "--service=liveness"),
                                       asyncio.to_thread(health, target))  # fmt: skip
    assert (live.returncode, live.stdout.strip()) == (0, "SERVING")
    assert (ready.returncode, ready.stdout.strip()) == (1, "NOT_SERVING")  # nothing registered yet
    await harness.worker(sc, {"kv": attention()})
    ready = await asyncio.to_thread(health, target)
    assert (ready.returncode, ready.stdout.strip()) == (0, "SERVING")
    gone = await asyncio.to_thread(health, f"--target={harness.sock_dir}/nobody.sock")
    assert gone.returncode == 1
    assert gone.stderr.startswith("error: --target: no sidecar health answer at "), gone.stderr
    bad = await asyncio.to_thread(health, target, "--service=peer")
    assert (bad.returncode, bad.stderr.strip()) == (
        2,
        "error: --service: must be 'liveness' or '' (readiness), got 'peer'",
    )

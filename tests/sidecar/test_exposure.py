"""Secure by default: who may reach the sidecar's listeners before any credential is checked.

A peer or local API reachable from other hosts needs the token or mutual TLS (or an explicit
``--insecure``); the local Unix socket exists only with its final mode; /metrics asks for the
token when there is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from kvxfer.config import ConfigError, is_loopback_host, load_settings
from kvxfer.errors import Reason
from kvxfer.server.app import Sidecar
from kvxfer.server.listeners import SOCKET_MODE
from tests.sidecar.conftest import JsonLogs
from tests.sidecar.helpers import Harness

OPEN_ADDRESSES = ["0.0.0.0:50051", "[::]:50051", ":50051", "10.1.2.3:50051", "[fd00::7]:50051", "kvxfer-0.pod:50051"]
LOOPBACK_ADDRESSES = ["127.0.0.1:50051", "127.8.9.10:50051", "[::1]:50051", "localhost:50051",
                      "LOCALHOST:50051", "[::ffff:127.0.0.1]:50051"]  # fmt: skip


def _stand_in(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.write_text("stand-in\n")
    return str(path)


# ------------------------------------------------------------------------------ --insecure
@pytest.mark.parametrize("address", OPEN_ADDRESSES)
def test_a_peer_api_beyond_loopback_without_credentials_is_refused(address: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"peer_listen": address}, env={})
    err = info.value
    assert err.field == "peer_listen"
    assert err.reason is Reason.INSECURE_LISTEN
    assert err.status == "INVALID_ARGUMENT"
    assert err.message.startswith(f"--peer-listen: {address!r} is not a loopback address")
    assert "--insecure true" in err.message
    assert "--token-file" in err.message
    # The same from the environment names the variable the user set.
    with pytest.raises(ConfigError) as info:
        load_settings({}, env={"KVXFER_PEER_LISTEN": address})
    assert info.value.message.startswith(f"KVXFER_PEER_LISTEN: {address!r} is not a loopback address")


@pytest.mark.parametrize("address", LOOPBACK_ADDRESSES)
def test_loopback_needs_no_credentials(address: str) -> None:
    assert load_settings({"peer_listen": address}, env={}).peer_listen == address


def test_loopback_is_decided_without_resolving_names() -> None:
    assert [is_loopback_host(h) for h in ("127.0.0.1", "127.255.0.1", "::1", "[::1]", "localhost", "localhost.")] == [
        True
    ] * 6
    # A name that resolves to loopback today may not tomorrow: only "localhost" itself counts.
    assert [is_loopback_host(h) for h in ("0.0.0.0", "::", "", "128.0.0.1", "localhost.example", "ip6-localhost")] == [
        False
    ] * 6


def test_credentials_or_insecure_allow_any_address(tmp_path: Path) -> None:
    token = _stand_in(tmp_path, "token")
    cert, key, ca = (_stand_in(tmp_path, n) for n in ("cert.pem", "key.pem", "ca.pem"))
    for flags in (
        {"token_file": token},
        {"tls_cert": cert, "tls_key": key, "tls_ca": ca},
        {"insecure": "true"},
    ):
        settings = load_settings({"peer_listen": "0.0.0.0:50051", **flags}, env={})
        assert settings.peer_listen == "0.0.0.0:50051", flags
    assert load_settings({"peer_listen": "0.0.0.0:50051"}, env={"KVXFER_INSECURE": "true"}).insecure is True


def test_a_data_plane_serving_its_memory_to_anyone_needs_insecure_beyond_loopback(tmp_path: Path) -> None:
    """--backend mooncake: its engine serves the registered memory to callers with no credential
    (tests/transport/test_open_memory.py), so the token or mutual TLS do not make it safe off loopback."""
    token = _stand_in(tmp_path, "token")
    flags = {"peer_listen": "0.0.0.0:50051", "advertise_host": "10.1.2.3", "token_file": token, "backend": "mooncake"}
    with pytest.raises(ConfigError) as info:
        load_settings(flags, env={})
    assert info.value.field == "backend"
    assert info.value.reason is Reason.INSECURE_LISTEN
    assert info.value.status == "INVALID_ARGUMENT"
    assert info.value.message.startswith("--backend: 'mooncake' on 10.1.2.3 (the advertised host)")
    assert "--insecure true" in info.value.message
    assert load_settings({**flags, "backend": "nixl"}, env={}).backend == "nixl"
    assert load_settings({**flags, "insecure": "true"}, env={}).backend == "mooncake"
    assert load_settings({"peer_listen": "127.0.0.1:50051", "backend": "mooncake"}, env={}).backend == "mooncake"


def test_tls_without_client_certificates_is_not_authentication(tmp_path: Path) -> None:
    cert, key = _stand_in(tmp_path, "cert.pem"), _stand_in(tmp_path, "key.pem")
    with pytest.raises(ConfigError) as info:
        load_settings({"peer_listen": "0.0.0.0:50051", "tls_cert": cert, "tls_key": key}, env={})
    assert info.value.field == "peer_listen"
    assert info.value.reason is Reason.INSECURE_LISTEN
    assert "TLS without --tls-ca checks no client certificate" in info.value.message


def test_a_local_api_beyond_loopback_needs_the_token(tmp_path: Path) -> None:
    cert, key, ca = (_stand_in(tmp_path, n) for n in ("cert.pem", "key.pem", "ca.pem"))
    # TLS is served on the peer API only: it does not cover a TCP local API.
    flags = {"local_listen": "0.0.0.0:50052", "tls_cert": cert, "tls_key": key, "tls_ca": ca}
    with pytest.raises(ConfigError) as info:
        load_settings(flags, env={})
    assert info.value.field == "local_listen"
    assert info.value.reason is Reason.INSECURE_LISTEN
    assert info.value.message.startswith("--local-listen: '0.0.0.0:50052' is not a loopback address")
    assert "--insecure true" in info.value.message
    assert load_settings({**flags, "token_file": _stand_in(tmp_path, "token")}, env={}).local_listen
    assert load_settings({"local_listen": "127.0.0.1:50052"}, env={}).local_listen == "127.0.0.1:50052"


def test_the_sidecar_process_refuses_to_start_naming_the_flag_and_the_address(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.server", "--peer-listen", "0.0.0.0:50051",
         "--local-socket", str(tmp_path / "k.sock"), "--metrics-listen", ""],
        capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items() if "KVXFER_" not in k},
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    line = out.stderr.strip().splitlines()[-1]  # one plain line, like every bad setting (docs/sidecar.md)
    assert line.startswith("error: --peer-listen: '0.0.0.0:50051' is not a loopback address"), line
    assert "--insecure true" in line
    assert not (tmp_path / "k.sock").exists()


async def test_insecure_starts_and_says_so(harness: Harness, json_logs: JsonLogs) -> None:
    sc = await harness.sidecar("open", peer_listen="0.0.0.0:0", insecure="true")
    assert sc.peer_port > 0
    (warning,) = [r for r in json_logs.records() if r["msg"] == "listening without credentials beyond loopback"]
    assert warning["level"] == "warning"
    assert warning["setting"] == "peer_listen"
    assert warning["address"] == "0.0.0.0:0"


# ------------------------------------------------------------------------------ the socket
async def test_the_socket_has_its_final_mode_before_anyone_can_connect(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC binds and listens in add_insecure_port (the kernel accepts connections into the backlog
    from then on): at that moment the socket must already be 0660, or sit where only the sidecar's
    user can reach it (a 0700 directory); when the server starts, it is in place with 0660."""
    from grpc.aio import _server as aio_server

    sock = harness.sock_dir / "hooked.sock"
    binds: list[tuple[Path, int, int]] = []
    starts: list[int] = []
    add_port, start = aio_server.Server.add_insecure_port, aio_server.Server.start

    def bind_and_look(self: aio_server.Server, address: str) -> int:
        port = add_port(self, address)
        if address.startswith("unix:"):
            bound = Path(address.removeprefix("unix://"))
            binds.append((bound, stat.S_IMODE(os.stat(bound).st_mode), stat.S_IMODE(os.stat(bound.parent).st_mode)))
        return port

    async def start_and_look(self: aio_server.Server) -> None:
        if sock.exists():
            starts.append(stat.S_IMODE(os.stat(sock).st_mode))
        await start(self)

    monkeypatch.setattr(aio_server.Server, "add_insecure_port", bind_and_look)
    monkeypatch.setattr(aio_server.Server, "start", start_and_look)
    await harness.sidecar("hooked", local_socket=str(sock))
    ((bound, mode, parent_mode),) = binds
    assert mode == 0o660 or (parent_mode == 0o700 and bound.parent != sock.parent), (bound, oct(mode), oct(parent_mode))
    assert bound.parent.parent == sock.parent  # staged beside it: the rename stays on one filesystem
    assert starts == [0o660, 0o660]  # the peer server starts first, then the local one
    assert sorted(os.listdir(harness.sock_dir)) == ["hooked.sock", "hooked.sock.fast", "hooked.sock.fds"]


async def test_the_socket_has_its_final_mode_from_the_moment_it_exists(harness: Harness) -> None:
    """Watch the socket's path from another thread while the sidecar starts: whenever it exists,
    its mode is already 0660, and the private staging directory is never open to others."""
    sock = harness.sock_dir / "watched.sock"
    fast = harness.sock_dir / "watched.sock.fast"
    seen: set[int] = set()
    seen_fast: set[int] = set()
    staging: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                seen.add(stat.S_IMODE(os.stat(sock).st_mode))
            with contextlib.suppress(FileNotFoundError):
                seen_fast.add(stat.S_IMODE(os.stat(fast).st_mode))
            for entry in os.scandir(harness.sock_dir):
                if entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        staging.add(stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode))

    watcher = threading.Thread(target=watch, daemon=True)
    # Hand the GIL over every few microseconds, so the watcher looks inside any window of the start.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    watcher.start()
    try:
        sc = await harness.sidecar("watched", local_socket=str(sock))
        await asyncio.sleep(0.05)
    finally:
        stop.set()
        watcher.join(5)
        sys.setswitchinterval(interval)
    assert seen == {SOCKET_MODE} == {0o660}
    assert staging <= {0o700}
    # The fast socket is bound, given its mode, then listens: nobody can connect while it is
    # anything but 0660 (a watcher may glimpse the umask's mode between bind and chmod).
    assert 0o660 in seen_fast
    # Nothing is left of the staging: the socket, its descriptor socket and its fast socket, all 0660.
    assert sorted(os.listdir(harness.sock_dir)) == ["watched.sock", "watched.sock.fast", "watched.sock.fds"]
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    assert stat.S_IMODE(os.stat(f"{sock}.fds").st_mode) == 0o660
    assert stat.S_IMODE(os.stat(fast).st_mode) == 0o660
    # The socket that was renamed into place is the one the server listens on.
    status = await _local_status(sc)
    assert status["registered"] is False


async def _local_status(sc: Sidecar) -> dict[str, object]:
    from kvxfer.client import AsyncClient

    async with AsyncClient(sc.local_target, timeout=10) as client:
        return await client.status()


async def test_the_socket_directory_is_created_and_a_stale_socket_replaced(harness: Harness) -> None:
    import socket as socketlib

    nested = harness.sock_dir / "a" / "b" / "k.sock"
    stale = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    nested.parent.mkdir(parents=True)
    stale.bind(str(nested))  # bound, never listening: what a killed sidecar leaves behind
    stale.close()
    os.chmod(nested, 0o777)
    sc = await harness.sidecar("nested", local_socket=str(nested))
    assert stat.S_IMODE(os.stat(nested).st_mode) == 0o660
    assert sorted(os.listdir(nested.parent)) == ["k.sock", "k.sock.fast", "k.sock.fds"]
    assert (await _local_status(sc))["registered"] is False


# ------------------------------------------------------------------------------ /metrics
def _get(port: int, header: str | None = None) -> tuple[int, dict[str, str], str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if header is not None:
        req.add_header("Authorization", header)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read().decode()


async def test_metrics_ask_for_the_token_when_there_is_one(harness: Harness, token_file: Callable[[str], str]) -> None:
    sc = await harness.sidecar("m", metrics_listen="127.0.0.1:0", token_file=token_file("s3cret-metrics"))
    port = sc.metrics_port
    for header in (None, "Bearer wrong", "Bearer s3cret-metricsX", "Basic czNjcmV0LW1ldHJpY3M=", "s3cret-metrics",
                   "Bearer", ""):  # fmt: skip
        code, headers, body = await asyncio.to_thread(_get, port, header)
        assert code == 401, header
        assert headers["WWW-Authenticate"] == 'Bearer realm="kvxfer-metrics"'
        assert "s3cret" not in body
        assert "kvxfer_build_info" not in body
    for header in ("Bearer s3cret-metrics", "bearer s3cret-metrics"):
        code, _headers, body = await asyncio.to_thread(_get, port, header)
        assert code == 200, header
        assert "kvxfer_build_info{" in body


async def test_metrics_auth_none_keeps_metrics_open_beside_a_token(
    harness: Harness, token_file: Callable[[str], str]
) -> None:
    sc = await harness.sidecar("m", metrics_listen="127.0.0.1:0", token_file=token_file("t0k"), metrics_auth="none")
    code, _headers, body = await asyncio.to_thread(_get, sc.metrics_port)
    assert code == 200
    assert "kvxfer_build_info{" in body


async def test_metrics_are_open_without_a_token(harness: Harness) -> None:
    sc = await harness.sidecar("m", metrics_listen="127.0.0.1:0")
    code, _headers, _body = await asyncio.to_thread(_get, sc.metrics_port)
    assert code == 200


def test_metrics_auth_token_needs_a_token() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"metrics_auth": "token"}, env={})
    assert info.value.field == "metrics_auth"
    assert info.value.message == "--metrics-auth: token needs --token-file (the token /metrics asks for)"
    with pytest.raises(ConfigError) as info:
        load_settings({"metrics_auth": "basic"}, env={})
    assert info.value.message == "--metrics-auth: Input should be 'token' or 'none' (got 'basic')"

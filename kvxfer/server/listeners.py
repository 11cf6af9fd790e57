"""Where a sidecar listens: its Unix socket made safely, TCP ports, TLS credentials, open listeners.

Each failure is a :class:`kvxfer.errors.ConfigError` that names the setting and the address.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any

import grpc

from kvxfer.addresses import is_loopback_host, parse_address
from kvxfer.config import ConfigError, Settings

__all__ = [
    "SOCKET_MODE",
    "bind_tcp",
    "channel_credentials",
    "listen_unix",
    "listeners_without_credentials",
    "peer_channel_options",
    "prepare_socket",
    "server_credentials",
]


#: Mode of the local API's Unix socket: owner and group read/write. The worker runs as another
#: user in another container: the pod's shared group (fsGroup) may connect, nobody else. The
#: token, when set, still applies.
SOCKET_MODE = 0o660


def listen_unix(server: grpc.aio.Server, path: Path) -> None:
    """Bind ``server`` to the Unix socket ``path``, which appears there already with SOCKET_MODE.

    gRPC binds and listens inside ``add_insecure_port``, with the process umask: a chmod after it
    leaves a window in which anyone the umask lets in may connect. Setting the umask around the
    bind would change the mode of whatever any other thread creates meanwhile (in library mode the
    sidecar runs inside a worker's process). So the socket is bound in a private directory (mode
    0700, beside ``path`` so that the rename stays on one filesystem and is atomic), given its
    mode there, where nobody else can reach it, and renamed into place. Connections made before
    the server starts wait in the listen backlog.
    """
    try:
        private = Path(tempfile.mkdtemp(prefix=".", dir=path.parent))
    except OSError as exc:
        raise ConfigError(f"--local-socket: cannot create a directory in {path.parent}: {exc}",
                          field="local_socket") from None  # fmt: skip
    staged = private / "s"  # short: a Unix socket path has at most 107 bytes
    try:
        try:
            bound = server.add_insecure_port(f"unix://{staged}")
        except RuntimeError as exc:
            raise ConfigError(f"--local-socket: cannot listen on {path}: {exc}", field="local_socket") from None
        if bound == 0:
            raise ConfigError(f"--local-socket: cannot listen on {path}", field="local_socket")
        os.chmod(staged, SOCKET_MODE)
        os.rename(staged, path)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def prepare_socket(path: Path) -> Path:
    """Create the socket's directory and remove a stale socket (refuse a live one)."""
    path = path.resolve()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--local-socket: cannot create directory {path.parent}: {exc}", field="local_socket"
        ) from None
    if path.exists():
        if not stat.S_ISSOCK(path.stat().st_mode):
            raise ConfigError(f"--local-socket: {path} exists and is not a socket", field="local_socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale: nobody listens
        else:
            raise ConfigError(f"--local-socket: another process is serving on {path}", field="local_socket")
        finally:
            probe.close()
    return path


def bind_tcp(server: grpc.aio.Server, address: str, setting: str, creds: grpc.ServerCredentials | None) -> int:
    """Bind ``server`` to ``address`` (the value of ``setting``), under TLS with ``creds``; the bound port."""
    parse_address(address, setting=setting)
    flag = "--" + setting.replace("_", "-")
    try:
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"{flag}: cannot listen on {address}: {exc}", field=setting) from None
    if port == 0:
        raise ConfigError(f"{flag}: cannot listen on {address} (in use or not a local address)", field=setting)
    return int(port)


def server_credentials(s: Settings) -> grpc.ServerCredentials | None:
    """The peer API's TLS (client certificates required when --tls-ca is set); None without TLS."""
    if not s.tls_enabled:
        return None
    assert s.tls_cert is not None
    assert s.tls_key is not None
    ca = s.tls_ca.read_bytes() if s.tls_ca else None
    return grpc.ssl_server_credentials(
        [(s.tls_key.read_bytes(), s.tls_cert.read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def peer_channel_options(s: Settings) -> list[tuple[str, Any]]:
    """Channel options for dialing peers beyond the shared ones: the name their certificates must
    carry (``--tls-server-name``), where it is not the host of the address dialed (a pod IP)."""
    return [("grpc.ssl_target_name_override", s.tls_server_name)] if s.tls_enabled and s.tls_server_name else []


def channel_credentials(s: Settings) -> grpc.ChannelCredentials | None:
    """What this sidecar presents and trusts when it dials a peer; None without TLS."""
    if not s.tls_enabled:
        return None
    assert s.tls_cert is not None
    assert s.tls_key is not None
    return grpc.ssl_channel_credentials(
        root_certificates=s.tls_ca.read_bytes() if s.tls_ca else None,
        private_key=s.tls_key.read_bytes(),
        certificate_chain=s.tls_cert.read_bytes(),
    )


def listeners_without_credentials(s: Settings) -> list[tuple[str, str]]:
    """(setting, address) of every listener that anyone on the network may use (allowed by --insecure)."""
    open_ones = []
    if not s.peers_authenticated and not is_loopback_host(s.peer_host_port[0]):
        open_ones.append(("peer_listen", s.peer_listen))
    if (host := s.open_data_plane_host()) is not None:
        open_ones.append(("backend", f"{s.backend} on {host}"))
    for setting, address, guarded in (
        ("local_listen", s.local_listen, s.token_file is not None),
        ("metrics_listen", s.metrics_listen, s.metrics_token is not None),
    ):
        if address and not guarded and not is_loopback_host(parse_address(address, setting=setting)[0]):
            open_ones.append((setting, address))
    return open_ones

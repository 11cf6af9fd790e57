"""Sidecar settings: flags > ``KVXFER_*`` environment > ``--config`` file > defaults.

Every setting of docs/sidecar-contract.md is one field of :class:`Settings`. :func:`load_settings`
merges the four sources and validates the result once, at start-up; any problem raises
:class:`ConfigError` whose message names the setting the way the user wrote it (``--lease-seconds``,
``KVXFER_LEASE_SECONDS`` or the file key) and the bad value.

The file may be JSON or YAML (read with PyYAML's safe loader).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml  # type: ignore[import-untyped]
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvxfer.addresses import WILDCARD_HOSTS, check_host, is_loopback_host, parse_address
from kvxfer.errors import ConfigError, KvxferError, Reason
from kvxfer.transport import TransportConfig, available_transports, transport_class
from kvxfer.transport.base import DEFAULT_FENCE_BUDGET_S

__all__ = [
    "ENV_PREFIX",
    "WILDCARD_HOSTS",
    "ConfigError",
    "Settings",
    "check_host",
    "env_name",
    "flag_name",
    "is_loopback_host",
    "load_settings",
    "parse_address",
    "read_config_file",
]

ENV_PREFIX = "KVXFER_"


def flag_name(field: str) -> str:
    """``lease_seconds`` -> ``--lease-seconds``."""
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    """``lease_seconds`` -> ``KVXFER_LEASE_SECONDS``."""
    return ENV_PREFIX + field.upper()


class Settings(BaseModel):
    """Validated sidecar settings (field names are the flags with dashes as underscores)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    config: Path | None = Field(None, description="YAML or JSON file with any of the settings below")
    engine_id: str = Field(default_factory=socket.gethostname, description="this worker's engine id")
    role: Literal["prefill", "decode", "both"] = Field("both", description="prefill, decode or both")
    peer_listen: str = Field("127.0.0.1:50051", description="peer gRPC API and grpc.health.v1 (host:port)")
    advertise_host: str | None = Field(None, description="address peers use to reach this sidecar")
    local_socket: str = Field("/run/kvxfer/kvxfer.sock", description="Unix socket for the local API ('' disables)")
    local_listen: str | None = Field(None, description="optional TCP address for the local API")
    fast_socket: bool = Field(
        True,
        description="also serve the worker's hot calls (Pull, PullBatch, Publish, Expect, ...) as frames on "
        "<local-socket>.fast (true/false)",
    )
    peer_frames: bool = Field(
        True,
        description="also serve the peer API's hot calls (GetPublished, Notify, Hold and their batches) as frames on a "
        "TCP port of the peer API's host, with its TLS and token, and use a peer's when it offers one (true/false)",
    )
    peer_frames_port: int = Field(
        0, ge=0, le=65535, description="TCP port of the peer frames listener (0: any free port, told to peers in "
        "the handshake)",
    )  # fmt: skip
    busy_poll_seconds: float = Field(
        0.0, ge=0.0, le=60.0,
        description="keep the event loop polling, never sleeping, this many seconds after each call on the fast "
        "socket or the peer frames listener: saves waking up on the next pull and costs a core while it polls "
        "(0: off)",
    )  # fmt: skip
    busy_poll_above_rate: float = Field(
        500.0, ge=0.0, le=1e6,
        description="keep the event loop polling, never sleeping, while calls on the fast socket or the peer frames "
        "listener come faster than this many a second (a running mean): at such a rate the loop is busy most of the "
        "time anyway, and the wake-ups it spares are the tail of a loaded sidecar's latency (0: off)",
    )  # fmt: skip
    metrics_listen: str = Field("127.0.0.1:9400", description="Prometheus /metrics (host:port; '' disables)")
    metrics_auth: Literal["token", "none"] | None = Field(
        None, description="/metrics: token (needs the bearer token) or none (open)"
    )
    backend: str = Field(
        "nixl",
        description="data plane: nixl or mooncake (any registered kvxfer.transport backend), or worker: the worker's "
        "own agent moves the bytes, driven by this sidecar (kvxfer.worker_agent)",
    )
    nixl_backends: tuple[str, ...] = Field(("UCX",), description="comma-separated NIXL backend plugins")
    mooncake_protocol: Literal["tcp", "rdma"] = Field("tcp", description="Mooncake transport: tcp or rdma")
    mooncake_device: str = Field("", description="Mooncake RDMA device list (empty: auto)")
    data_port: int = Field(0, ge=0, le=65535, description="data-plane listen port (0: ephemeral)")
    cuda_ipc_direct: bool = Field(
        True, description="same-host GPU READs by CUDA device copies instead of the backend (true/false)"
    )
    cuda_gather: Literal["kernel", "copy-engine"] = Field(
        "kernel",
        description="how same-host GPU READs move a pull's spans: kernel (one gather launch) or copy-engine",
    )
    nixl_progress_delay_us: int = Field(
        200, ge=0, le=1_000_000,
        description="microseconds the NIXL agent's progress thread sleeps between rounds (0: it spins a core)",
    )  # fmt: skip
    nixl_thread_post_bytes: int = Field(
        4 << 20, ge=0, le=1 << 40,
        description="NIXL: DRAM transfers of at least this many bytes are posted from a thread of their own, so "
        "that their copy does not hold up the sidecar's event loop (0: never)",
    )  # fmt: skip
    fence_budget_seconds: float = Field(
        DEFAULT_FENCE_BUDGET_S, ge=0, le=3600, allow_inf_nan=False,
        description="how long a failed or cancelled transfer waits for the data plane to say its operation ended "
        "before it is reported as unfenced (reason DATA_PLANE_UNFENCED: its bytes may still land)",
    )  # fmt: skip
    unfenced_hold_seconds: float = Field(
        300.0, gt=0, le=86400, allow_inf_nan=False,
        description="how long a worker keeps the blocks of a pull that failed with reason DATA_PLANE_UNFENCED when "
        "no one can see its READ end (GetStatus.unsettled names the pull until then); a READ seen to end frees "
        "them at once",
    )  # fmt: skip
    lease_seconds: float = Field(
        30.0, gt=0, le=86400, allow_inf_nan=False, description="how long published blocks are held"
    )
    max_hold_seconds: float = Field(
        600.0, gt=0, le=86400, allow_inf_nan=False,
        description="longest a decode side's holds keep a publish alive (reader: how long it holds a request)",
    )  # fmt: skip
    transfer_timeout_seconds: float = Field(
        30.0, gt=0, le=3600, allow_inf_nan=False, description="deadline of one transfer"
    )
    drain_seconds: float = Field(20.0, ge=0, le=3600, allow_inf_nan=False, description="graceful shutdown budget")
    max_message_bytes: int = Field(67108864, ge=65536, le=2**31 - 1, description="gRPC max send/receive message size")
    tls_cert: Path | None = Field(None, description="PEM certificate (with --tls-key: TLS on the peer API)")
    tls_key: Path | None = Field(None, description="PEM private key")
    tls_ca: Path | None = Field(None, description="PEM CA bundle: client-cert checks and peer verification")
    tls_server_name: str | None = Field(
        None, min_length=1, max_length=253, pattern=r"^[A-Za-z0-9*]([A-Za-z0-9.*-]*[A-Za-z0-9])?$",
        description="name a peer's certificate must carry when this sidecar dials it (none: the dialed "
        "address's host; set it when peers advertise pod IPs and share one certificate)",
    )  # fmt: skip
    token_file: Path | None = Field(None, description="file holding the shared bearer token")
    insecure: bool = Field(
        False,
        description="allow a non-loopback --peer-listen/--local-listen without --token-file or TLS, and a data "
        "plane that serves its memory to callers without credentials (--backend mooncake) off loopback (true/false)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_format: Literal["json", "text"] = Field("json", description="json or text")

    # ------------------------------------------------------------------ field checks
    @field_validator("engine_id")
    @classmethod
    def _engine_id(cls, v: str) -> str:
        v = v.strip()
        if not v or len(v) > 128 or any(c.isspace() for c in v):
            raise ValueError(f"must be 1-128 characters without spaces, got {v!r}")
        return v

    @field_validator("peer_listen")
    @classmethod
    def _peer_listen(cls, v: str) -> str:
        _address_or_raise(v)
        return v.strip()

    @field_validator("advertise_host")
    @classmethod
    def _advertise_host(cls, v: str | None) -> str | None:
        # Peers dial this host at the peer port: a port here, a scheme or a wildcard would be
        # advertised as is and fail only when the first peer tries to connect.
        if v is None or not v.strip():
            return None
        host = v.strip()
        if "/" in host:
            raise ValueError(f"{v!r} is a URL or path; give the host alone (a name or an IP address)")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        elif host.count(":") == 1:
            raise ValueError(f"{v!r} has a port; give the host alone (peers use --peer-listen's port)")
        try:
            check_host(host, setting="advertise_host", value=v)
        except ConfigError as exc:
            raise ValueError(exc.message.removeprefix("advertise_host: ")) from None
        if host in WILDCARD_HOSTS:
            raise ValueError(f"{v!r} is a wildcard address, which peers cannot dial; give the pod IP or a host name")
        return host

    @field_validator("local_listen", "metrics_listen")
    @classmethod
    def _optional_address(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return "" if v is not None else None
        _address_or_raise(v)
        return v.strip()

    @field_validator("role", "backend", "mooncake_protocol", "log_level", "log_format", "metrics_auth", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, v: str) -> str:
        names = available_transports()
        if v not in names:
            raise ValueError(f"must be one of {', '.join(names)}, got {v!r}")
        return v

    @field_validator("nixl_backends", mode="before")
    @classmethod
    def _split_backends(cls, given: Any) -> Any:
        v = [p.strip() for p in given.split(",")] if isinstance(given, str) else given
        if isinstance(v, list | tuple):
            items = [str(p).strip() for p in v if str(p).strip()]
            if not items:
                raise ValueError(f"needs at least one NIXL backend plugin name (e.g. UCX), got {given!r}")
            return tuple(items)
        return v

    @field_validator("tls_cert", "tls_key", "tls_ca", "token_file", "config")
    @classmethod
    def _readable(cls, v: Path | None) -> Path | None:
        if v is None:
            return None
        if not v.is_file():
            raise ValueError(f"file {str(v)!r} does not exist or is not a file")
        if not os.access(v, os.R_OK):
            raise ValueError(f"file {str(v)!r} is not readable")
        return v

    @model_validator(mode="after")
    def _together(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "tls_key" if self.tls_key is None else "tls_cert"
            raise _SettingError(missing, "--tls-cert and --tls-key enable TLS together; only one is set")
        if self.tls_ca is not None and self.tls_cert is None:
            raise _SettingError("tls_ca", "--tls-ca needs --tls-cert and --tls-key (TLS on the peer API)")
        if self.tls_server_name is not None and self.tls_cert is None:
            raise _SettingError(
                "tls_server_name", "--tls-server-name needs --tls-cert and --tls-key (TLS on the peer API)"
            )
        if not self.local_socket and not self.local_listen:
            raise _SettingError("local_socket", "the local API needs --local-socket or --local-listen")
        if self.token_file is not None and not self.token_file.read_text().strip():
            raise _SettingError("token_file", f"file {str(self.token_file)!r} is empty")
        if self.metrics_auth == "token" and self.token_file is None:
            raise _SettingError("metrics_auth", "token needs --token-file (the token /metrics asks for)")
        self._refuse_open_listeners()
        return self

    def _refuse_open_listeners(self) -> None:
        """Secure by default: an API reachable from other hosts needs credentials or --insecure.

        Whoever can call the peer API without credentials gets the data-plane metadata (and, on the
        same host, CUDA IPC handles) from a Handshake, and with it one-sided READ access to every
        registered byte; the local API registers memory and drains the sidecar. TLS protects only
        the peer API (the local API is plaintext), so the local API's TCP listener needs the token.
        TLS without ``--tls-ca`` encrypts but lets any client in, so it does not count.
        """
        if self.insecure:
            return
        if not self.peers_authenticated and not is_loopback_host(self.peer_host_port[0]):
            tls = " (TLS without --tls-ca checks no client certificate)" if self.tls_enabled else ""
            raise _SettingError(
                "peer_listen",
                f"{self.peer_listen!r} is not a loopback address and neither --token-file nor mutual TLS "
                f"(--tls-cert/--tls-key with --tls-ca) is set{tls}: anyone who reaches that port could handshake "
                "and read every registered KV byte. Set --token-file or mutual TLS, listen on 127.0.0.1, or pass "
                "--insecure true (KVXFER_INSECURE=true) to accept that",
                reason=Reason.INSECURE_LISTEN,
            )
        host = self.open_data_plane_host()
        if host is not None:
            raise _SettingError(
                "backend",
                f"{self.backend!r} on {host} (the advertised host): its transfer engine tells anyone who reaches its "
                "ports the addresses of the registered memory and serves READs and WRITEs into it, with no token "
                "or certificate (--token-file and TLS protect only kvxfer's own APIs), so anyone on that network "
                "could read or overwrite every registered KV byte. Use --backend nixl, keep the sidecar on "
                "127.0.0.1, or pass --insecure true (KVXFER_INSECURE=true) on a network you trust",
                reason=Reason.INSECURE_LISTEN,
            )
        if self.local_listen and not self.token_file:
            host, _ = parse_address(self.local_listen, setting="local_listen")
            if not is_loopback_host(host):
                raise _SettingError(
                    "local_listen",
                    f"{self.local_listen!r} is not a loopback address and --token-file is not set: anyone who "
                    "reaches that port could register memory, pull into it or drain the sidecar (TLS does not "
                    "cover the local API). Set --token-file, listen on 127.0.0.1, or pass --insecure true "
                    "(KVXFER_INSECURE=true) to accept that",
                    reason=Reason.INSECURE_LISTEN,
                )

    def open_data_plane_host(self) -> str | None:
        """The non-loopback host on which this backend's library serves the registered memory to callers
        without credentials (``Transport.serves_memory_openly``), or None. A backend that cannot be
        loaded is refused later, at start; the host is worked out only for a backend that serves openly."""
        try:
            if not transport_class(self.backend).serves_memory_openly:
                return None
        except KvxferError:
            return None
        host = self.transport_config().listen_host
        return None if is_loopback_host(host) else host

    @property
    def metrics_token(self) -> str | None:
        """The token /metrics asks for (``--metrics-auth``, by default token when a token is set), or None."""
        if self.metrics_auth == "none":
            return None
        return self.token()

    # ------------------------------------------------------------------ derived values
    @property
    def peer_host_port(self) -> tuple[str, int]:
        """(host, port) of ``peer_listen``."""
        return parse_address(self.peer_listen, setting="peer_listen")

    def advertise_address(self, bound_port: int | None = None) -> str:
        """``host:port`` that peers dial: ``advertise_host`` or the listen host, and the bound port."""
        host, port = self.peer_host_port
        if self.advertise_host:
            host = self.advertise_host
        elif host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        port = bound_port if bound_port is not None else port
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def transport_config(self) -> TransportConfig:
        """The data-plane settings as :func:`kvxfer.transport.create_transport` takes them (same names)."""
        host = self.advertise_address(0).rsplit(":", 1)[0].strip("[]")
        return TransportConfig(
            nixl_backends=self.nixl_backends, listen_host=host, data_port=self.data_port,
            mooncake_protocol=self.mooncake_protocol, mooncake_device=self.mooncake_device,
            cuda_ipc_direct=self.cuda_ipc_direct, cuda_gather=self.cuda_gather,
            nixl_progress_delay_us=self.nixl_progress_delay_us, nixl_thread_post_bytes=self.nixl_thread_post_bytes,
            fence_budget_s=self.fence_budget_seconds,
        )  # fmt: skip

    def token(self) -> str | None:
        """The shared token (read from ``token_file``), or None when auth is off. Never log it."""
        return self.token_file.read_text().strip() if self.token_file is not None else None

    @property
    def tls_enabled(self) -> bool:
        """True when the peer API serves TLS."""
        return self.tls_cert is not None and self.tls_key is not None

    @property
    def peers_authenticated(self) -> bool:
        """True when a peer must prove itself before any peer call: the shared token or mutual TLS."""
        return self.token_file is not None or (self.tls_enabled and self.tls_ca is not None)

    def redacted(self) -> dict[str, Any]:
        """Settings as a JSON-able dict for the start-up log (the token file's path, never its contents)."""
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.model_dump().items()}


class _SettingError(ValueError):
    """Raised inside model validation to name the setting a cross-field check blames (and why)."""

    def __init__(self, setting: str, message: str, *, reason: Reason = Reason.INVALID_FIELD) -> None:
        super().__init__(message)
        self.setting = setting
        self.reason = reason


def _address_or_raise(v: str) -> None:
    try:
        parse_address(v)
    except ConfigError as exc:
        raise ValueError(exc.message.removeprefix("address: ")) from None


# ---------------------------------------------------------------------------- files
def read_config_file(path: Path) -> dict[str, Any]:
    """Read a JSON or YAML settings file into a flat dict with underscore keys."""
    text = path.read_text()
    data: Any
    if path.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config: {path}: not valid JSON: {exc}", field="config") from None
    else:
        data = _load_yaml(text, path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path}: the top level must be a mapping of settings", field="config")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _load_yaml(text: str, path: Path) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # PyYAML's own text spans lines (it quotes the line and draws a caret): one line, as every error here.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise ConfigError(f"config: {path}: not valid YAML{where}: {what}", field="config") from None


# ---------------------------------------------------------------------------- merging
def load_settings(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Merge flags (None values mean "not given"), ``KVXFER_*`` env, the ``--config`` file and defaults.

    Raises :class:`ConfigError` naming every unknown setting or bad value with where it came from.
    """
    env = os.environ if env is None else env
    fields = set(Settings.model_fields)
    given_flags = {k.replace("-", "_"): v for k, v in (flags or {}).items() if v is not None}
    unknown_flags = sorted(set(given_flags) - fields)
    if unknown_flags:
        raise ConfigError(f"{flag_name(unknown_flags[0])}: unknown setting", field=unknown_flags[0])
    from_env = {f: env[env_name(f)] for f in fields if env_name(f) in env}
    config_path = given_flags.get("config") or from_env.get("config")
    from_file: dict[str, Any] = {}
    if config_path:
        path = Path(str(config_path))
        if not path.is_file():
            where = "--config" if "config" in given_flags else env_name("config")
            raise ConfigError(f"{where}: file {str(path)!r} does not exist", field="config")
        from_file = read_config_file(path)
        unknown = sorted(set(from_file) - fields)
        if unknown:
            known = ", ".join(sorted(fields))
            raise ConfigError(
                f"config: {path}: unknown setting {unknown[0]!r}" + (f" (and {unknown[1:]})" if unknown[1:] else "")
                + f"; known settings: {known}",
                field=unknown[0],
            )  # fmt: skip
        from_file.pop("config", None)
    merged: dict[str, Any] = {**from_file, **from_env, **given_flags}
    source = {k: "file" for k in from_file} | {k: "env" for k in from_env} | {k: "flag" for k in given_flags}
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        raise _config_error(exc, merged, source, config_path) from None
    except _SettingError as exc:
        raise ConfigError(
            f"{_where(exc.setting, source, config_path)}: {exc}", field=exc.setting, reason=exc.reason
        ) from None


def _where(field: str, source: Mapping[str, str], config_path: Any) -> str:
    src = source.get(field, "default")
    if src == "flag":
        return flag_name(field)
    if src == "env":
        return env_name(field)
    if src == "file":
        return f"{field} (in {config_path})"
    return flag_name(field)


def _config_error(
    exc: ValidationError, merged: Mapping[str, Any], source: Mapping[str, str], config_path: Any
) -> ConfigError:
    parts: list[str] = []
    first: str | None = None
    reason: Reason | None = None
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        ctx = err.get("ctx") or {}
        if not field and isinstance(ctx.get("error"), _SettingError):
            field = ctx["error"].setting
            reason = reason or ctx["error"].reason
        msg = str(ctx["error"]) if isinstance(ctx.get("error"), Exception) else err["msg"]
        msg = msg.removeprefix("Value error, ")
        first = first or field
        # kvxfer's own checks (value_error) name the value; pydantic's built-in ones do not.
        value = f" (got {merged[field]!r})" if field in merged and err["type"] != "value_error" else ""
        parts.append(f"{_where(field, source, config_path)}: {msg}{value}")
    return ConfigError("; ".join(parts), field=first, reason=reason)

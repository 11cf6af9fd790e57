"""Who is calling on the peer API, from its credentials, never from what it says about itself.

* **Mutual TLS, engine certificates**: a client certificate that carries URI subject alternative
  names ``kvxfer://engine/<engine id>`` lets its holder act only as those engines. A certificate
  for ``decode-0`` cannot handshake as ``decode-1``, fetch ``decode-1``'s publishes, or free them
  (PERMISSION_DENIED, reason IDENTITY). cert-manager issues such names with ``uris:``; one
  certificate per vLLM instance (its ranks share the engine id).
* **Mutual TLS, a cluster certificate** (no ``kvxfer://engine/`` name, e.g. one Secret shared by
  every pod), **or the shared token**: the credential proves membership of the cluster, nothing
  more. Any holder may claim any engine id; publishes are still bound to one reader engine
  (:mod:`kvxfer.server.publisher`).
* **Neither**: the sidecar listens on loopback only (``--insecure`` overrides), and every local
  process is trusted.

See docs/security.md for the threat model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import PermissionDeniedError, Reason

__all__ = ["ANONYMOUS", "ENGINE_URI_PREFIX", "URIS_PROPERTY", "PeerCredentials"]

#: URI SAN prefix naming an engine a certificate's holder may act as.
ENGINE_URI_PREFIX = "kvxfer://engine/"
URIS_PROPERTY = "peer_uri"  # gRPC's auth-context property: the certificate's URI SANs


@dataclass(frozen=True)
class PeerCredentials:
    """The engine ids a caller's credentials allow it to act as (None: no certificate, any id)."""

    names: frozenset[str] | None = None

    @classmethod
    def from_auth_context(cls, auth: Mapping[str, Sequence[bytes]]) -> PeerCredentials:
        """From a call's ``auth_context()``: the engines its certificate names (none named: any)."""
        uris = (v.decode(errors="replace") for v in auth.get(URIS_PROPERTY, ()))
        names = [u.removeprefix(ENGINE_URI_PREFIX) for u in uris if u.startswith(ENGINE_URI_PREFIX)]
        return cls(frozenset(names)) if names else ANONYMOUS

    @classmethod
    def of(cls, context: Any) -> PeerCredentials:
        """The credentials of a gRPC call (a ``grpc.aio.ServicerContext``)."""
        return cls.from_auth_context(context.auth_context() or {})

    @property
    def certified(self) -> bool:
        """True when the caller's certificate names the engines it may act as."""
        return self.names is not None

    def check(self, engine_id: str, field: str) -> None:
        """Refuse (PERMISSION_DENIED) a claimed engine id the certificate does not name."""
        if self.names is None or engine_id in self.names:
            return
        raise PermissionDeniedError(
            f"{field}: engine id {engine_id!r} is not named by the caller's client certificate (it names "
            f"{', '.join(ENGINE_URI_PREFIX + n for n in sorted(self.names))}); a peer acts only as an engine its "
            "certificate names",
            field=field, reason=Reason.IDENTITY,
        )  # fmt: skip


ANONYMOUS = PeerCredentials()

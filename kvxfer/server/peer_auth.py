"""Who is calling on the peer API, from its credentials, never from what it says about itself.

* **Mutual TLS** (``--tls-ca`` set, so gRPC requires a client certificate signed by that CA): a
  peer may only act as an engine id its certificate names: one of its DNS subject alternative
  names, or its subject common name when it has no DNS SAN. A certificate for ``decode-0`` cannot
  handshake as ``decode-1``, fetch ``decode-1``'s publishes, or free them.
* **Shared token only**: the token proves membership of the cluster, nothing more. Any holder may
  claim any engine id; publishes are still bound to the first reader that touches them
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

__all__ = ["ANONYMOUS", "PeerCredentials"]

_SAN = "x509_subject_alternative_name"
_CN = "x509_common_name"


@dataclass(frozen=True)
class PeerCredentials:
    """The engine ids a caller's credentials allow it to act as (None: no certificate, any id)."""

    names: frozenset[str] | None = None

    @classmethod
    def from_auth_context(cls, auth: Mapping[str, Sequence[bytes]]) -> PeerCredentials:
        """From a call's ``auth_context()``: DNS SANs of the client certificate, else its CN."""
        sans = [v.decode(errors="replace") for v in auth.get(_SAN, ())]
        names = sans or [v.decode(errors="replace") for v in auth.get(_CN, ())]
        return cls(frozenset(names)) if names else ANONYMOUS

    @classmethod
    def of(cls, context: Any) -> PeerCredentials:
        """The credentials of a gRPC call (a ``grpc.aio.ServicerContext``)."""
        return cls.from_auth_context(context.auth_context() or {})

    @property
    def certified(self) -> bool:
        """True when a client certificate names who the caller is."""
        return self.names is not None

    def check(self, engine_id: str, field: str) -> None:
        """Refuse (PERMISSION_DENIED) a claimed engine id the certificate does not name."""
        if self.names is None or engine_id in self.names:
            return
        raise PermissionDeniedError(
            f"{field}: engine id {engine_id!r} is not named by the caller's client certificate (it names "
            f"{', '.join(sorted(self.names)) or 'nothing'}); a peer acts only as an engine its certificate names",
            field=field, reason=Reason.IDENTITY,
        )  # fmt: skip


ANONYMOUS = PeerCredentials()

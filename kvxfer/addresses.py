"""TCP addresses as settings and peers give them: ``host:port`` parsing and the checks on its parts.

A listen address may use the wildcard host and port 0; an address to dial may not. Every problem
raises :class:`kvxfer.errors.ConfigError` naming the setting and the text it came from. Whether a
host is loopback is decided from the text alone, never by resolving a name.
"""

from __future__ import annotations

import ipaddress
import re

from kvxfer.errors import ConfigError

__all__ = ["WILDCARD_HOSTS", "check_host", "is_loopback_host", "parse_address"]

_HOSTPORT = re.compile(r"^(?:\[(?P<v6>[^\]]*)\]|(?P<host>[^:\[\]]*)):(?P<port>[^:]*)$")
_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
#: Hosts that mean "every interface" to a listener; nobody can dial them.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def check_host(host: str, *, setting: str, value: str | None = None) -> str:
    """A host name, an IPv4 address or an IPv6 address (without brackets); raises :class:`ConfigError`.

    ``value`` is the whole text the host came from, for the message (default: the host itself).
    """
    shown = repr(value if value is not None else host)
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{setting}: {host!r} in {shown} is not an IPv6 address", field=setting) from None
        return host
    if host and all(c.isdigit() or c == "." for c in host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ConfigError(f"{setting}: {host!r} in {shown} is not an IPv4 address", field=setting) from None
        return host
    if len(host) > 253 or not all(_LABEL.match(label) for label in host.split(".")):
        raise ConfigError(
            f"{setting}: {host!r} in {shown} is not a host name (letters, digits, '-' and '_' in dot-separated "
            "labels of 1-63 characters) or an IP address",
            field=setting,
        )
    return host


def parse_address(value: str, *, setting: str = "address", dial: bool = False) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) and check both parts; raises :class:`ConfigError`.

    A listen address (the default) may leave the host empty (every interface) and use port 0 (the
    system picks a free port). An address to ``dial`` (a peer's) needs a host that is not a
    wildcard, a port in [1, 65535], and no surrounding spaces: the address is used exactly as given.
    """
    text = value if dial else value.strip()
    lowest = 1 if dial else 0
    if "/" in text:
        raise ConfigError(
            f"{setting}: {value!r} is a path or URL; this is a TCP address, host:port (no scheme)", field=setting
        )
    m = _HOSTPORT.match(text)
    if not m:
        raise ConfigError(f"{setting}: {value!r} is not host:port (use [addr]:port for IPv6)", field=setting)
    raw_port = m.group("port")
    if not raw_port.isascii() or not raw_port.isdigit():
        what = "has no port" if not raw_port else f"has port {raw_port!r}, not a number"
        raise ConfigError(f"{setting}: {value!r} {what} (host:port, port in [{lowest}, 65535])", field=setting)
    port = int(raw_port)
    if port > 65535:
        raise ConfigError(f"{setting}: port {port} in {value!r} is not in [{lowest}, 65535]", field=setting)
    v6 = m.group("v6")
    host = v6 if v6 is not None else m.group("host")
    if v6 is not None and not v6:
        raise ConfigError(f"{setting}: {value!r} has empty brackets where the IPv6 address goes", field=setting)
    if host:
        check_host(host, setting=setting, value=value)
    if dial:
        if port == 0:
            raise ConfigError(
                f"{setting}: port 0 in {value!r} cannot be dialled (0 only means 'any free port' to a listener); "
                "give the port the peer listens on, in [1, 65535]",
                field=setting,
            )
        if host in WILDCARD_HOSTS:
            why = "has no host" if not host else f"names the wildcard host {host!r}, which only a listener can use"
            raise ConfigError(f"{setting}: {value!r} {why}; give the host name or IP peers reach", field=setting)
    return host or "0.0.0.0", port


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1, ::ffff:127.x.y.z).

    Any other name counts as reachable from elsewhere: what a hostname resolves to can change
    after start-up, so it is never resolved here.
    """
    h = host.strip().strip("[]").lower().rstrip(".")
    if h == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback

"""Peer addresses: the one check of an address that a request, a registration or a config names before anything
dials it or waits on it (``check_address``). Accepted: ``host:port`` (a host name, an IPv4 address or a bracketed
IPv6 one; port 1..65535), the same behind gRPC's ``dns:``/``ipv4:``/``ipv6:`` schemes, and ``unix:`` socket paths.
Anything else is an InvalidRequest naming the field. Standard library only.
"""

from __future__ import annotations

import ipaddress
import re

from rlfleet.errors import InvalidRequest

MAX_ADDRESS_CHARS = 512
_HOST_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


def check_address(address: str, name: str) -> str:
    """``address`` if it is a peer address (above), else InvalidRequest naming ``name``; -> ``address``."""
    shown = repr(address[:60]) + ("..." if len(address) > 60 else "")
    if not address:
        raise InvalidRequest(f"{name}: empty address")
    if len(address) > MAX_ADDRESS_CHARS:
        raise InvalidRequest(f"{name}: {len(address)} characters; an address has at most {MAX_ADDRESS_CHARS}")
    if address.startswith(("unix:", "unix-abstract:")):
        path = address.split(":", 1)[1]
        if not path:
            raise InvalidRequest(f"{name}: {shown} names no socket path")
        if any(c.isspace() or not c.isprintable() for c in path):
            raise InvalidRequest(f"{name}: {shown} is not a socket path")
        return address
    target = address
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme) :]
            if scheme == "dns:" and target.startswith("//"):
                target = target[2:].split("/", 1)[-1]  # dns://authority/host:port
            break
    host, sep, port = target.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise InvalidRequest(f"{name}: {shown} is not an address (host:port with a port in 1..65535)")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise InvalidRequest(f"{name}: {shown} does not bracket an IPv6 address") from None
        return address
    if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in host.split(".")):
        raise InvalidRequest(f"{name}: {shown}: {host[:80]!r} is not a host name, IPv4 or [IPv6] address")
    return address

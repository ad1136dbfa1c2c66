"""Each service's client, in shared code: the env side (rollout worker) talks to inference and learner through
these modules, so the env side depends on ``rlfleet`` only, never on another service's package."""

from __future__ import annotations

import re

_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")
MAX_ADDRESS_CHARS = 512


def check_address(address: str, name: str) -> str:
    """A peer address a request names (``host:port``, ``[v6]:port``, ``dns:``/``ipv4:``/``ipv6:`` targets,
    ``unix:`` paths): refused with InvalidRequest naming ``name`` when it cannot be one, before anything waits on
    it."""
    from rlfleet.wire.rpc import InvalidRequest

    shown = repr(address[:60]) + ("..." if len(address) > 60 else "")
    if not address:
        raise InvalidRequest(f"{name}: empty address")
    if len(address) > MAX_ADDRESS_CHARS or any(c.isspace() or not c.isprintable() for c in address):
        raise InvalidRequest(f"{name}: {shown} is not an address (host:port)")
    if address.startswith(("unix:", "unix-abstract:")):
        if address.split(":", 1)[1]:
            return address
        raise InvalidRequest(f"{name}: {shown} names no socket path")
    target = address
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            if scheme == "dns:" and target.startswith("//"):
                target = target[2:].split("/", 1)[-1]  # dns://authority/host:port
            break
    m = _HOST_PORT.match(target)
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise InvalidRequest(f"{name}: {shown} is not an address (host:port, port 1..65535)")
    return address

"""This process's TLS material (``cluster.tls``): set once at start-up (:func:`configure_tls`), then every server
it binds (:mod:`rlfleet.wire.servers`) and every run channel it opens (:mod:`rlfleet.wire.channels`) use it. None
configured: plaintext."""

from __future__ import annotations

import grpc

_tls: dict | None = None  # this process's TLS material (configure_tls), None = plaintext


def configure_tls(tls_cfg) -> None:
    """Turn on TLS for every server this process binds and every run channel it opens (``cluster.tls``)."""
    global _tls
    if not tls_cfg or not tls_cfg.cert_file:
        _tls = None
        return
    read = lambda p: open(p, "rb").read()  # noqa: E731
    _tls = {
        "cert": read(tls_cfg.cert_file),
        "key": read(tls_cfg.key_file),
        "ca": read(tls_cfg.ca_file),
        "client_auth": bool(tls_cfg.client_auth),
    }


def server_credentials() -> grpc.ServerCredentials | None:
    """What a server binds its port with (None: plaintext)."""
    if _tls is None:
        return None
    return grpc.ssl_server_credentials(
        [(_tls["key"], _tls["cert"])], root_certificates=_tls["ca"], require_client_auth=_tls["client_auth"]
    )


def channel_credentials() -> grpc.ChannelCredentials | None:
    """What a run channel connects with (None: plaintext); with client auth, this process's certificate too."""
    if _tls is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_tls["ca"],
        private_key=_tls["key"] if _tls["client_auth"] else None,
        certificate_chain=_tls["cert"] if _tls["client_auth"] else None,
    )

"""The client side of every call: the channels rlfleet opens (:func:`channel`, :func:`wait_ready`), each with one
interceptor that adds the run credential (:func:`rlfleet.wire.callers.call_metadata`) and, when tracing is set up
by the time the channel is made (:mod:`rlfleet.wire.tracing`), the caller's W3C trace context to every call; TLS
when this process configured it (:mod:`rlfleet.wire.tls`); and a failed call in one line (:func:`describe_error`)."""

from __future__ import annotations

import grpc
from opentelemetry import propagate

from rlfleet.wire import tls, tracing
from rlfleet.wire.callers import call_metadata
from rlfleet.wire.limits import MAX_MESSAGE_BYTES

OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
        self.metadata = metadata


class _ClientMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the run credential (``credential``) and the caller's trace context (``traced``) to every call."""

    def __init__(self, credential: bool, traced: bool):
        self.credential, self.traced = credential, traced

    def _details(self, details):
        md = list(details.metadata or ())
        if self.credential:
            md += call_metadata(details.method)
        if self.traced:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            md += carrier.items()
        return _CallDetails(details, md)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def channel(address: str, *, credential: bool = True) -> grpc.Channel:
    """A channel whose calls carry this process's run credential and (when tracing is set up by now) trace
    context, over TLS when configured (``credential=False``: a peer outside the run, such as an external simulator:
    plaintext, no token)."""
    creds = tls.channel_credentials() if credential else None
    if creds is not None:
        raw = grpc.secure_channel(address, creds, options=OPTIONS)
    else:
        raw = grpc.insecure_channel(address, options=OPTIONS)
    return grpc.intercept_channel(raw, _ClientMetadata(credential, tracing.enabled()))


def wait_ready(address: str, timeout: float = 30.0, *, credential: bool = True) -> grpc.Channel:
    """A channel to ``address`` once a server answers there (TimeoutError after ``timeout`` seconds)."""
    ch = channel(address, credential=credential)
    try:
        grpc.channel_ready_future(ch).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        ch.close()
        raise TimeoutError(f"no gRPC server answered at {address} within {timeout:.0f}s") from None
    return ch


def describe_error(exc: grpc.RpcError) -> str:
    """A failed call in one line: its status code's name and the details."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'ERROR'}: {details}"

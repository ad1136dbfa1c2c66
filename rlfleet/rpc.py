"""gRPC helpers shared by every service: server/channel construction, error mapping, readiness waits, and the
interceptors every server and channel carries (the run credential of :mod:`rlfleet.auth`, trace context of
:mod:`rlfleet.tracing`), plus gRPC health checking and reflection on every server."""

from __future__ import annotations

import functools
import inspect
import logging
import time
from concurrent import futures

import grpc

from rlfleet import auth
from rlfleet.codec import CodecError

log = logging.getLogger("rlfleet.rpc")

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


class InvalidRequest(ValueError):
    """A request that is well-formed protobuf but wrong for this service (unknown id, wrong size...)."""


class FailedPrecondition(RuntimeError):
    """A request that cannot be served in the service's current state."""


class ResourceExhausted(RuntimeError):
    """The service is at a limit it declares (e.g. concurrent streams); retry later or close something first."""


class Unavailable(RuntimeError):
    """The service is up but cannot serve this now (a part it needs is being rebuilt); retry shortly."""


class Cancelled(RuntimeError):
    """The work stopped early because the caller went away or its deadline was about to pass."""


def _abort_for(context: grpc.ServicerContext, exc: BaseException, method: str):
    if isinstance(exc, (CodecError, InvalidRequest)):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, FailedPrecondition):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    if isinstance(exc, ResourceExhausted):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, Cancelled):
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
    if isinstance(exc, Unavailable):
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    log.exception("%s failed", method)
    context.abort(grpc.StatusCode.INTERNAL, f"{method}: {type(exc).__name__}: {exc}")


def handler(fn):
    """Decorate a servicer method: bad input -> INVALID_ARGUMENT naming the field; bugs -> INTERNAL.

    The server process never dies because of a request. Works for unary and streaming-response methods.
    """
    name = fn.__qualname__
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen_wrapper(self, request, context):
            try:
                yield from fn(self, request, context)
            except grpc.RpcError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status code
                if context.is_active():
                    _abort_for(context, exc, name)
        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as exc:  # noqa: BLE001
            _abort_for(context, exc, name)
    return wrapper


class _Refuse:
    """Method handlers that abort at once with the auth error (same streaming shape as the real method)."""

    @staticmethod
    def handler(real, code: str, message: str):
        status = getattr(grpc.StatusCode, code)

        def abort_unary(request, context):
            context.abort(status, message)

        def abort_stream(request_or_iterator, context):
            context.abort(status, message)
            yield  # pragma: no cover - abort raises

        if real is None:
            return None
        if real.request_streaming and real.response_streaming:
            return grpc.stream_stream_rpc_method_handler(abort_stream, real.request_deserializer,
                                                         real.response_serializer)
        if real.request_streaming:
            return grpc.stream_unary_rpc_method_handler(abort_unary, real.request_deserializer,
                                                        real.response_serializer)
        if real.response_streaming:
            return grpc.unary_stream_rpc_method_handler(abort_stream, real.request_deserializer,
                                                        real.response_serializer)
        return grpc.unary_unary_rpc_method_handler(abort_unary, real.request_deserializer, real.response_serializer)


class _ServerAuth(grpc.ServerInterceptor):
    """Every call must carry the run's token (and an owning role for state-changing methods)."""

    def intercept_service(self, continuation, handler_call_details):
        try:
            auth.check(handler_call_details.method, handler_call_details.invocation_metadata)
        except auth.AuthError as exc:
            code, message = exc.args
            log.warning("refused %s: %s", handler_call_details.method, message)
            return _Refuse.handler(continuation(handler_call_details), code, message)
        return continuation(handler_call_details)


def make_server(max_workers: int = 32, max_concurrent_rpcs: int | None = None) -> grpc.Server:
    """A gRPC server whose pool has ``max_workers`` threads (a streaming RPC holds one for its whole life); with
    ``max_concurrent_rpcs``, calls beyond it are refused with RESOURCE_EXHAUSTED instead of queueing unserved.
    Calls are checked against the run credential (rlfleet.auth) and carry trace context (rlfleet.tracing)."""
    from rlfleet import tracing

    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                       options=OPTIONS, maximum_concurrent_rpcs=max_concurrent_rpcs,
                       interceptors=[_ServerAuth(), tracing.ServerInterceptor()])


def add_health_and_reflection(server: grpc.Server, *service_names: str):
    """grpc.health.v1 (every name SERVING, and "" for the whole server) and server reflection listing
    ``service_names``; returns the health servicer (``set(name, NOT_SERVING)`` when shutting down)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *service_names):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return servicer


def service_name(pb2_module, service: str) -> str:
    """The full gRPC name of ``service`` in a generated module (e.g. 'rlfleet.v1.EnvService')."""
    return pb2_module.DESCRIPTOR.services_by_name[service].full_name


_tls: dict | None = None  # this process's TLS material (configure_tls), None = plaintext


def configure_tls(tls_cfg) -> None:
    """Turn on TLS for every server this process binds and every run channel it opens (``cluster.tls``)."""
    global _tls
    if not tls_cfg or not tls_cfg.cert_file:
        _tls = None
        return
    read = lambda p: open(p, "rb").read()  # noqa: E731
    _tls = {"cert": read(tls_cfg.cert_file), "key": read(tls_cfg.key_file), "ca": read(tls_cfg.ca_file),
            "client_auth": bool(tls_cfg.client_auth)}


def bind(server: grpc.Server, address: str) -> str:
    """Bind a port (TLS when configured); returns the address actually bound (port 0 -> the chosen port)."""
    host, _, port = address.rpartition(":")
    if _tls is not None:
        creds = grpc.ssl_server_credentials([(_tls["key"], _tls["cert"])], root_certificates=_tls["ca"],
                                            require_client_auth=_tls["client_auth"])
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    return f"{host}:{bound}" if int(port or 0) == 0 else address


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
        self.metadata = metadata


class _ClientMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                      grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the run credential and the caller's trace context to every call."""

    def __init__(self, credential: bool):
        self.credential = credential

    def _details(self, details):
        from rlfleet import tracing

        md = list(details.metadata or ())
        if self.credential:
            md += auth.call_metadata()
        md += tracing.inject()
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
    """A channel whose calls carry this process's run credential and trace context, over TLS when configured
    (``credential=False``: a peer outside the run, such as an external simulator: plaintext, no token)."""
    if _tls is not None and credential:
        creds = grpc.ssl_channel_credentials(
            root_certificates=_tls["ca"], private_key=_tls["key"] if _tls["client_auth"] else None,
            certificate_chain=_tls["cert"] if _tls["client_auth"] else None)
        raw = grpc.secure_channel(address, creds, options=OPTIONS)
    else:
        raw = grpc.insecure_channel(address, options=OPTIONS)
    return grpc.intercept_channel(raw, _ClientMetadata(credential))


def wait_ready(address: str, timeout: float = 30.0, *, credential: bool = True) -> grpc.Channel:
    ch = channel(address, credential=credential)
    try:
        grpc.channel_ready_future(ch).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        ch.close()
        raise TimeoutError(f"no gRPC server answered at {address} within {timeout:.0f}s") from None
    return ch


def describe_error(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'ERROR'}: {details}"


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

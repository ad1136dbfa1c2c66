"""The servers rlfleet runs: construction (:func:`make_server`, its port with TLS when configured: :func:`bind`),
gRPC health checking and reflection on every server, and the one interceptor every server carries
(``_ServerGuard``), which runs on the server's polling thread before a call waits for a pool thread:

- the caller's credential is checked (:func:`rlfleet.wire.callers.check_caller`); a refused call is answered at
  once, its request bytes never parsed, and logged at most so often;
- reflection streams (open without the credential) take one of a few slots of their own and are closed when idle
  (:class:`rlfleet.wire.streams.StreamSlots`);
- request bytes that are not the method's message are INVALID_ARGUMENT naming it (gRPC itself answers INTERNAL);
- when tracing is set up by the time the server is made (:mod:`rlfleet.wire.tracing`), each call is served in a
  SERVER span named by its method, child of the caller's trace context.

What a servicer method's exception is answered with is :mod:`rlfleet.wire.status`'s."""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from rlfleet.errors import AuthError, InvalidRequest, ResourceExhausted
from rlfleet.wire import status, tls, tracing
from rlfleet.wire.callers import REFLECTION_PREFIXES, check_caller
from rlfleet.wire.limits import MAX_MESSAGE_BYTES
from rlfleet.wire.streams import StreamSlots

log = logging.getLogger("rlfleet.wire.servers")
_tracer = trace.get_tracer("rlfleet")  # OTel's proxy until tracing.setup installs the SDK's provider

# Streams that carry no work (server reflection: open without the credential, one per `grpcurl` command) get a
# few slots of their own and are closed when idle, and every server's pool has RESERVED_THREADS more threads than
# its service asks for: reflection and quick refusals never take the threads the run's calls need.
OPEN_STREAMS = 4  # concurrent reflection streams per server; more: RESOURCE_EXHAUSTED
OPEN_STREAM_IDLE_S = 10.0  # a reflection stream that waits this long for its next request is closed
OPEN_STREAM_RECLAIM_S = 1.0  # with every slot taken, one idle this long makes room for a newcomer
RESERVED_THREADS = OPEN_STREAMS + 4


class _Unparsable:
    """What a request's bytes became when they are not the method's message."""

    def __init__(self, exc: Exception):
        self.exc = exc


def _message_name(deserializer) -> str:
    owner = getattr(deserializer, "__self__", None)
    return getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "request message")


class _Handlers:
    """Method handlers derived from a real one (same streaming shape)."""

    @staticmethod
    def build(real, behavior, request_deserializer, response_serializer):
        if real.request_streaming and real.response_streaming:
            return grpc.stream_stream_rpc_method_handler(behavior, request_deserializer, response_serializer)
        if real.request_streaming:
            return grpc.stream_unary_rpc_method_handler(behavior, request_deserializer, response_serializer)
        if real.response_streaming:
            return grpc.unary_stream_rpc_method_handler(behavior, request_deserializer, response_serializer)
        return grpc.unary_unary_rpc_method_handler(behavior, request_deserializer, response_serializer)

    @staticmethod
    def behavior(real):
        return real.stream_stream or real.stream_unary or real.unary_stream or real.unary_unary

    @classmethod
    def refuse(cls, real, error: AuthError):
        """Abort at once with the auth error; the request's bytes are never parsed (garbage gets the same
        answer as a well-formed request)."""
        code, message = status.code_of(error), error.args[1]

        def abort_unary(request_or_iterator, context):
            context.abort(code, message)

        def abort_stream(request_or_iterator, context):
            context.abort(code, message)
            yield  # pragma: no cover - abort raises

        if real is None:
            return None
        return cls.build(real, abort_stream if real.response_streaming else abort_unary, None, real.response_serializer)

    @classmethod
    def lenient(cls, real):
        """Bytes that are not the method's message: INVALID_ARGUMENT naming it (gRPC itself answers INTERNAL)."""
        parse, name = real.request_deserializer, _message_name(real.request_deserializer)
        if parse is None:
            return real
        inner = cls.behavior(real)

        def tolerant(data):
            try:
                return parse(data)
            except Exception as exc:  # noqa: BLE001 - DecodeError and kin
                return _Unparsable(exc)

        def why(bad: _Unparsable) -> str:
            return f"request: not a valid {name} ({type(bad.exc).__name__}: {str(bad.exc)[:200]})"

        if real.request_streaming:

            def checked(requests):
                for r in requests:
                    if isinstance(r, _Unparsable):
                        raise InvalidRequest(why(r))
                    yield r

            def behavior(requests, context):
                return inner(checked(requests), context)
        else:

            def behavior(request, context):
                if isinstance(request, _Unparsable):
                    status.abort_for(context, InvalidRequest(why(request)), name)
                return inner(request, context)

        return cls.build(real, behavior, tolerant, real.response_serializer)

    @classmethod
    def slotted(cls, real, slots: StreamSlots):
        """A request stream that takes one of ``slots`` for its life (reflection)."""
        if real is None or not real.request_streaming:
            return real
        inner = cls.behavior(real)

        def behavior(requests, context):
            try:
                stream = slots.admit(requests, context)
            except ResourceExhausted as exc:
                status.abort_for(context, exc, "reflection")
            try:
                yield from inner(stream, context)
            finally:
                slots.leave(stream)

        if not real.response_streaming:
            return real  # no such open method today
        return cls.build(real, behavior, real.request_deserializer, real.response_serializer)

    @classmethod
    def traced(cls, real, method: str):
        """The call served inside a SERVER span named by the method (e.g. 'rlfleet.v1.LearnerService/Train'), in
        the caller's trace context (W3C ``traceparent`` in the metadata)."""
        inner, name = cls.behavior(real), method.lstrip("/")

        def caller_context(context):
            return otel_context.attach(propagate.extract({k: v for k, v in context.invocation_metadata()}))

        if real.response_streaming:

            def behavior(request, context):
                token = caller_context(context)
                try:
                    with _tracer.start_as_current_span(name, kind=trace.SpanKind.SERVER):
                        yield from inner(request, context)
                finally:
                    otel_context.detach(token)
        else:

            def behavior(request, context):
                token = caller_context(context)
                try:
                    with _tracer.start_as_current_span(name, kind=trace.SpanKind.SERVER):
                        return inner(request, context)
                finally:
                    otel_context.detach(token)

        return cls.build(real, behavior, real.request_deserializer, real.response_serializer)


class _RefusalLog:
    """The refused calls' log lines, at most ``burst`` per ``window_s`` (then one line counting the rest): a flood of
    refused calls costs its sender, not this process's log (or the pipe it writes to)."""

    def __init__(self, burst: int = 20, window_s: float = 10.0):
        self.burst, self.window_s = burst, window_s
        self._lock = threading.Lock()
        self._start, self._logged, self._dropped = -float("inf"), 0, 0

    def log(self, method: str, message: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._start >= self.window_s:
                if self._dropped:
                    log.warning(
                        "refused %d more calls in the last %.0fs (not logged one by one)",
                        self._dropped,
                        now - self._start,
                    )
                self._start, self._logged, self._dropped = now, 0, 0
            if self._logged >= self.burst:
                self._dropped += 1
                return
            self._logged += 1
        log.warning("refused %s: %s", method, message)


class _ServerGuard(grpc.ServerInterceptor):
    """Runs on the server's polling thread before a call is queued for the pool: the credential check (and
    ``on_call`` with the proven caller), reflection streams into their slots, request bytes parsed leniently, and
    (``traced``) the call served in a SERVER span in its caller's trace context."""

    def __init__(self, on_call=None, traced: bool = False):
        self.on_call, self.traced = on_call, traced
        self.refusals = _RefusalLog()
        self.reflection = StreamSlots(
            OPEN_STREAMS, "reflection", idle_close_s=OPEN_STREAM_IDLE_S, reclaim_idle_s=OPEN_STREAM_RECLAIM_S
        )

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(REFLECTION_PREFIXES):
            return _Handlers.slotted(continuation(handler_call_details), self.reflection)
        try:
            caller = check_caller(method, handler_call_details.invocation_metadata)
        except AuthError as exc:
            self.refusals.log(method, exc.args[1])
            return _Handlers.refuse(continuation(handler_call_details), exc)
        if caller is not None and self.on_call is not None:
            try:
                self.on_call(method, caller)
            except Exception:  # noqa: BLE001 - a hook must not break serving
                log.exception("on_call hook")
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if self.traced and not method.startswith("/grpc."):
            handler = _Handlers.traced(handler, method)
        return _Handlers.lenient(handler) if method.startswith("/rlfleet.") else handler


def make_server(
    max_workers: int = 32,
    max_concurrent_rpcs: int | None = None,
    *,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
    on_call=None,
) -> grpc.Server:
    """A gRPC server whose pool has ``max_workers`` threads for its services (a streaming RPC holds one for its
    whole life) plus RESERVED_THREADS for reflection streams and quick refusals; with ``max_concurrent_rpcs``,
    calls beyond it (plus the reserve) are refused with RESOURCE_EXHAUSTED instead of queueing unserved.
    Requests over ``max_receive_bytes`` are refused with RESOURCE_EXHAUSTED. Calls are checked against the run's
    credentials (:func:`check_caller`; ``on_call(method, caller)`` runs for each accepted call on the polling
    thread, before the call waits for a pool thread: it must be quick) and, when tracing is set up by now
    (rlfleet.wire.tracing), served in a SERVER span in their caller's trace context."""
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_receive_bytes),
    ]
    limit = None if max_concurrent_rpcs is None else max_concurrent_rpcs + RESERVED_THREADS
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers + RESERVED_THREADS, thread_name_prefix="grpc"),
        options=options,
        maximum_concurrent_rpcs=limit,
        interceptors=[_ServerGuard(on_call, traced=tracing.enabled())],
    )


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


def bind(server: grpc.Server, address: str) -> str:
    """Bind a port (TLS when configured); returns the address actually bound (port 0 -> the chosen port)."""
    host, _, port = address.rpartition(":")
    creds = tls.server_credentials()
    if creds is not None:
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    return f"{host}:{bound}" if int(port or 0) == 0 else address

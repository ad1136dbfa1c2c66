"""What every call passes through, and the gRPC helpers every service shares.

Every server made here carries one interceptor (``_ServerGuard``) and every channel one (``_ClientMetadata``); they
are the per-call part of the run's credentials and of tracing:

- credentials (the scheme, its keys, credentials and token files: :mod:`rlfleet.wire.auth`): a call carries the
  bearer for its callee's role and the caller's role and index (:func:`call_metadata`); the server proves the
  bearer with this process's verifier (the run's public issuing key: it checks signatures and makes none) before
  the call waits for a thread (:func:`check_caller`): no or a wrong credential is UNAUTHENTICATED, another role's
  or index's credential, a credential for another role's servers, or a role that does not own the method
  (``METHOD_ROLES``) PERMISSION_DENIED; health checks and reflection stay open (``OPEN_PREFIXES``).
  ``auth.set_identity`` hands this module the process's :class:`Identity` once, at start-up (none: nothing is sent
  or checked).
- trace context (providers and exporters: :mod:`rlfleet.wire.tracing`): when tracing is set up by the time a
  channel or server is made, its calls carry the caller's W3C trace context, and each call is served inside a
  SERVER span named by its method, child of the caller's context.

Plus server/channel construction, error mapping, readiness waits, gRPC health checking and reflection on every
server, and bounded request streams (:class:`StreamSlots`: reflection's, an env server's Step streams)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
import functools
import inspect
import logging
import threading
import time
import weakref
from concurrent import futures

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from rlfleet.wire import tracing
from rlfleet.wire.codec import CodecError

log = logging.getLogger("rlfleet.wire.rpc")
_tracer = trace.get_tracer("rlfleet")  # OTel's proxy until tracing.setup installs the SDK's provider

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


class PermissionDenied(RuntimeError):
    """A proven caller asking for something its role or index may not do (e.g. registering as another service)."""


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
    if isinstance(exc, PermissionDenied):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
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


def _end_stream(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End a call from another thread with a status (its handler, blocked on the next request, then returns)."""
    try:
        from grpc._common import STATUS_CODE_TO_CYGRPC_STATUS_CODE

        context._rpc_event.call.cancel(STATUS_CODE_TO_CYGRPC_STATUS_CODE[code], message)  # noqa: SLF001
    except Exception:  # noqa: BLE001 - another gRPC version: a plain cancel still frees the thread
        context.cancel()


class _Watched:
    """A stream's request iterator that knows since when its handler waits for the caller's next message."""

    def __init__(self, requests, context, slots: "StreamSlots"):
        self._requests, self.context, self.slots = requests, context, slots
        self.waiting_since: float | None = None
        self.closed: str | None = None

    def __iter__(self):
        return self

    def __next__(self):
        self.waiting_since = time.monotonic()
        try:
            return next(self._requests)
        finally:
            self.waiting_since = None

    def idle_for(self, now: float) -> float:
        since = self.waiting_since
        return 0.0 if since is None else now - since

    def close(self, message: str) -> None:
        if self.closed is None:
            self.closed = message
            _end_stream(self.context, grpc.StatusCode.DEADLINE_EXCEEDED, message)


class StreamSlots:
    """At most ``limit`` concurrent request streams of one kind on a server (each holds a pool thread while its
    handler waits for the caller's next message). A stream that has waited ``idle_close_s`` is closed with
    DEADLINE_EXCEEDED; when every slot is taken, a newcomer gets the slot of the stream that has waited longest if
    that one has waited ``reclaim_idle_s`` (it is closed the same way), else RESOURCE_EXHAUSTED at once."""

    def __init__(self, limit: int, what: str, *, idle_close_s: float | None = None,
                 reclaim_idle_s: float | None = None):
        self.limit, self.what = limit, what
        self.idle_close_s, self.reclaim_idle_s = idle_close_s, reclaim_idle_s
        self._cond = threading.Condition()
        self._active: list[_Watched] = []
        if idle_close_s is not None:
            _IdleWatch.add(self)

    def __len__(self) -> int:
        return len(self._active)

    def admit(self, requests, context) -> _Watched:
        """A slot for this stream (its requests, watched), or ResourceExhausted."""
        with self._cond:
            now = time.monotonic()
            open_ = [s for s in self._active if s.closed is None]
            if len(open_) >= self.limit and self.reclaim_idle_s is not None:
                victim = max(open_, key=lambda s: s.idle_for(now))
                idle = victim.idle_for(now)
                if idle >= self.reclaim_idle_s:
                    victim.close(f"{self.what} stream closed: idle for {idle:.0f}s while another caller needed its "
                                 f"slot ({self.limit} at most)")
                    open_.remove(victim)
            if len(open_) < self.limit <= len(self._active):  # closed ones leave once their handlers see it
                self._cond.wait_for(lambda: len(self._active) < self.limit, timeout=2.0)
            if len(self._active) >= self.limit:
                raise ResourceExhausted(f"this server serves {self.limit} concurrent {self.what} streams, all busy; "
                                        f"close one first or retry later")
            stream = _Watched(requests, context, self)
            self._active.append(stream)
            return stream

    def leave(self, stream: _Watched) -> None:
        with self._cond:
            if stream in self._active:
                self._active.remove(stream)
            self._cond.notify_all()

    @contextlib.contextmanager
    def stream(self, requests, context):
        """``with slots.stream(request_iterator, context) as requests:`` (ResourceExhausted when full)."""
        stream = self.admit(requests, context)
        try:
            yield stream
        finally:
            self.leave(stream)

    def close_idle(self, now: float) -> None:
        with self._cond:
            streams = list(self._active)
        for s in streams:
            idle = s.idle_for(now)
            if idle >= self.idle_close_s:
                s.close(f"{self.what} stream idle for {idle:.0f}s; closed (at most {self.limit} at once, "
                        f"{self.idle_close_s:.0f}s idle each)")


class _IdleWatch:
    """One thread per process that closes streams idle past their ``idle_close_s``."""

    _slots: "weakref.WeakSet[StreamSlots]" = None  # type: ignore[assignment]
    _lock = threading.Lock()
    _thread: threading.Thread | None = None

    @classmethod
    def add(cls, slots: StreamSlots) -> None:
        with cls._lock:
            if cls._slots is None:
                cls._slots = weakref.WeakSet()
            cls._slots.add(slots)
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._loop, name="grpc-idle-watch", daemon=True)
                cls._thread.start()

    @classmethod
    def _loop(cls) -> None:
        while True:
            time.sleep(0.25)
            with cls._lock:
                watched = list(cls._slots)
            now = time.monotonic()
            for slots in watched:
                try:
                    slots.close_idle(now)
                except Exception:  # noqa: BLE001 - never let the watcher die
                    log.exception("idle watch")


# Streams that carry no work (server reflection: open without the credential, one per `grpcurl` command) get a
# few slots of their own and are closed when idle, and every server's pool has RESERVED_THREADS more threads than
# its service asks for: reflection and quick refusals never take the threads the run's calls need.
OPEN_STREAMS = 4  # concurrent reflection streams per server; more: RESOURCE_EXHAUSTED
OPEN_STREAM_IDLE_S = 10.0  # a reflection stream that waits this long for its next request is closed
OPEN_STREAM_RECLAIM_S = 1.0  # with every slot taken, one idle this long makes room for a newcomer
RESERVED_THREADS = OPEN_STREAMS + 4
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")


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
    def refuse(cls, real, code: str, message: str):
        """Abort at once with the auth error; the request's bytes are never parsed (garbage gets the same
        answer as a well-formed request)."""
        status = getattr(grpc.StatusCode, code)

        def abort_unary(request_or_iterator, context):
            context.abort(status, message)

        def abort_stream(request_or_iterator, context):
            context.abort(status, message)
            yield  # pragma: no cover - abort raises

        if real is None:
            return None
        return cls.build(real, abort_stream if real.response_streaming else abort_unary, None,
                         real.response_serializer)

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
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, why(request))
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
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
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


# --- the run's credentials on every call (the scheme, credentials and token files: rlfleet.wire.auth) -----------
TOKEN_ENV = "RLFLEET_RUN_TOKEN"  # the run secret (coordinator, coordinatorctl) or a service's issued credential
TOKEN_FILE = "run_token"  # <run>/run_token: the operator's credential (role ctl), what coordinatorctl reads
TOKEN_KEY = "authorization"  # metadata: "Bearer <bearer>"
ROLE_KEY = "x-rlfleet-role"  # metadata: the caller's role
INDEX_KEY = "x-rlfleet-index"  # metadata: the caller's index among its role (0 when absent)

ROLES = ("coordinator", "env", "inference", "learner", "ctl")  # ctl: coordinatorctl and operators' tools
MAX_INDEX = 1 << 20

# the gRPC service -> the role whose servers host it (which bearer a call carries)
SERVICE_ROLES = {
    "rlfleet.v1.CoordinatorService": "coordinator",
    "rlfleet.v1.EnvService": "env",
    "rlfleet.v1.RolloutService": "env",
    "rlfleet.v1.InferenceService": "inference",
    "rlfleet.v1.LearnerService": "learner",
}

# methods anyone may call, credential or not (probes and discovery; they reveal nothing about the run)
OPEN_PREFIXES = ("/grpc.health.v1.Health/", *REFLECTION_PREFIXES)

_SERVICES = ("env", "inference", "learner")
# calls that change a run's state, and the roles that own them; a method not listed needs any valid credential
METHOD_ROLES: dict[str, tuple[str, ...]] = {
    "/rlfleet.v1.CoordinatorService/Register": _SERVICES,
    "/rlfleet.v1.CoordinatorService/Heartbeat": _SERVICES,
    "/rlfleet.v1.CoordinatorService/Stop": ("ctl",),
    "/rlfleet.v1.CoordinatorService/Scale": ("ctl",),
    "/rlfleet.v1.InferenceService/UpdateWeights": ("learner",),
    "/rlfleet.v1.InferenceService/Act": ("env", "ctl"),
    "/rlfleet.v1.LearnerService/PushRollout": ("env",),
    "/rlfleet.v1.LearnerService/Train": ("coordinator",),
    "/rlfleet.v1.LearnerService/PublishWeights": ("coordinator",),
    "/rlfleet.v1.LearnerService/LogMetrics": ("coordinator",),
    "/rlfleet.v1.LearnerService/SaveCheckpoint": ("coordinator",),
    "/rlfleet.v1.RolloutService/Collect": ("coordinator", "ctl"),
    "/rlfleet.v1.RolloutService/Evaluate": ("coordinator", "ctl"),
}


class AuthError(RuntimeError):
    """A call without a valid credential (args: 'UNAUTHENTICATED', message), or from a role that does not own
    the method or with another role's credential ('PERMISSION_DENIED', message)."""


@dataclass(frozen=True)
class Caller:
    """Who made a call, as its credential proves."""
    role: str
    index: int

    def __str__(self) -> str:
        return f"{self.role}[{self.index}]"


@dataclass(frozen=True)
class Identity:
    """This process's side of the credentials (built once by rlfleet.wire.auth.set_identity)."""
    role: str
    index: int
    from_secret: bool  # holds the run secret (coordinator, coordinatorctl, or a service handed the secret)
    bearers: dict[str, str] = field(repr=False)  # callee role -> what this process sends it
    # checks callers' bearers (rlfleet.wire.auth.Verifier: the run's public issuing key, which signs nothing, and
    # the bearers it has checked); None: this process serves nothing
    verifier: object | None = field(repr=False, default=None)


_identity: Identity | None = None


def use_identity(identity: Identity | None) -> None:
    """What this process's calls carry and its servers check from now on (None: nothing sent or checked)."""
    global _identity
    _identity = identity


def callee_role(method: str) -> str | None:
    """The role whose servers host ``method`` ('/rlfleet.v1.LearnerService/Train' -> 'learner')."""
    return SERVICE_ROLES.get(method.lstrip("/").split("/", 1)[0])


def call_metadata(method: str) -> list[tuple[str, str]]:
    """What a call to ``method`` carries: the bearer for its callee's role, this process's role and index
    (nothing for probes, reflection and services outside the run)."""
    ident = _identity
    if ident is None:
        return []
    token = ident.bearers.get(callee_role(method) or "")
    return [] if token is None else credential_metadata(token, ident.role, ident.index)


def credential_metadata(token: str, role: str, index: int) -> list[tuple[str, str]]:
    """The metadata of a call from ``role[index]`` with bearer ``token``."""
    return [(TOKEN_KEY, f"Bearer {token}"), (ROLE_KEY, role), (INDEX_KEY, str(index))]


def _claim(md: dict) -> tuple[str, int]:
    role = md.get(ROLE_KEY, "")
    if role not in ROLES:
        raise AuthError("UNAUTHENTICATED", f"metadata '{ROLE_KEY}': {role[:40]!r} is not one of {ROLES}")
    text = md.get(INDEX_KEY, "0")
    if not (text.isascii() and text.isdigit() and len(text) <= 7 and int(text) < MAX_INDEX):
        raise AuthError("UNAUTHENTICATED", f"metadata '{INDEX_KEY}': {text[:40]!r} is not an index in "
                                           f"0..{MAX_INDEX - 1}")
    return role, int(text)


def check_caller(method: str, metadata) -> Caller | None:
    """The proven caller of ``method``; raises AuthError(code, message) unless ``metadata`` carries a bearer that
    this process's verifier (rlfleet.wire.auth.Verifier) proves for the claimed role and index toward the role that
    hosts ``method``, and that role owns the method. None when this process checks nothing (no identity) or the
    method is open. A bearer already proven costs a lookup (the verifier remembers it)."""
    ident = _identity
    if ident is None or method.startswith(OPEN_PREFIXES):
        return None
    md = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    given = md.get(TOKEN_KEY, "")
    if not given.startswith("Bearer ") or ident.verifier is None:
        raise AuthError("UNAUTHENTICATED", "missing or wrong run credential (metadata "
                                           f"'{TOKEN_KEY}: Bearer <credential>', '{ROLE_KEY}', '{INDEX_KEY}'; "
                                           f"see `python -m rlfleet.wire.auth --help`)")
    role, index = _claim(md)
    callee = callee_role(method) or ident.role
    proof = ident.verifier.prove(given[7:].strip(), index, callee)
    if proof.role != role or proof.index not in (None, index):
        # a valid credential of another role or index: say so (it is a known caller overstepping)
        theirs = f"{proof.role}[{index if proof.index is None else proof.index}]"
        raise AuthError("PERMISSION_DENIED", f"this credential is {theirs}'s, not {role}[{index}]'s: a service acts "
                                             f"only in its own role and index")
    if callee not in proof.to:
        raise AuthError("PERMISSION_DENIED", f"{role}[{index}]'s credential calls {'/'.join(proof.to)} servers, not "
                                             f"{callee} servers")
    owners = METHOD_ROLES.get(method)
    if owners is not None and role not in owners:
        raise AuthError("PERMISSION_DENIED", f"{method} is accepted only from {'/'.join(owners)}, not from {role}")
    return Caller(role, index)


def caller_of(context) -> Caller | None:
    """The caller of the call a servicer is serving, as the server's check proved it (None: no identity here)."""
    if _identity is None:
        return None
    md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    try:
        role, index = _claim(md)
    except AuthError:
        return None
    return Caller(role, index)


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
                    log.warning("refused %d more calls in the last %.0fs (not logged one by one)", self._dropped,
                                now - self._start)
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
        self.reflection = StreamSlots(OPEN_STREAMS, "reflection", idle_close_s=OPEN_STREAM_IDLE_S,
                                      reclaim_idle_s=OPEN_STREAM_RECLAIM_S)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(REFLECTION_PREFIXES):
            return _Handlers.slotted(continuation(handler_call_details), self.reflection)
        try:
            caller = check_caller(method, handler_call_details.invocation_metadata)
        except AuthError as exc:
            code, message = exc.args
            self.refusals.log(method, message)
            return _Handlers.refuse(continuation(handler_call_details), code, message)
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


def make_server(max_workers: int = 32, max_concurrent_rpcs: int | None = None, *,
                max_receive_bytes: int = MAX_MESSAGE_BYTES, on_call=None) -> grpc.Server:
    """A gRPC server whose pool has ``max_workers`` threads for its services (a streaming RPC holds one for its
    whole life) plus RESERVED_THREADS for reflection streams and quick refusals; with ``max_concurrent_rpcs``,
    calls beyond it (plus the reserve) are refused with RESOURCE_EXHAUSTED instead of queueing unserved.
    Requests over ``max_receive_bytes`` are refused with RESOURCE_EXHAUSTED. Calls are checked against the run's
    credentials (:func:`check_caller`; ``on_call(method, caller)`` runs for each accepted call on the polling
    thread, before the call waits for a pool thread: it must be quick) and, when tracing is set up by now
    (rlfleet.wire.tracing), served in a SERVER span in their caller's trace context."""
    options = [o for o in OPTIONS if o[0] != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))
    limit = None if max_concurrent_rpcs is None else max_concurrent_rpcs + RESERVED_THREADS
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers + RESERVED_THREADS,
                                                  thread_name_prefix="grpc"),
                       options=options, maximum_concurrent_rpcs=limit,
                       interceptors=[_ServerGuard(on_call, traced=tracing.enabled())])


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
    if _tls is not None and credential:
        creds = grpc.ssl_channel_credentials(
            root_certificates=_tls["ca"], private_key=_tls["key"] if _tls["client_auth"] else None,
            certificate_chain=_tls["cert"] if _tls["client_auth"] else None)
        raw = grpc.secure_channel(address, creds, options=OPTIONS)
    else:
        raw = grpc.insecure_channel(address, options=OPTIONS)
    return grpc.intercept_channel(raw, _ClientMetadata(credential, tracing.enabled()))


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

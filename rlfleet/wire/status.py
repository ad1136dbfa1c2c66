"""Errors and gRPC status codes, the one place that maps between them: a servicer method's exception becomes its
status code (:func:`handler`, :func:`abort_for`; what is not an rlfleet error is a bug: INTERNAL, logged), and a
status code a peer answered becomes the rlfleet error of the same meaning (:func:`error_type`)."""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from rlfleet.errors import (
    AuthError,
    Cancelled,
    FailedPrecondition,
    InvalidRequest,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from rlfleet.wire.codec import CodecError

log = logging.getLogger("rlfleet.wire.status")

# error type -> the status code it is answered with; the first type of a code is what that code reads back as
CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (CodecError, grpc.StatusCode.INVALID_ARGUMENT),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Cancelled, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
)


def code_of(exc: BaseException) -> grpc.StatusCode | None:
    """The status code ``exc`` is answered with; None: not an rlfleet error (a bug, answered INTERNAL). An
    AuthError names its code ('UNAUTHENTICATED' or 'PERMISSION_DENIED') as its first argument."""
    if isinstance(exc, AuthError):
        return getattr(grpc.StatusCode, exc.args[0])
    for kind, code in CODES:
        if isinstance(exc, kind):
            return code
    return None


def error_type(code: grpc.StatusCode | None, default: type[Exception] = Unavailable) -> type[Exception]:
    """The rlfleet error a peer's status ``code`` means (``default`` for a code no rlfleet error is answered with)."""
    for kind, known in CODES:
        if known == code:
            return kind
    return default


def abort_for(context: grpc.ServicerContext, exc: BaseException, method: str):
    """End the call with ``exc``'s status code and message (a bug: INTERNAL naming the exception, logged)."""
    code = code_of(exc)
    if code is not None:
        context.abort(code, str(exc))
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
                    abort_for(context, exc, name)

        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except grpc.RpcError:
            raise
        except Exception as exc:  # noqa: BLE001
            abort_for(context, exc, name)

    return wrapper

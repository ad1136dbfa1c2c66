"""gRPC helpers shared by every service: server/channel construction, error mapping, readiness waits."""

from __future__ import annotations

import functools
import inspect
import logging
import time
from concurrent import futures

import grpc

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


def make_server(max_workers: int = 32, max_concurrent_rpcs: int | None = None) -> grpc.Server:
    """A gRPC server whose pool has ``max_workers`` threads (a streaming RPC holds one for its whole life); with
    ``max_concurrent_rpcs``, calls beyond it are refused with RESOURCE_EXHAUSTED instead of queueing unserved."""
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                       options=OPTIONS, maximum_concurrent_rpcs=max_concurrent_rpcs)


def bind(server: grpc.Server, address: str) -> str:
    """Bind an insecure port; returns the address actually bound (port 0 -> the chosen port)."""
    host, _, port = address.rpartition(":")
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    return f"{host}:{bound}" if int(port or 0) == 0 else address


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=OPTIONS)


def wait_ready(address: str, timeout: float = 30.0) -> grpc.Channel:
    ch = channel(address)
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

"""rlfleet.wire.servers' guard over real gRPC on loopback: reflection streams bounded and timed out so that they
never take the threads a service needs, request bytes that are no message and calls without a credential answered
with named statuses, the receive limit, and StreamSlots' reclaim of idle streams."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlfleet.errors import ResourceExhausted
from rlfleet.v1 import coordinator_pb2
from rlfleet.wire import auth, channels, servers, streams

SECRET = "rpc-test-secret"
STATUS = "/rlfleet.v1.CoordinatorService/Status"
REGISTER = "/rlfleet.v1.CoordinatorService/Register"


class Toy:
    """CoordinatorService's Status and Register, answered at once (the service the run needs)."""

    gate: threading.Event | None = None  # set: Status waits for it (a busy server)

    def status(self, request, context):
        if Toy.gate is not None:
            Toy.gate.wait(10)
        return coordinator_pb2.RunStatus(phase="training")

    def register(self, request, context):
        return coordinator_pb2.RegisterResponse(accepted=bool(request.address))


def serve(max_workers=2, max_concurrent_rpcs=None, **kw):
    server = servers.make_server(max_workers=max_workers, max_concurrent_rpcs=max_concurrent_rpcs, **kw)
    toy = Toy()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "rlfleet.v1.CoordinatorService",
                {
                    "Status": grpc.unary_unary_rpc_method_handler(
                        toy.status,
                        coordinator_pb2.StatusRequest.FromString,
                        coordinator_pb2.RunStatus.SerializeToString,
                    ),
                    "Register": grpc.unary_unary_rpc_method_handler(
                        toy.register,
                        coordinator_pb2.RegisterRequest.FromString,
                        coordinator_pb2.RegisterResponse.SerializeToString,
                    ),
                },
            )
        ]
    )
    servers.add_health_and_reflection(server, "rlfleet.v1.CoordinatorService")
    address = servers.bind(server, "127.0.0.1:0")
    server.start()
    return server, address


@pytest.fixture
def credentials():
    auth.set_identity("coordinator", SECRET)
    yield auth.metadata(SECRET, "ctl", to="coordinator")
    auth.set_identity("coordinator", None)


@pytest.fixture
def quick_idle(monkeypatch):
    monkeypatch.setattr(servers, "OPEN_STREAM_IDLE_S", 1.5)


def status(ch, md, timeout=2.0):
    t0 = time.monotonic()
    reply = ch.unary_unary(
        STATUS, coordinator_pb2.StatusRequest.SerializeToString, coordinator_pb2.RunStatus.FromString
    )(coordinator_pb2.StatusRequest(), timeout=timeout, metadata=md)
    assert reply.phase == "training"
    return time.monotonic() - t0


class IdleReflection:
    """``n`` reflection streams that send nothing; ``outcomes``: (status name, seconds open) as they end."""

    def __init__(self, address: str, n: int):
        self.channels = [grpc.insecure_channel(address) for _ in range(4)]
        self.outcomes: list[tuple[str, float]] = []
        self.queues = [queue.Queue() for _ in range(n)]
        self.threads = [threading.Thread(target=self._one, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _one(self, i: int):
        stub = reflection_pb2_grpc.ServerReflectionStub(self.channels[i % len(self.channels)])
        t0 = time.monotonic()
        try:
            for _ in stub.ServerReflectionInfo(iter(self.queues[i].get, None), timeout=60):
                pass
            self.outcomes.append(("OK", time.monotonic() - t0))
        except grpc.RpcError as exc:
            self.outcomes.append((exc.code().name, time.monotonic() - t0))

    def close(self):
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join(5)
        for ch in self.channels:
            ch.close()


def list_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as ch:
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        return {s.name for r in replies for s in r.list_services_response.service}


@pytest.mark.parametrize("max_concurrent", [None, 3], ids=["queueing", "bounded"])
def test_idle_reflection_streams_never_take_the_services_threads(credentials, quick_idle, max_concurrent):
    """40 idle reflection streams against a server of 2 worker threads (bounded: 3 concurrent calls, as the
    inference server bounds them): the service's calls are answered at once throughout; OPEN_STREAMS streams are
    held, the others refused with RESOURCE_EXHAUSTED at once, the held ones closed when idle, and reflection
    works again afterwards. Without the guard the first 2 streams took both threads and Status queued forever
    (bounded: every call failed RESOURCE_EXHAUSTED)."""
    server, address = serve(max_workers=2, max_concurrent_rpcs=max_concurrent)
    flood = IdleReflection(address, 40)
    try:
        with grpc.insecure_channel(address) as ch:
            time.sleep(0.5)
            worst = max(status(ch, credentials) for _ in range(20))
            assert worst < 1.0
            refused = [o for o in flood.outcomes if o[0] == "RESOURCE_EXHAUSTED"]
            assert len(refused) == 40 - servers.OPEN_STREAMS and max(t for _, t in refused) < 2.0
            time.sleep(servers.OPEN_STREAM_IDLE_S + 1.0)
            outcomes = Counter(name for name, _ in flood.outcomes)
            assert outcomes == {
                "RESOURCE_EXHAUSTED": 40 - servers.OPEN_STREAMS,
                "DEADLINE_EXCEEDED": servers.OPEN_STREAMS,
            }
            assert "rlfleet.v1.CoordinatorService" in list_services(address)
            assert status(ch, credentials) < 1.0
    finally:
        flood.close()
        server.stop(0)


def test_a_newcomer_reclaims_an_idle_reflection_slot(credentials):
    """Every slot held by streams idle past OPEN_STREAM_RECLAIM_S: `grpcurl list` is still answered."""
    server, address = serve()
    flood = IdleReflection(address, servers.OPEN_STREAMS)
    try:
        time.sleep(servers.OPEN_STREAM_RECLAIM_S + 0.5)
        assert "grpc.health.v1.Health" in list_services(address)
        time.sleep(0.5)
        assert [name for name, _ in flood.outcomes] == ["DEADLINE_EXCEEDED"]  # the one whose slot was taken
    finally:
        flood.close()
        server.stop(0)


def test_bytes_that_are_no_message_get_named_statuses(credentials):
    """Garbage without a credential: UNAUTHENTICATED (it used to be INTERNAL: the bytes were parsed first);
    with one: INVALID_ARGUMENT naming the message type; the server keeps serving."""
    server, address = serve()
    garbage = b"\xff\xff\xff\xff\x0f"
    try:
        with grpc.insecure_channel(address) as ch:
            call = ch.unary_unary(REGISTER)
            with pytest.raises(grpc.RpcError) as err:
                call(garbage, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                call(garbage, timeout=5, metadata=auth.metadata(SECRET, "env", to="coordinator"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid rlfleet.v1.RegisterRequest" in err.value.details()
            reply = coordinator_pb2.RegisterResponse.FromString(
                call(
                    coordinator_pb2.RegisterRequest(address="h:1").SerializeToString(),
                    timeout=5,
                    metadata=auth.metadata(SECRET, "env", to="coordinator"),
                )
            )
            assert reply.accepted
            assert status(ch, credentials) < 1.0
    finally:
        server.stop(0)


def test_requests_over_the_receive_limit_are_refused(credentials):
    server, address = serve(max_receive_bytes=1 << 20)
    try:
        with grpc.insecure_channel(address, options=channels.OPTIONS) as ch:
            call = ch.unary_unary(REGISTER)
            with pytest.raises(grpc.RpcError) as err:
                call(
                    coordinator_pb2.RegisterRequest(address="x" * (2 << 20)).SerializeToString(),
                    timeout=10,
                    metadata=auth.metadata(SECRET, "env", to="coordinator"),
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert status(ch, credentials) < 1.0
    finally:
        server.stop(0)


def test_on_call_sees_proven_callers_before_the_pool(credentials):
    """on_call runs on the polling thread: a call is seen even while every worker thread is busy (how the
    coordinator notes a heartbeat that waits for a thread)."""
    seen = []
    server, address = serve(max_workers=1, on_call=lambda method, caller: seen.append((method, str(caller))))
    Toy.gate = threading.Event()
    try:
        with grpc.insecure_channel(address) as ch:
            status_call = ch.unary_unary(
                STATUS, coordinator_pb2.StatusRequest.SerializeToString, coordinator_pb2.RunStatus.FromString
            )
            busy = [
                status_call.future(coordinator_pb2.StatusRequest(), timeout=15, metadata=credentials)
                for _ in range(1 + servers.RESERVED_THREADS)
            ]  # every thread of the pool
            time.sleep(0.5)
            queued = ch.unary_unary(REGISTER).future(
                coordinator_pb2.RegisterRequest(address="h:1").SerializeToString(),
                timeout=15,
                metadata=auth.metadata(SECRET, "env", 3, to="coordinator"),
            )
            time.sleep(0.5)
            assert (REGISTER, "env[3]") in seen and not queued.done()  # seen while it waits for a thread
            Toy.gate.set()
            assert coordinator_pb2.RegisterResponse.FromString(queued.result()).accepted
            assert all(f.result().phase == "training" for f in busy)
    finally:
        Toy.gate.set()
        Toy.gate = None
        server.stop(0)


def test_stream_slots_reclaim_only_idle_streams():
    """StreamSlots on its own: a busy stream is never reclaimed; one idle past reclaim_idle_s is, for a newcomer."""
    slots = streams.StreamSlots(1, "Test", reclaim_idle_s=0.3)

    class Context:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    q: queue.Queue = queue.Queue()
    first_ctx = Context()
    first = slots.admit(iter(q.get, None), first_ctx)
    with pytest.raises(ResourceExhausted):  # not waiting for a request: busy, not idle
        slots.admit(iter([]), Context())
    waiter = threading.Thread(target=lambda: next(first, None), daemon=True)
    waiter.start()  # now it waits for its caller
    time.sleep(0.4)
    threading.Timer(0.2, lambda: (q.put(None), slots.leave(first))).start()  # its handler leaves once closed
    second = slots.admit(iter([]), Context())
    assert first.closed and first_ctx.cancelled and "while another caller needed its slot" in first.closed
    assert len(slots) == 1
    slots.leave(second)
    assert len(slots) == 0

"""The coordinator's gRPC server in-process, over real gRPC on loopback, with the run's credentials: Register checks
its claim (fields and who is making it), a stop while an attach-mode coordinator waits for its services ends the
wait, heartbeats that wait for a busy server's threads still count, and Status carries the bottleneck line."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from rlfleet.config import to_yaml
from rlfleet.v1 import coordinator_pb2, coordinator_pb2_grpc
from rlfleet.wire import auth, callers
from services.coordinator.coordinator import Coordinator
from services.coordinator.launcher import AttachLauncher
from services.coordinator.server import serve
from services.coordinator.service_registry import HealthMonitor
from tests.conftest import small_config

SECRET = "coordinator-test-secret"


def md(role="ctl", index=0):
    return auth.metadata(SECRET, role, index, to="coordinator")


@pytest.fixture
def coordinator(tmp_path):
    made = []

    def make(*overrides):
        auth.set_identity("coordinator", SECRET)
        coord = Coordinator(small_config(*overrides), tmp_path / "run", quiet=True, token=SECRET)
        server = serve(coord, "127.0.0.1:0")
        ch = grpc.insecure_channel(coord.address)
        made.append((coord, server, ch))
        return coord, coordinator_pb2_grpc.CoordinatorServiceStub(ch)

    yield make
    for coord, server, ch in made:
        coord.registry.shutting_down = True
        ch.close()
        server.stop(0)
    auth.set_identity("coordinator", None)


def register_request(coord, **fields):
    base = dict(
        role=coordinator_pb2.ENV,
        index=0,
        address="127.0.0.1:50100",
        pid=4242,
        incarnation="abc123",
        config_yaml=to_yaml(coord.cfg),
    )
    return coordinator_pb2.RegisterRequest(**{**base, **fields})


def code_of(call, *args, **kw):
    try:
        call(*args, **kw)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_register_checks_its_claim_field_by_field(coordinator):
    """Each reported case gets a named status and nothing of it is registered; the server keeps serving."""
    coord, stub = coordinator()
    cases = {
        "empty config_yaml": (dict(config_yaml=""), grpc.StatusCode.INVALID_ARGUMENT, "config_yaml: empty"),
        "'::not an address::'": (
            dict(address="::not an address::"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "is not an address (host:port",
        ),
        "3 kB address": (dict(address="a" * 3000 + ":1"), grpc.StatusCode.INVALID_ARGUMENT, "3002 characters"),
        "50 MB address": (dict(address="a" * (50 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        "no port": (dict(address="127.0.0.1"), grpc.StatusCode.INVALID_ARGUMENT, "is not an address (host:port"),
        "port 0": (dict(address="127.0.0.1:0"), grpc.StatusCode.INVALID_ARGUMENT, "port in 1..65535"),
        "bad IPv6": (dict(address="[::zz]:5"), grpc.StatusCode.INVALID_ARGUMENT, "IPv6"),
        "host with spaces": (dict(address="a b:5"), grpc.StatusCode.INVALID_ARGUMENT, "not a host name"),
        "pid 0": (dict(pid=0), grpc.StatusCode.INVALID_ARGUMENT, "pid: 0"),
        "no incarnation": (dict(incarnation=""), grpc.StatusCode.INVALID_ARGUMENT, "incarnation"),
        "role unset": (dict(role=0), grpc.StatusCode.INVALID_ARGUMENT, "role: 0"),
        "negative index": (dict(index=-1), grpc.StatusCode.INVALID_ARGUMENT, "index: -1"),
        "another config": (
            dict(config_yaml=to_yaml(coord.cfg).replace("gamma: 0.95", "gamma: 0.5")),
            grpc.StatusCode.FAILED_PRECONDITION,
            "'algorithm.gamma' is 0.5 there",
        ),
    }
    for label, (fields, want, words) in cases.items():
        code, details = code_of(stub.Register, register_request(coord, **fields), timeout=30, metadata=md("env"))
        assert code == want and words in details, (label, code, details)
        assert not coord.registry.services[("env", 0)].ready.is_set(), label
    for address in ("127.0.0.1:50100", "env-1.env:50054", "[::1]:50100", "localhost:1"):
        assert stub.Register(register_request(coord, address=address), timeout=10, metadata=md("env")).accepted
        assert coord.registry.services[("env", 0)].address == address
    assert stub.Status(coordinator_pb2.StatusRequest(), timeout=5, metadata=md()).phase == "starting"


def test_a_service_speaks_only_for_itself(coordinator):
    """An env credential cannot register or heartbeat as the learner, nor as another env server; a ctl or stale
    credential is refused too; the learner's own credential is accepted."""
    coord, stub = coordinator()
    attempts = [
        (stub.Register, register_request(coord, role=coordinator_pb2.LEARNER), md("env")),
        (stub.Register, register_request(coord, index=1), md("env", 0)),
        (
            stub.Heartbeat,
            coordinator_pb2.HeartbeatRequest(role=coordinator_pb2.LEARNER, index=0, incarnation="x"),
            md("env"),
        ),
    ]
    for call, request, metadata in attempts:
        code, details = code_of(call, request, timeout=10, metadata=metadata)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "speaks only for itself" in details, (code, details)
    forged = md("env")
    forged[1] = (callers.ROLE_KEY, "learner")  # claiming the role with env's bearer
    code, details = code_of(
        stub.Register, register_request(coord, role=coordinator_pb2.LEARNER), timeout=10, metadata=forged
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED and "env[0]'s, not learner[0]'s" in details
    code, _ = code_of(stub.Register, register_request(coord), timeout=10, metadata=md("ctl"))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = code_of(
        stub.Register,
        register_request(coord),
        timeout=10,
        metadata=auth.metadata("an old secret", "env", 0, to="coordinator"),
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert not coord.registry.services[("learner", 0)].ready.is_set()
    assert stub.Register(
        register_request(coord, role=coordinator_pb2.LEARNER), timeout=10, metadata=md("learner")
    ).accepted
    assert not stub.Heartbeat(
        coordinator_pb2.HeartbeatRequest(role=coordinator_pb2.LEARNER, index=0, incarnation="abc123"),
        timeout=5,
        metadata=md("learner"),
    ).shutdown


def test_stop_while_attach_mode_waits_for_services(coordinator):
    """`coordinatorctl stop` before the services registered: the wait ends at once (it used to say 'stopping'
    and stay 'starting' until cluster.startup_timeout_s)."""
    coord, stub = coordinator("cluster.launcher=attach", "cluster.startup_timeout_s=120")
    result = {}
    runner = threading.Thread(target=lambda: result.update(coord.run()), daemon=True)
    runner.start()
    time.sleep(1.0)
    assert stub.Status(coordinator_pb2.StatusRequest(), timeout=5, metadata=md()).phase == "starting"
    code, _ = code_of(stub.Stop, coordinator_pb2.StopRequest(reason="x" * 5000), timeout=5, metadata=md())
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # an oversized reason is refused, nothing printed
    code, _ = code_of(stub.Stop, coordinator_pb2.StopRequest(reason="test"), timeout=5, metadata=md("env"))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    t0 = time.monotonic()
    assert stub.Stop(coordinator_pb2.StopRequest(reason="operator"), timeout=5, metadata=md()).stopping
    runner.join(5)
    assert not runner.is_alive() and time.monotonic() - t0 < 3
    assert result == {"stopped": "operator", "epochs": 0}
    assert stub.Status(coordinator_pb2.StatusRequest(), timeout=5, metadata=md()).phase == "stopped"
    coord.shutdown()


def test_heartbeats_waiting_for_a_busy_coordinator_still_count(coordinator):
    """Every server thread busy (slow Status calls): the learner's heartbeats queue unanswered, yet it is not
    declared dead (they are noted as they arrive); once they stop arriving, it is, after the timeout."""
    coord, stub = coordinator("cluster.launcher=attach", "cluster.heartbeat_timeout_s=1.5")
    assert stub.Register(
        register_request(coord, role=coordinator_pb2.LEARNER), timeout=10, metadata=md("learner")
    ).accepted
    gate = threading.Event()
    plain_status = coord.status
    coord.status = lambda: (gate.wait(30), plain_status())[1]
    busy = [stub.Status.future(coordinator_pb2.StatusRequest(), timeout=60, metadata=md()) for _ in range(64)]
    time.sleep(0.5)  # every thread of the pool holds one, the rest queue
    HealthMonitor(coord.registry, AttachLauncher(), coord.cfg, coord.run_dir, lambda *a, **k: None).start()
    beats = []
    try:
        for _ in range(8):  # 4 s of heartbeats, none answered
            beats.append(
                stub.Heartbeat.future(
                    coordinator_pb2.HeartbeatRequest(role=coordinator_pb2.LEARNER, index=0, incarnation="abc123"),
                    timeout=60,
                    metadata=md("learner"),
                )
            )
            time.sleep(0.5)
        assert not any(b.done() for b in beats) and coord.fate.fatal is None
        time.sleep(2.5)  # silence: now it is dead
        assert coord.fate.fatal and "learner[0] died: sent no heartbeat" in coord.fate.fatal
    finally:
        gate.set()
    assert all(not b.result().shutdown for b in beats) and len([f.result() for f in busy]) == 64


def test_status_carries_the_bottleneck_line(coordinator):
    """Status's bottleneck: empty before any epoch's timings, then the line over the recent epochs
    (services/coordinator/bottleneck.py), with the advice for this run's shape."""
    coord, stub = coordinator("cluster.num_env_servers=2")
    assert stub.Status(coordinator_pb2.StatusRequest(), timeout=10, metadata=md()).bottleneck == ""
    for epoch in range(3):
        coord.report.note_epoch(
            epoch,
            {"time/step": 1.0, "time/rollout": 0.8, "time/env": 0.6, "time/inference_wait": 0.1, "time/train_rpc": 0.2},
            coord.fleet_shape(),
        )
    line = stub.Status(coordinator_pb2.StatusRequest(), timeout=10, metadata=md()).bottleneck
    assert line.startswith("env stepping takes 75% of the rollout (60% of the epoch)")
    assert "cluster.num_env_servers=4" in line  # two configured: the next count that splits the 8 envs
    if len(os.sched_getaffinity(0)) <= 2:  # the local launcher's host: its cores are taken by the two env servers
        assert "the 2 env servers already fill this host's" in line, line

"""The run credential, role ownership, health checking and reflection, against a real run (processes, gRPC).

The five attacks measured when the fleet was tried as an attacker on the same host would: each now fails with
UNAUTHENTICATED (no token) and the run finishes untouched. Every method of every service refuses a call without
the token; grpc.health.v1 and reflection answer without it (Kubernetes probes, grpcurl)."""

from __future__ import annotations

import json
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlfleet import rpc
from rlfleet.metrics import read_metrics
from rlfleet.v1 import (coordinator_pb2, coordinator_pb2_grpc, env_pb2, inference_pb2, inference_pb2_grpc,
                        learner_pb2, learner_pb2_grpc, rollout_pb2)
from tests.services.coordinator.test_end_to_end import CTL, credential, finish, start, wait_epoch

pytestmark = pytest.mark.slow

SERVICES = {  # role -> the rlfleet services its server hosts
    coordinator_pb2.ENV: [rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
                          env_pb2.DESCRIPTOR.services_by_name["EnvService"]],
    coordinator_pb2.INFERENCE: [inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]],
    coordinator_pb2.LEARNER: [learner_pb2.DESCRIPTOR.services_by_name["LearnerService"]],
}


def raw_call(ch: grpc.Channel, service, method, metadata=()):
    """Call any method with an empty message (no token unless metadata says so); -> status code."""
    path = f"/{service.full_name}/{method.name}"
    ident = lambda b: b  # noqa: E731 - raw bytes both ways
    kind = (method.client_streaming, method.server_streaming)
    try:
        if kind == (False, False):
            ch.unary_unary(path, ident, ident)(b"", timeout=5, metadata=metadata)
        elif kind == (True, False):
            ch.stream_unary(path, ident, ident)(iter([b""]), timeout=5, metadata=metadata)
        elif kind == (False, True):
            list(ch.unary_stream(path, ident, ident)(b"", timeout=5, metadata=metadata))
        else:
            list(ch.stream_stream(path, ident, ident)(iter([b""]), timeout=5, metadata=metadata))
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_without_the_token_every_rpc_is_refused_and_the_attacks_fail(tmp_path):
    proc = start(tmp_path, "runner.max_epochs=12", "runner.val_check_interval=0", name="sec")
    run = tmp_path / "sec"
    try:
        st = wait_epoch(run, 2, proc)
        coord = json.loads((run / "coordinator.json").read_text())["address"]
        addresses = {s.role: s.address for s in st.services}
        assert oct((run / "run_token").stat().st_mode & 0o777) == "0o600"

        # every method of every service, no token: UNAUTHENTICATED
        targets = [(coord, coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"])]
        targets += [(addresses[role], svc) for role, svcs in SERVICES.items() for svc in svcs]
        for address, svc in targets:
            with grpc.insecure_channel(address) as ch:
                for method in svc.methods:
                    code, details = raw_call(ch, svc, method)
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (svc.full_name, method.name, code, details)
                    assert "missing or wrong run credential" in details
                # a wrong token is no better than none
                code, _ = raw_call(ch, svc, svc.methods[0], [("authorization", "Bearer guess")])
                assert code == grpc.StatusCode.UNAUTHENTICATED

        # the five attacks, as tried before: each refused
        with grpc.insecure_channel(addresses[coordinator_pb2.INFERENCE]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                inference_pb2_grpc.InferenceServiceStub(ch).UpdateWeights(
                    iter([inference_pb2.WeightsChunk(version=2 ** 62)]), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(coord) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            for call, req in ((stub.Register, coordinator_pb2.RegisterRequest(role=coordinator_pb2.ENV, index=0,
                                                                               address="127.0.0.1:1")),
                              (stub.Stop, coordinator_pb2.StopRequest(reason="attack"))):
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(addresses[coordinator_pb2.LEARNER]) as ch:
            stub = learner_pb2_grpc.LearnerServiceStub(ch)
            for call, req in ((stub.LogMetrics, learner_pb2.LogMetricsRequest(step=1, metrics={"eval/forged": 1.0})),
                              (stub.Train, learner_pb2.TrainRequest(epoch=99)),
                              (stub.SaveCheckpoint, learner_pb2.SaveCheckpointRequest())):
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                stub.PushRollout(iter([learner_pb2.RolloutChunk(epoch=st.epoch + 1)]), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

            # with the token, a state-changing call from a role that does not own it is still refused
            with pytest.raises(grpc.RpcError) as err:
                stub.LogMetrics(learner_pb2.LogMetricsRequest(step=1, metrics={"eval/forged": 1.0}), timeout=5,
                                metadata=credential(run, "env"))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "accepted only from coordinator, not from env" in err.value.details()
            # and an allowed read works with it
            ok = stub.Status(learner_pb2.LearnerStatusRequest(), timeout=5, metadata=credential(run))
            assert ok.weights_version >= 1

        # health and reflection answer without the token, on every service
        for address, names in [(coord, ["rlfleet.v1.CoordinatorService"])] + [
                (addresses[role], [s.full_name for s in svcs]) for role, svcs in SERVICES.items()]:
            with grpc.insecure_channel(address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                for name in ["", *names]:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING, (address, name)
                listing = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
                listed = {s.name for r in listing for s in r.list_services_response.service}
                assert set(names) | {"grpc.health.v1.Health"} <= listed, (address, listed)

        # coordinatorctl status uses the run folder's token
        out = subprocess.run([*CTL, "status", str(run)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and "sec: training" in out.stdout, out.stdout + out.stderr
        code, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, out
    assert "runner.max_epochs=12 reached" in out
    assert not any("eval/forged" in r for r in read_metrics(run))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 12

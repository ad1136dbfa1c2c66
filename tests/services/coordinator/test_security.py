"""The run's credentials, role ownership, health checking and reflection, against a real run (processes, gRPC).

The five attacks measured when the fleet was tried as an attacker on the same host would: each now fails with
UNAUTHENTICATED (no token) and the run finishes untouched. Every method of every service refuses a call without
the token, garbage bytes included; grpc.health.v1 and reflection answer without it (Kubernetes probes, grpcurl).
Issue 25, rerun with the run's credentials: a service's credential acts only in its own role and index (an env
credential claiming the learner is refused at UpdateWeights and Register), Register checks its claim, and idle
reflection streams against every server leave the run, its calls and its heartbeats untouched."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlfleet.config import load_config, to_yaml
from rlfleet.data.metrics import read_metrics
from rlfleet.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    env_pb2,
    inference_pb2,
    inference_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
    rollout_pb2,
)
from rlfleet.wire import auth, callers, servers
from tests.services.coordinator.test_end_to_end import CTL, credential, finish, start, wait_epoch

pytestmark = pytest.mark.slow

SERVICES = {  # role -> the rlfleet services its server hosts
    coordinator_pb2.ENV: [
        rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
        env_pb2.DESCRIPTOR.services_by_name["EnvService"],
    ],
    coordinator_pb2.INFERENCE: [inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]],
    coordinator_pb2.LEARNER: [learner_pb2.DESCRIPTOR.services_by_name["LearnerService"]],
}


def raw_call(ch: grpc.Channel, service, method, metadata=(), body=b""):
    """Call any method with ``body`` as its message's bytes (an empty message by default; no token unless
    metadata says so); -> (status code, details)."""
    path = f"/{service.full_name}/{method.name}"
    ident = lambda b: b  # noqa: E731 - raw bytes both ways
    kind = (method.client_streaming, method.server_streaming)
    try:
        if kind == (False, False):
            ch.unary_unary(path, ident, ident)(body, timeout=5, metadata=metadata)
        elif kind == (True, False):
            ch.stream_unary(path, ident, ident)(iter([body]), timeout=5, metadata=metadata)
        elif kind == (False, True):
            list(ch.unary_stream(path, ident, ident)(body, timeout=5, metadata=metadata))
        else:
            list(ch.stream_stream(path, ident, ident)(iter([body]), timeout=5, metadata=metadata))
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


SECRET = "the-run-secret-of-the-security-tests"


def test_without_the_token_every_rpc_is_refused_and_the_attacks_fail(tmp_path, monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, SECRET)  # the run's secret, known here (the run folder holds the operator's)
    proc = start(tmp_path, "runner.max_epochs=40", "runner.val_check_interval=0", name="sec")  # still going at status
    monkeypatch.delenv(auth.TOKEN_ENV)
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
                # a wrong token is no better than none; garbage bytes are refused the same way (not INTERNAL)
                code, _ = raw_call(ch, svc, svc.methods[0], [("authorization", "Bearer guess")])
                assert code == grpc.StatusCode.UNAUTHENTICATED
                for method in svc.methods:
                    code, details = raw_call(ch, svc, method, body=b"\xff\xff\xff\xff\x0f")
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (svc.full_name, method.name, code, details)

        # the five attacks, as tried before: each refused
        with grpc.insecure_channel(addresses[coordinator_pb2.INFERENCE]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                inference_pb2_grpc.InferenceServiceStub(ch).UpdateWeights(
                    iter([inference_pb2.WeightsChunk(version=2**62)]), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(coord) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            for call, req in (
                (
                    stub.Register,
                    coordinator_pb2.RegisterRequest(role=coordinator_pb2.ENV, index=0, address="127.0.0.1:1"),
                ),
                (stub.Stop, coordinator_pb2.StopRequest(reason="attack")),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(addresses[coordinator_pb2.LEARNER]) as ch:
            stub = learner_pb2_grpc.LearnerServiceStub(ch)
            for call, req in (
                (stub.LogMetrics, learner_pb2.LogMetricsRequest(step=1, metrics={"eval/forged": 1.0})),
                (stub.Train, learner_pb2.TrainRequest(epoch=99)),
                (stub.SaveCheckpoint, learner_pb2.SaveCheckpointRequest()),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                stub.PushRollout(iter([learner_pb2.RolloutChunk(epoch=st.epoch + 1)]), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

            # with a credential, a state-changing call from a role that does not own it is still refused
            with pytest.raises(grpc.RpcError) as err:
                stub.LogMetrics(
                    learner_pb2.LogMetricsRequest(step=1, metrics={"eval/forged": 1.0}),
                    timeout=5,
                    metadata=auth.metadata(SECRET, "env", to="learner"),
                )
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "accepted only from coordinator, not from env" in err.value.details()
            # and an allowed read works with it
            ok = stub.Status(learner_pb2.LearnerStatusRequest(), timeout=5, metadata=credential(run, to="learner"))
            assert ok.weights_version >= 1

        # issue 25, with the credentials the run hands its env server: roles are proven, not declared
        env_cred = auth.issue(SECRET, "env", 0)  # what env[0] holds (its RLFLEET_RUN_TOKEN)
        auth.set_identity("env", env_cred, 0)
        env_md = {
            to: callers.call_metadata(f"/rlfleet.v1.{svc}/x")
            for to, svc in (("coordinator", "CoordinatorService"), ("inference", "InferenceService"))
        }
        auth.set_identity("env", None)
        as_learner = [(k, "learner" if k == callers.ROLE_KEY else v) for k, v in env_md["inference"]]
        with grpc.insecure_channel(addresses[coordinator_pb2.INFERENCE]) as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            for metadata, words in (
                (as_learner, "env[0]'s, not learner[0]'s"),
                (env_md["inference"], "accepted only from learner, not from env"),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    stub.UpdateWeights(iter([inference_pb2.WeightsChunk(version=2**62)]), timeout=5, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and words in err.value.details()
        config = to_yaml(load_config(run / "config.yaml"))
        claim = dict(
            role=coordinator_pb2.ENV, index=0, address="127.0.0.1:1", pid=1, incarnation="x", config_yaml=config
        )
        with grpc.insecure_channel(coord) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            for fields, want in (
                (dict(role=coordinator_pb2.LEARNER), grpc.StatusCode.PERMISSION_DENIED),
                (dict(index=1), grpc.StatusCode.PERMISSION_DENIED),
                (dict(config_yaml=""), grpc.StatusCode.INVALID_ARGUMENT),
                (dict(address="::not an address::"), grpc.StatusCode.INVALID_ARGUMENT),
                (dict(address="a" * (50 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Register(
                        coordinator_pb2.RegisterRequest(**{**claim, **fields}),
                        timeout=30,
                        metadata=env_md["coordinator"],
                    )
                assert err.value.code() == want, (fields.keys(), err.value.code(), err.value.details()[:200])
            with pytest.raises(grpc.RpcError) as err:  # the operator's credential is needed to stop the run
                stub.Stop(coordinator_pb2.StopRequest(reason="attack"), timeout=5, metadata=env_md["coordinator"])
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

        # health and reflection answer without the token, on every service
        for address, names in [(coord, ["rlfleet.v1.CoordinatorService"])] + [
            (addresses[role], [s.full_name for s in svcs]) for role, svcs in SERVICES.items()
        ]:
            with grpc.insecure_channel(address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                for name in ["", *names]:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING, (address, name)
                listing = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
                )
                listed = {s.name for r in listing for s in r.list_services_response.service}
                assert set(names) | {"grpc.health.v1.Health"} <= listed, (address, listed)

        # coordinatorctl status uses the run folder's token
        out = subprocess.run([*CTL, "status", str(run)], capture_output=True, text=True, timeout=30)
        # (training, or its final evaluation where the attacks above outlasted the epochs on a loaded host)
        assert out.returncode == 0 and re.search(r"sec: (training|evaluating)", out.stdout), out.stdout + out.stderr
        code, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, out
    assert "runner.max_epochs=40 reached" in out
    assert not any("eval/forged" in r for r in read_metrics(run))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 40 and not summary["restarts"]
    weights = [r["train/weights_version"] for r in read_metrics(run) if "train/weights_version" in r]
    assert max(weights) < 100  # no 2**62 version got in


def test_idle_reflection_streams_leave_a_live_run_untouched(tmp_path):
    """40 idle reflection streams against each of the four servers of a live run, twice over (the first wave is
    closed for idleness after servers.OPEN_STREAM_IDLE_S): valid calls are answered at once throughout, every
    service's heartbeat stays fresh, nothing restarts, the run finishes. Before: 40 against the coordinator
    alone failed the run ('learner[0] died: sent no heartbeat for 15s'), 20 made a valid Status time out."""
    from tests.rlfleet.test_rpc import IdleReflection

    proc = start(tmp_path, "runner.max_epochs=1000", "runner.val_check_interval=0", name="refl")
    run = tmp_path / "refl"
    floods = []
    try:
        st = wait_epoch(run, 2, proc)
        coord = json.loads((run / "coordinator.json").read_text())["address"]
        addresses = {s.role: s.address for s in st.services}
        targets = [coord, *addresses.values()]
        learner = learner_pb2_grpc.LearnerServiceStub(grpc.insecure_channel(addresses[coordinator_pb2.LEARNER]))
        worst, ages, t_end = 0.0, [], time.monotonic() + 2 * servers.OPEN_STREAM_IDLE_S + 4
        floods.append([IdleReflection(a, 40) for a in targets])
        while time.monotonic() < t_end and proc.poll() is None:
            if len(floods) == 1 and time.monotonic() > t_end - servers.OPEN_STREAM_IDLE_S - 1:
                floods.append([IdleReflection(a, 40) for a in targets])  # the second wave
            t0 = time.monotonic()
            st = coordinator_pb2_grpc.CoordinatorServiceStub(grpc.insecure_channel(coord)).Status(
                coordinator_pb2.StatusRequest(), timeout=5, metadata=credential(run)
            )
            learner.Status(learner_pb2.LearnerStatusRequest(), timeout=5, metadata=credential(run, to="learner"))
            worst = max(worst, time.monotonic() - t0)
            if st.phase == "training":
                ages += [s.last_heartbeat_age_s for s in st.services]
            time.sleep(0.5)
        assert proc.poll() is None, f"the run ended under the floods:\n{proc.communicate()[0]}"
        first = [f.outcomes for f in floods[0]]
        epochs = st.epoch + 1
        proc.send_signal(signal.SIGINT)  # stop: finish the epoch, checkpoint, leave
        code, out = finish(proc)
    finally:
        for wave in floods:
            for f in wave:
                f.close()
        if proc.poll() is None:
            proc.kill()
    assert code == 0, out
    assert worst < 2.0, worst
    assert ages and max(ages) < 3.0, max(ages)  # heartbeats every cluster.heartbeat_interval_s (1 s)
    for outcomes in first:  # per server: OPEN_STREAMS held (then closed idle), the rest refused at once
        names = sorted(name for name, _ in outcomes)
        assert names.count("RESOURCE_EXHAUSTED") >= 40 - servers.OPEN_STREAMS, names
        assert names.count("DEADLINE_EXCEEDED") >= 1, names
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] >= epochs > 10 and not summary["restarts"]


def test_stop_reaches_an_attach_mode_coordinator_waiting_for_its_services(tmp_path):
    """`coordinatorctl stop --address` to an attach-mode coordinator whose services never came: it stops within
    seconds (it used to answer 'stopping: true' and stay 'starting' until cluster.startup_timeout_s)."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ, RLFLEET_RUN_TOKEN="attach-stop-secret")
    proc = subprocess.Popen(
        [
            *CTL,
            "start",
            "cluster.launcher=attach",
            f"cluster.coordinator_address={address}",
            "cluster.startup_timeout_s=300",
            f"runner.logger.log_path={tmp_path}",
            "runner.experiment_name=attachstop",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "waiting for services to register" in line:
                break
        assert not (tmp_path / "attachstop" / "run_token").exists()  # the deployment's secret stays out of the folder
        stop = subprocess.run([*CTL, "stop", "--address", address], capture_output=True, text=True, timeout=60, env=env)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        t0 = time.monotonic()
        code = proc.wait(30)
        out = "".join(lines) + proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0 and time.monotonic() - t0 < 10, out
    assert "stopped before training: coordinatorctl stop" in out

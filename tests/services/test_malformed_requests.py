"""Malformed requests against every RPC of every service: each is answered with a status naming the problem
(INVALID_ARGUMENT, FAILED_PRECONDITION, ...), never INTERNAL or UNKNOWN, and the servers keep serving.

Each field of each request type is set, one at a time, to an edge value: negative, huge, NaN, empty or odd
strings, unknown enum values, tensors with unknown dtypes, 0-d, overflowing or negative shapes, bad specs."""

import grpc
import numpy as np
from google.protobuf.descriptor import FieldDescriptor as FD

from rlfleet.v1 import (
    coordinator_pb2,
    env_pb2,
    inference_pb2,
    learner_pb2,
    learner_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    tensor_pb2,
)
from rlfleet.wire import channels, codec


def tensors():
    yield codec.Tensor(dtype=99, shape=[1], data=b"\0\0\0\0")
    yield codec.Tensor(dtype=codec.DType.FLOAT32, shape=[], data=b"\0\0\0\0")
    yield codec.Tensor(dtype=codec.DType.FLOAT32, shape=[2**32, 2**32], data=b"")
    yield codec.Tensor(dtype=codec.DType.FLOAT32, shape=[-1], data=b"")
    yield codec.encode(np.full((1, 4), np.nan, np.float32))
    yield codec.encode(np.zeros((3,), np.int64))
    # a shared-memory handle no one was offered: pid 1's stdin, a huge offset, no key (issue 34)
    yield codec.Tensor(
        dtype=codec.DType.FLOAT32,
        shape=[1, 4],
        shared=tensor_pb2.SharedRef(pid=1, fd=0, offset=2**63, length=16, generation=1, key=b"k" * 16),
    )


def mutations(desc, depth=0):
    """(label, message) with one field set to an edge value."""
    cls = desc._concrete_class
    yield "empty", cls()
    for f in desc.fields:
        vals = []
        if f.type in (FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_SINT32, FD.TYPE_SINT64):
            vals = [
                -1,
                -(2**31) if f.type in (FD.TYPE_INT32, FD.TYPE_SINT32) else -(2**62),
                2**31 - 1 if f.type in (FD.TYPE_INT32, FD.TYPE_SINT32) else 2**62,
            ]
        elif f.type in (FD.TYPE_UINT32, FD.TYPE_UINT64):
            vals = [2**32 - 1 if f.type == FD.TYPE_UINT32 else 2**63]
        elif f.type in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            vals = [float("nan"), -1.0, 1e30]
        elif f.type == FD.TYPE_STRING:
            vals = ["", "x" * 1000, "\x00", "[unclosed: {"]
        elif f.type == FD.TYPE_ENUM:
            vals = [0, 99]
        elif f.type == FD.TYPE_MESSAGE and f.message_type.full_name == "rlfleet.v1.Tensor":
            vals = list(tensors())
        elif f.type == FD.TYPE_MESSAGE and f.message_type.full_name == "rlfleet.v1.TensorMap":
            vals = []
            for t in tensors():
                m = tensor_pb2.TensorMap()
                m.tensors["state"].CopyFrom(t)
                vals.append(m)
        elif f.type == FD.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
            vt = f.message_type.fields_by_name["value"]
            if vt.type == FD.TYPE_MESSAGE and vt.message_type.full_name == "rlfleet.v1.TensorSpec":
                vals = [
                    {"state": tensor_pb2.TensorSpec(dtype=99, shape=[4])},
                    {"state": tensor_pb2.TensorSpec(dtype=1, shape=[-3])},
                    {"state": tensor_pb2.TensorSpec(dtype=1, shape=[2**40, 2**40])},
                ]
            elif vt.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
                vals = [{"x": float("nan")}, {"": 1.0}]
            elif vt.type == FD.TYPE_STRING:
                vals = [{"traceparent": "garbage"}]
            elif vt.type == FD.TYPE_MESSAGE and vt.message_type.full_name == "rlfleet.v1.Tensor":
                vals = [{"x": t} for t in tensors()]
        elif f.type == FD.TYPE_MESSAGE and depth < 1:
            for label, sub in mutations(f.message_type, depth + 1):
                if label == "empty":
                    continue
                m = cls()
                if f.is_repeated:
                    getattr(m, f.name).add().CopyFrom(sub)
                else:
                    getattr(m, f.name).CopyFrom(sub)
                yield f"{f.name}.{label}", m
            continue
        for v in vals:
            m = cls()
            try:
                if f.type == FD.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
                    target = getattr(m, f.name)
                    for k, x in v.items():
                        if hasattr(x, "CopyFrom"):
                            target[k].CopyFrom(x)
                        else:
                            target[k] = x
                elif f.is_repeated:
                    if f.type == FD.TYPE_MESSAGE:
                        getattr(m, f.name).add().CopyFrom(v)
                    else:
                        getattr(m, f.name).append(v)
                elif f.type == FD.TYPE_MESSAGE:
                    getattr(m, f.name).CopyFrom(v)
                else:
                    setattr(m, f.name, v)
            except (ValueError, TypeError):
                continue
            yield f"{f.name}={str(v)[:30]!r}", m


def _call(ch, svc, m, msg):
    path = f"/{svc.full_name}/{m.name}"
    ser, raw = (lambda x: x.SerializeToString()), (lambda b: b)
    if m.client_streaming and m.server_streaming:
        list(ch.stream_stream(path, ser, raw)(iter([msg]), timeout=30))
    elif m.client_streaming:
        ch.stream_unary(path, ser, raw)(iter([msg]), timeout=30)
    elif m.server_streaming:
        list(ch.unary_stream(path, ser, raw)(msg, timeout=30))
    else:
        ch.unary_unary(path, ser, raw)(msg, timeout=30)


def _fuzz(targets, fill=lambda m, msg, label: None, skip=()):
    bad, calls = [], 0
    for addr, mod, name in targets:
        svc = mod.DESCRIPTOR.services_by_name[name]
        with grpc.insecure_channel(addr) as ch:
            for m in svc.methods:
                if m.name in skip:
                    continue
                for label, msg in mutations(m.input_type):
                    fill(m, msg, label)
                    calls += 1
                    try:
                        _call(ch, svc, m, msg)
                    except grpc.RpcError as e:
                        if e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                            bad.append((name, m.name, label, e.code().name, e.details()[:200]))
    return bad, calls


def test_fleet_services_answer_malformed_requests_with_named_errors(fleet):
    rs = rollout_pb2_grpc.RolloutServiceStub(channels.channel(fleet.env_addr))
    spec = rs.Describe(env_pb2.DescribeEnvRequest())
    learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr)).PublishWeights(
        learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[fleet.inf_addr])
    )

    def fill(m, msg, label):  # reach past the "no inference server given" check
        if m.name in ("Collect", "Evaluate") and label != "empty" and "inference_addresses" not in label:
            msg.inference_addresses.append(fleet.inf_addr)
            if m.name == "Collect" and not msg.learner_address:
                msg.learner_address = fleet.learner_addr

    bad, calls = _fuzz(
        [
            (fleet.env_addr, env_pb2, "EnvService"),
            (fleet.env_addr, rollout_pb2, "RolloutService"),
            (fleet.inf_addr, inference_pb2, "InferenceService"),
            (fleet.learner_addr, learner_pb2, "LearnerService"),
        ],
        fill,
        skip=("Close",),
    )
    assert calls > 200
    assert not bad, "\n".join(map(str, bad))
    assert rs.Describe(env_pb2.DescribeEnvRequest()).num_envs > 0  # still serving


def test_coordinator_answers_malformed_requests_with_named_errors(cfg, tmp_path):
    from services.coordinator.coordinator import Coordinator
    from services.coordinator.server import serve

    coord = Coordinator(cfg, tmp_path / "run", quiet=True)
    server = serve(coord, "127.0.0.1:0")
    try:
        bad, calls = _fuzz([(coord.address, coordinator_pb2, "CoordinatorService")])
    finally:
        server.stop(0)
    assert calls > 30
    assert not bad, "\n".join(map(str, bad))


# --- issue 25: bad inputs found by outside users (each reproduced on a standalone fleet) ---------------------------
def _rollout(field=None, value=None, shape=None):
    from rlfleet.wire.codec import Rollout
    from tests.services.learner.test_learner import fake_rollout

    tm, pe, eps = fake_rollout(T=8)
    if shape is not None:
        tm[field] = np.zeros(shape, tm[field].dtype)
    elif field is not None:
        tm[field] = tm[field].copy()
        tm[field].reshape(-1)[0] = value
    return Rollout(tm, pe, eps)


def _push(fleet, rollout, worker=0):
    from rlfleet.wire.clients import rollout_chunks

    stub = learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr))
    stub.PushRollout(rollout_chunks(rollout, 0, worker, "issue25"), timeout=30)


def _collect(fleet, **fields):
    req = {
        "epoch": 0,
        "num_steps": 4,
        "inference_addresses": [fleet.inf_addr],
        "learner_address": fleet.learner_addr,
        **fields,
    }
    rollout_pb2_grpc.RolloutServiceStub(channels.channel(fleet.env_addr)).Collect(
        rollout_pb2.CollectRequest(**req), timeout=30
    )


def _huge_space(fleet, to):
    from rlfleet.policies.models.actor_critic import ActorCritic
    from rlfleet.v1 import inference_pb2_grpc
    from rlfleet.wire import weights
    from rlfleet.wire.spaces import TensorSpace

    huge = tensor_pb2.TensorSpec(dtype=codec.DType.FLOAT32, shape=[2**31])  # exactly the codec's limit
    if to == "learner":
        spec = env_pb2.EnvSpec()
        spec.observation_space["state"].CopyFrom(huge)
        spec.action_space.CopyFrom(tensor_pb2.TensorSpec(dtype=codec.DType.FLOAT32, shape=[4]))
        learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr)).PublishWeights(
            learner_pb2.PublishWeightsRequest(env_spec=spec), timeout=30
        )
    else:
        state = ActorCritic({"state": TensorSpace((13,), "float32")}, 4, hidden_dims=[8]).state_dict()
        inference_pb2_grpc.InferenceServiceStub(channels.channel(fleet.inf_addr)).UpdateWeights(
            weights.iter_chunks(state, 7, obs_specs={"state": TensorSpace((2**31,), "float32")}, action_dim=4),
            timeout=30,
        )


def _dead():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


DEAD = _dead()
I, F, U = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE
ISSUE_25 = [  # (what, call, status, text the answer must hold); run in this order against one fleet
    (
        "PublishWeights: a 2**31-element observation space",
        lambda f: _huge_space(f, "learner"),
        I,
        "env_spec.observation_space: one observation row declares 8192 MiB",
    ),
    (
        "UpdateWeights: a 2**31-element observation space",
        lambda f: _huge_space(f, "inference"),
        I,
        "observation_space: one observation row declares 8192 MiB",
    ),
    ("PushRollout: values 3e38", lambda f: _push(f, _rollout("values", 3e38)), I, "rollout['values']: value 3e+38"),
    ("PushRollout: actions 3e38", lambda f: _push(f, _rollout("actions", 3e38)), I, "rollout['actions']: value 3e+38"),
    ("PushRollout: rewards 3e38", lambda f: _push(f, _rollout("rewards", 3e38)), I, "rollout['rewards']: value 3e+38"),
    (
        "PushRollout: values [T, N, 3]",
        lambda f: _push(f, _rollout("values", shape=(8, 8, 3))),
        I,
        "rollout['values']: shape [8, 8, 3] where [8, 8] was expected",
    ),
    (
        "PushRollout: terminated [T, N, 3]",
        lambda f: _push(f, _rollout("terminated", shape=(8, 8, 3))),
        I,
        "rollout['terminated']: shape [8, 8, 3]",
    ),
    (
        "PushRollout: truncated [T, N, 3]",
        lambda f: _push(f, _rollout("truncated", shape=(8, 8, 3))),
        I,
        "rollout['truncated']: shape [8, 8, 3]",
    ),
    (
        "PushRollout: fi.actions of width 7",
        lambda f: _push(f, _rollout("fi.actions", shape=(8, 8, 7))),
        I,
        "rollout['fi.actions']: float32 [8, 8, 7] where float [8, 8, *[4]] was expected",
    ),
    (
        "PushRollout: an all-false loss_mask",
        lambda f: _push(f, _rollout("loss_mask", shape=(8, 8))),
        I,
        "rollout['loss_mask']: all 64 samples are masked out",
    ),
    (
        "PushRollout: worker 40 of a 1-server run",
        lambda f: _push(f, _rollout(), worker=40),
        I,
        "worker_index: 40 is not one of this run's env servers (0..0",
    ),
    (
        "Collect: an unreachable learner_address",
        lambda f: _collect(f, learner_address=DEAD),
        U,
        f"learner_address: no learner answered at {DEAD}",
    ),
    (
        "Collect: the learner refuses the rollout",
        lambda f: _collect(f, epoch=10**9),
        I,
        "did not take the rollout of epoch 1000000000: INVALID_ARGUMENT: epoch: a rollout for epoch 1000000000",
    ),
    (
        "Collect: min_weights_version far ahead",
        lambda f: _collect(f, min_weights_version=2**40),
        F,
        "min_weights_version: inference served weights version 0",
    ),
    (
        "Collect: garbage inference address",
        lambda f: _collect(f, inference_addresses=["[unclosed: {"]),
        I,
        "inference_addresses[0]: '[unclosed: {' is not an address",
    ),
    (
        "Collect: unreachable inference address",
        lambda f: _collect(f, inference_addresses=[DEAD]),
        U,
        f"inference server {DEAD} did not answer",
    ),
]


def test_issue_25_inputs_get_named_statuses_and_lose_nothing(fleet, monkeypatch):
    from rlfleet.wire import clients as policy_client
    from services.env import server as env_server

    monkeypatch.setattr(env_server, "LEARNER_CONNECT_TIMEOUT_S", 2.0)
    monkeypatch.setattr(policy_client, "CONNECT_TIMEOUT_S", 2.0)
    rs = rollout_pb2_grpc.RolloutServiceStub(channels.channel(fleet.env_addr))
    lstub = learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr))
    wrong = []
    for i, (what, call, code, text) in enumerate(ISSUE_25):
        if i == 2:  # the policy's spaces from here on (after the two space cases)
            lstub.PublishWeights(
                learner_pb2.PublishWeightsRequest(
                    env_spec=rs.Describe(env_pb2.DescribeEnvRequest()), inference_addresses=[fleet.inf_addr]
                )
            )
            _push(fleet, _rollout())  # good data before the bad: it must be kept
        try:
            call(fleet)
            wrong.append((what, "accepted"))
        except grpc.RpcError as e:
            if e.code() != code or text not in e.details():
                wrong.append((what, e.code().name, e.details()[:300]))
    assert not wrong, "\n".join(map(str, wrong))
    assert (0, 0) in fleet.learner.rollouts.pending and list(fleet.learner.rollouts.pending) == [(0, 0)]
    assert fleet.learner.rollouts.pending[(0, 0)]["time"]["rewards"].shape == (8, 8)
    # every server still serves: a real epoch collects and trains
    _collect(fleet)
    resp = lstub.Train(
        learner_pb2.TrainRequest(epoch=0, worker_indices=[0], inference_addresses=[fleet.inf_addr]), timeout=60
    )
    assert resp.weights_version == 1 and fleet.engine.version == 1
    assert lstub.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(), timeout=60).path


def _garbage(targets):
    """Bytes that are no protobuf message, as every method's request: never INTERNAL or UNKNOWN."""
    bad, calls = [], 0
    raw = lambda b: b  # noqa: E731
    for addr, mod, name in targets:
        svc = mod.DESCRIPTOR.services_by_name[name]
        with grpc.insecure_channel(addr) as ch:
            for m in svc.methods:
                path, body = f"/{svc.full_name}/{m.name}", b"\xff\xff\xff\xff\x0f"
                calls += 1
                try:
                    if m.client_streaming and m.server_streaming:
                        list(ch.stream_stream(path, raw, raw)(iter([body]), timeout=30))
                    elif m.client_streaming:
                        ch.stream_unary(path, raw, raw)(iter([body]), timeout=30)
                    elif m.server_streaming:
                        list(ch.unary_stream(path, raw, raw)(body, timeout=30))
                    else:
                        ch.unary_unary(path, raw, raw)(body, timeout=30)
                    bad.append((name, m.name, "OK"))
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.INVALID_ARGUMENT or "not a valid" not in e.details():
                        bad.append((name, m.name, e.code().name, e.details()[:200]))
    return bad, calls


def test_bytes_that_are_no_message_get_invalid_argument(fleet, cfg, tmp_path):
    """gRPC answers a request it cannot parse with INTERNAL; every rlfleet server says INVALID_ARGUMENT instead,
    naming the message type, and keeps serving."""
    from services.coordinator.coordinator import Coordinator
    from services.coordinator.server import serve

    coord = Coordinator(cfg, tmp_path / "run", quiet=True)
    server = serve(coord, "127.0.0.1:0")
    try:
        bad, calls = _garbage(
            [
                (fleet.env_addr, env_pb2, "EnvService"),
                (fleet.env_addr, rollout_pb2, "RolloutService"),
                (fleet.inf_addr, inference_pb2, "InferenceService"),
                (fleet.learner_addr, learner_pb2, "LearnerService"),
                (coord.address, coordinator_pb2, "CoordinatorService"),
            ]
        )
    finally:
        server.stop(0)
    assert calls > 20
    assert not bad, "\n".join(map(str, bad))
    rs = rollout_pb2_grpc.RolloutServiceStub(channels.channel(fleet.env_addr))
    assert rs.Describe(env_pb2.DescribeEnvRequest()).num_envs > 0  # still serving

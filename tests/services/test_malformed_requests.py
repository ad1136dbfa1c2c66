"""Malformed requests against every RPC of every service: each is answered with a status naming the problem
(INVALID_ARGUMENT, FAILED_PRECONDITION, ...), never INTERNAL or UNKNOWN, and the servers keep serving.

Each field of each request type is set, one at a time, to an edge value: negative, huge, NaN, empty or odd
strings, unknown enum values, tensors with unknown dtypes, 0-d, overflowing or negative shapes, bad specs."""

import grpc
import numpy as np
from google.protobuf.descriptor import FieldDescriptor as FD

from rlfleet import codec, rpc
from rlfleet.v1 import (coordinator_pb2, env_pb2, inference_pb2, learner_pb2, learner_pb2_grpc, rollout_pb2,
                        rollout_pb2_grpc, tensor_pb2)


def tensors():
    yield codec.Tensor(dtype=99, shape=[1], data=b"\0\0\0\0")
    yield codec.Tensor(dtype=codec.DType.FLOAT32, shape=[], data=b"\0\0\0\0")
    yield codec.Tensor(dtype=codec.DType.FLOAT32, shape=[2**32, 2**32], data=b"")
    yield codec.Tensor(dtype=codec.DType.FLOAT32, shape=[-1], data=b"")
    yield codec.encode(np.full((1, 4), np.nan, np.float32))
    yield codec.encode(np.zeros((3,), np.int64))

def mutations(desc, depth=0):
    """(label, message) with one field set to an edge value."""
    cls = desc._concrete_class
    yield "empty", cls()
    for f in desc.fields:
        vals = []
        if f.type in (FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_SINT32, FD.TYPE_SINT64):
            vals = [-1, -2**31 if f.type in (FD.TYPE_INT32, FD.TYPE_SINT32) else -2**62, 2**31 - 1 if f.type in (FD.TYPE_INT32, FD.TYPE_SINT32) else 2**62]
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
                m = tensor_pb2.TensorMap(); m.tensors["state"].CopyFrom(t); vals.append(m)
        elif f.type == FD.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
            vt = f.message_type.fields_by_name["value"]
            if vt.type == FD.TYPE_MESSAGE and vt.message_type.full_name == "rlfleet.v1.TensorSpec":
                vals = [{"state": tensor_pb2.TensorSpec(dtype=99, shape=[4])}, {"state": tensor_pb2.TensorSpec(dtype=1, shape=[-3])}, {"state": tensor_pb2.TensorSpec(dtype=1, shape=[2**40, 2**40])}]
            elif vt.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
                vals = [{"x": float("nan")}, {"": 1.0}]
            elif vt.type == FD.TYPE_STRING:
                vals = [{"traceparent": "garbage"}]
            elif vt.type == FD.TYPE_MESSAGE and vt.message_type.full_name == "rlfleet.v1.Tensor":
                vals = [{"x": t} for t in tensors()]
        elif f.type == FD.TYPE_MESSAGE and depth < 1:
            for label, sub in mutations(f.message_type, depth + 1):
                if label == "empty": continue
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
                        if hasattr(x, "CopyFrom"): target[k].CopyFrom(x)
                        else: target[k] = x
                elif f.is_repeated:
                    if f.type == FD.TYPE_MESSAGE: getattr(m, f.name).add().CopyFrom(v)
                    else: getattr(m, f.name).append(v)
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
    rs = rollout_pb2_grpc.RolloutServiceStub(rpc.channel(fleet.env_addr))
    spec = rs.Describe(env_pb2.DescribeEnvRequest())
    learner_pb2_grpc.LearnerServiceStub(rpc.channel(fleet.learner_addr)).PublishWeights(
        learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[fleet.inf_addr]))

    def fill(m, msg, label):  # reach past the "no inference server given" check
        if m.name in ("Collect", "Evaluate") and label != "empty" and "inference_addresses" not in label:
            msg.inference_addresses.append(fleet.inf_addr)
            if m.name == "Collect" and not msg.learner_address:
                msg.learner_address = fleet.learner_addr

    bad, calls = _fuzz([(fleet.env_addr, env_pb2, "EnvService"), (fleet.env_addr, rollout_pb2, "RolloutService"),
                        (fleet.inf_addr, inference_pb2, "InferenceService"),
                        (fleet.learner_addr, learner_pb2, "LearnerService")], fill, skip=("Close",))
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

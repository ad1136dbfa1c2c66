"""EnvService and RolloutService over real gRPC on loopback."""

import queue

import grpc
import numpy as np
import pytest

from rlfleet import codec, rpc
from rlfleet.v1 import env_pb2, env_pb2_grpc


@pytest.fixture
def env_stub(fleet):
    ch = rpc.channel(fleet.env_addr)
    yield env_pb2_grpc.EnvServiceStub(ch)
    ch.close()


def step_stream(stub, requests):
    q = queue.SimpleQueue()
    for r in requests:
        q.put(r)
    q.put(None)
    return stub.Step(iter(q.get, None))


def test_describe_reset_step(env_stub, cfg):
    spec = env_stub.Describe(env_pb2.DescribeEnvRequest())
    assert spec.env_id == "PandaPickCube-v0" and spec.num_envs == cfg.env.train.total_num_envs
    assert list(spec.observation_space["state"].shape) == [13] and list(spec.action_space.shape) == [4]
    obs = codec.decode_map(env_stub.Reset(env_pb2.ResetRequest(env_ids=[0, 1], seeds=[3, 4])).observations)
    assert obs["state"].shape == (2, 13)
    reqs = [env_pb2.StepRequest(env_ids=[0, 1], actions=codec.encode(np.zeros((2, 4), np.float32)))] * 3
    responses = list(step_stream(env_stub, reqs))
    assert len(responses) == 3
    assert codec.decode(responses[-1].rewards).shape == (2,)


def _expect_invalid(call, match):
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert match in err.value.details(), err.value.details()


def test_bad_requests_get_invalid_argument_and_server_survives(env_stub):
    nan = np.zeros((1, 4), np.float32)
    nan[0, 0] = np.nan
    _expect_invalid(lambda: list(step_stream(env_stub, [env_pb2.StepRequest(env_ids=[0], actions=codec.encode(nan))])),
                    "actions: non-finite value nan")
    _expect_invalid(lambda: list(step_stream(env_stub, [env_pb2.StepRequest(
        env_ids=[0], actions=codec.encode(np.zeros((1, 5), np.float32)))])), "actions: shape [1, 5]")
    malformed = codec.encode(np.zeros((1, 4), np.float32))
    malformed.data = b"\x00" * 3
    _expect_invalid(lambda: list(step_stream(env_stub, [env_pb2.StepRequest(env_ids=[0], actions=malformed)])),
                    "actions: 3 data bytes do not match shape [1, 4]")
    _expect_invalid(lambda: list(step_stream(env_stub, [env_pb2.StepRequest(
        env_ids=[0], actions=codec.encode(np.zeros((1, 4), np.int64)))])), "dtype INT64 where FLOAT32")
    _expect_invalid(lambda: env_stub.Reset(env_pb2.ResetRequest(env_ids=[99])), "env_ids: unknown env id 99")
    _expect_invalid(lambda: env_stub.Reset(env_pb2.ResetRequest(env_ids=[0, 1], seeds=[1])), "seeds: 1 seeds for 2 envs")
    # still serving
    assert env_stub.Describe(env_pb2.DescribeEnvRequest()).num_envs > 0
    out = list(step_stream(env_stub, [env_pb2.StepRequest(env_ids=[0], actions=codec.encode(np.zeros((1, 4), np.float32)))]))
    assert len(out) == 1


def test_rollout_worker_in_front_of_external_env(cfg, tmp_path, fleet):
    """A bridge: the rollout worker drives an external EnvService (here: the first fleet's env server)."""
    from tests.conftest import Fleet

    bridge = Fleet(cfg, tmp_path / "bridge_run", external_env=fleet.env_addr)
    try:
        from rlfleet.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc

        rstub = rollout_pb2_grpc.RolloutServiceStub(rpc.channel(bridge.env_addr))
        spec = rstub.Describe(env_pb2.DescribeEnvRequest())
        lstub = learner_pb2_grpc.LearnerServiceStub(rpc.channel(bridge.learner_addr))
        lstub.PublishWeights(learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[bridge.inf_addr]))
        resp = rstub.Collect(rollout_pb2.CollectRequest(epoch=0, num_steps=6, inference_addresses=[bridge.inf_addr],
                                                        learner_address=bridge.learner_addr))
        assert resp.env_steps == 6 * cfg.env.train.total_num_envs
        assert (0, 0) in bridge.learner.pending
    finally:
        bridge.close()

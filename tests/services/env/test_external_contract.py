"""The bridge (services.env.remote) in front of external EnvServices that are old, unusable or misbehaving: real
gRPC servers on loopback, the real rollout worker, inference server and learner (tests.conftest.Fleet).

What the bridge does (docs/env-contract.md#what-rlfleet-does-with-your-server): a server rlfleet cannot use is
refused before anything runs; a server that is up but answers as a failed simulator (INTERNAL, or a response that
breaks the contract) costs the episodes in flight, like a crash, up to MAX_SIMULATOR_FAULTS times in one call, and
then stops the call with its reason; a refusal (INVALID_ARGUMENT, FAILED_PRECONDITION, ...) stops it at once; the
bridge never calls Close."""

from __future__ import annotations

import importlib.util
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from rlfleet.errors import InvalidRequest
from rlfleet.v1 import env_pb2, env_pb2_grpc, learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from rlfleet.wire import channels
from services.env.remote import MAX_SIMULATOR_FAULTS, RemoteVecEnv
from services.env.vec_env_interface import VecEnvInterface
from tests.conftest import Fleet, small_config

ROOT = Path(__file__).resolve().parents[3]


def _example():
    spec = importlib.util.spec_from_file_location(
        "point_reach_example", ROOT / "examples" / "point_reach_env_server.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


example = _example()


class Faulty(example.PointReach):
    """The example server; from its ``at``-th Step response on, ``times`` responses go wrong as ``fault`` says."""

    def __init__(self, num_envs: int, fault: str | None = None, at: int = 4, times: int = 1, **describe):
        super().__init__(num_envs, 30)
        self.fault, self.at, self.times, self.describe = fault, at, times, describe
        self.responses = self.close_calls = self.resets = 0

    def Describe(self, request, context):
        spec = super().Describe(request, context)
        for key, value in self.describe.items():
            setattr(spec, key, value)
        return spec

    def Reset(self, request, context):
        self.resets += 1
        return super().Reset(request, context)

    def Step(self, request_iterator, context):
        for resp in super().Step(request_iterator, context):
            self.responses += 1
            if self.fault and self.responses >= self.at and self.times > 0:
                self.times -= 1
                if self.fault == "malformed":  # 3 reward cells for a request of 4 rows
                    resp.rewards.shape[:] = [len(resp.rewards.data) // 4 - 1]
                    resp.rewards.data = resp.rewards.data[:-4]
                elif self.fault == "internal":
                    context.abort(grpc.StatusCode.INTERNAL, "physics step failed: the solver diverged")
                elif self.fault == "refused":
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the envs were closed (Close)")
            yield resp

    def Close(self, request, context):
        self.close_calls += 1
        return super().Close(request, context)


def _serve(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=12))
    env_pb2_grpc.add_EnvServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def cfg8():
    return small_config("cluster.external_env_reconnect_timeout_s=10", "rollout.pipeline_stage_num=2")


def _collect(fleet, num_steps=12):
    rstub = rollout_pb2_grpc.RolloutServiceStub(channels.channel(fleet.env_addr))
    spec = rstub.Describe(env_pb2.DescribeEnvRequest())
    learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr)).PublishWeights(
        learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[fleet.inf_addr])
    )
    return rstub.Collect(
        rollout_pb2.CollectRequest(
            epoch=0, num_steps=num_steps, inference_addresses=[fleet.inf_addr], learner_address=fleet.learner_addr
        ),
        timeout=120,
    )


@pytest.mark.parametrize("fault", ["malformed", "internal"])
def test_a_bad_answer_mid_rollout_costs_the_episodes_in_flight_not_the_run(cfg8, tmp_path, capsys, fault):
    sim = Faulty(8, fault, at=5, times=MAX_SIMULATOR_FAULTS)
    server, address = _serve(sim)
    fleet = Fleet(cfg8, tmp_path / "run", external_env=address)
    try:
        resets_before = sim.resets
        resp = _collect(fleet)
        assert resp.env_steps == 12 * 8 and resp.lost_episodes == 8 * MAX_SIMULATOR_FAULTS
        assert (0, 0) in fleet.learner.rollouts.pending  # the epoch was collected again, whole
        assert sim.resets > resets_before  # fresh episodes after each loss
        out = capsys.readouterr().out
        says = (
            "sent a bad StepResponse: rewards"
            if fault == "malformed"
            else "INTERNAL: physics step failed: the solver diverged"
        )
        assert says in out and "episodes in flight are lost" in out, out
    finally:
        fleet.close()
        server.stop(0)
    assert sim.close_calls == 0


def test_a_server_that_keeps_answering_badly_stops_the_call_with_the_reason(cfg8, tmp_path):
    server, address = _serve(Faulty(8, "malformed", at=3, times=10**6))
    fleet = Fleet(cfg8, tmp_path / "run", external_env=address)
    try:
        with pytest.raises(grpc.RpcError) as err:
            _collect(fleet)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details()
        assert f"external env {address} sent a bad StepResponse: rewards" in details, details
        assert f"simulator failure {MAX_SIMULATOR_FAULTS + 1} in one call" in details, details
    finally:
        fleet.close()
        server.stop(0)


def test_a_refusal_mid_rollout_stops_at_once_with_the_server_message(cfg8, tmp_path):
    sim = Faulty(8, "refused", at=3)
    server, address = _serve(sim)
    fleet = Fleet(cfg8, tmp_path / "run", external_env=address)
    try:
        with pytest.raises(grpc.RpcError) as err:
            _collect(fleet)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            "refused Step: FAILED_PRECONDITION: the envs were closed (Close) (was it closed? rlfleet never "
            "calls Close" in err.value.details()
        ), err.value.details()
    finally:
        fleet.close()
        server.stop(0)


@pytest.mark.parametrize(
    "describe,chunk,says",
    [
        ({"contract_version": "7"}, 1, "EnvSpec.contract_version is '7'; rlfleet knows versions '0', '1'"),
        (
            {"max_action_chunk": 0},
            2,
            "EnvSpec.max_action_chunk is 0 (0 reads as 1); the policy acts in chunks of 2 "
            "(actor.model.num_action_chunks) (docs/env-contract.md#action-chunks)",
        ),
        ({"max_episode_steps": 0}, 1, "EnvSpec.max_episode_steps is 0; must be >= 1"),
    ],
)
def test_a_server_rlfleet_cannot_use_is_refused_when_the_bridge_starts(describe, chunk, says):
    server, address = _serve(Faulty(4, **describe))
    try:
        with pytest.raises(InvalidRequest) as err:
            RemoteVecEnv(address, timeout=10, policy_chunk=chunk)
        assert f"external env {address} cannot be used: {says}" in str(err.value), str(err.value)
        assert "docs/env-contract.md#" in str(err.value)
    finally:
        server.stop(0)


def test_zero_values_of_later_fields_read_as_their_defaults():
    """A version-1 server that leaves max_action_chunk, max_step_streams and simulator unset: chunk 1, one
    stream, 'external'; the bridge runs it."""
    server, address = _serve(Faulty(4, max_action_chunk=0, max_step_streams=0, simulator=""))
    try:
        env = RemoteVecEnv(address, timeout=10)
        assert (env.max_action_chunk, env.simulator, env.contract_version) == (1, "external", "1")
        assert isinstance(env, VecEnvInterface) and env.observation_space
        assert env.view.max_step_streams == 1 and not env.view.streams_stated
        env.reset()
        env.close()
    finally:
        server.stop(0)

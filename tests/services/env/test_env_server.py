"""EnvService and RolloutService over real gRPC on loopback."""

import queue

import grpc
import numpy as np
import pytest

from rlfleet.v1 import env_pb2, env_pb2_grpc
from rlfleet.wire import channels, codec, servers


@pytest.fixture
def env_stub(fleet):
    ch = channels.channel(fleet.env_addr)
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
    _expect_invalid(
        lambda: list(step_stream(env_stub, [env_pb2.StepRequest(env_ids=[0], actions=codec.encode(nan))])),
        "actions: non-finite value nan",
    )
    _expect_invalid(
        lambda: list(
            step_stream(
                env_stub, [env_pb2.StepRequest(env_ids=[0], actions=codec.encode(np.zeros((1, 5), np.float32)))]
            )
        ),
        "actions: shape [1, 5]",
    )
    malformed = codec.encode(np.zeros((1, 4), np.float32))
    malformed.data = b"\x00" * 3
    _expect_invalid(
        lambda: list(step_stream(env_stub, [env_pb2.StepRequest(env_ids=[0], actions=malformed)])),
        "actions: 3 data bytes do not match shape [1, 4]",
    )
    _expect_invalid(
        lambda: list(
            step_stream(env_stub, [env_pb2.StepRequest(env_ids=[0], actions=codec.encode(np.zeros((1, 4), np.int64)))])
        ),
        "dtype INT64 where FLOAT32",
    )
    _expect_invalid(lambda: env_stub.Reset(env_pb2.ResetRequest(env_ids=[99])), "env_ids: unknown env id 99")
    _expect_invalid(
        lambda: env_stub.Reset(env_pb2.ResetRequest(env_ids=[0, 1], seeds=[1])), "seeds: 1 seeds for 2 envs"
    )
    _expect_invalid(lambda: env_stub.Reset(env_pb2.ResetRequest(env_ids=[0], seeds=[-5])), "seeds: -5 is not in")
    huge = codec.Tensor(dtype=codec.DType.FLOAT32, shape=[2**32, 2**32], data=b"")
    _expect_invalid(
        lambda: list(step_stream(env_stub, [env_pb2.StepRequest(env_ids=[0], actions=huge)])), "more than the limit"
    )
    # still serving
    assert env_stub.Describe(env_pb2.DescribeEnvRequest()).num_envs > 0
    out = list(
        step_stream(env_stub, [env_pb2.StepRequest(env_ids=[0], actions=codec.encode(np.zeros((1, 4), np.float32)))])
    )
    assert len(out) == 1


def test_rollout_worker_in_front_of_external_env(cfg, tmp_path, fleet):
    """A bridge: the rollout worker drives an external EnvService (here: the first fleet's env server)."""
    from tests.conftest import Fleet

    bridge = Fleet(cfg, tmp_path / "bridge_run", external_env=fleet.env_addr)
    try:
        from rlfleet.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc

        rstub = rollout_pb2_grpc.RolloutServiceStub(channels.channel(bridge.env_addr))
        spec = rstub.Describe(env_pb2.DescribeEnvRequest())
        lstub = learner_pb2_grpc.LearnerServiceStub(channels.channel(bridge.learner_addr))
        lstub.PublishWeights(learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[bridge.inf_addr]))
        resp = rstub.Collect(
            rollout_pb2.CollectRequest(
                epoch=0, num_steps=6, inference_addresses=[bridge.inf_addr], learner_address=bridge.learner_addr
            )
        )
        assert resp.env_steps == 6 * cfg.env.train.total_num_envs
        assert (0, 0) in bridge.learner.rollouts.pending
    finally:
        bridge.close()


def test_idle_step_streams_cannot_lock_out_the_server(env_stub, fleet):
    """Streams beyond max_step_streams are refused at once; the server keeps answering (17 used to lock it)."""
    spec = env_stub.Describe(env_pb2.DescribeEnvRequest())
    assert spec.max_step_streams >= 1 and spec.contract_version == "1"
    queues, streams = [], []
    for _ in range(spec.max_step_streams):
        q = queue.SimpleQueue()
        queues.append(q)
        streams.append(env_stub.Step(iter(q.get, None)))
    step = env_pb2.StepRequest(env_ids=[0], actions=codec.encode(np.zeros((1, 4), np.float32)))
    queues[0].put(step)
    assert next(streams[0]).rewards.shape == [1]  # the open streams are live
    with pytest.raises(grpc.RpcError) as err:
        list(step_stream(env_stub, [step]))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "concurrent Step streams" in err.value.details()
    for _ in range(17):  # more callers than the server has threads: each refused, none wedges it
        with pytest.raises(grpc.RpcError):
            list(step_stream(env_stub, [step]))
    assert env_stub.Describe(env_pb2.DescribeEnvRequest(), timeout=5).num_envs > 0
    for q, s in zip(queues, streams):
        q.put(None)
        s.cancel()
    import time

    time.sleep(0.3)
    assert len(list(step_stream(env_stub, [step]))) == 1  # slots are given back


def test_close_is_refused_while_a_rollout_worker_owns_the_envs(env_stub):
    with pytest.raises(grpc.RpcError) as err:
        env_stub.Close(env_pb2.CloseRequest())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _rollout_stub(addr):
    from rlfleet.v1 import rollout_pb2_grpc

    return rollout_pb2_grpc.RolloutServiceStub(channels.channel(addr))


def test_unreachable_inference_fails_collect_in_time_and_the_server_recovers(tmp_path):
    """A Collect pointed at a dead inference address used to wedge the env server for good."""
    import time

    from rlfleet.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2
    from tests.conftest import Fleet, small_config

    cfg = small_config("cluster.act_timeout_s=2.0")
    fleet = Fleet(cfg, tmp_path / "run")
    try:
        rstub = _rollout_stub(fleet.env_addr)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            rstub.Collect(
                rollout_pb2.CollectRequest(
                    epoch=0, num_steps=4, inference_addresses=["127.0.0.1:1"], learner_address=fleet.learner_addr
                ),
                timeout=30,
            )
        assert time.monotonic() - t0 < 10
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "127.0.0.1:1" in err.value.details() and "did not answer within 2s" in err.value.details()
        spec = rstub.Describe(env_pb2.DescribeEnvRequest())
        learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr)).PublishWeights(
            learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[fleet.inf_addr])
        )
        ok = rstub.Collect(
            rollout_pb2.CollectRequest(
                epoch=0, num_steps=4, inference_addresses=[fleet.inf_addr], learner_address=fleet.learner_addr
            ),
            timeout=30,
        )
        assert ok.env_steps == 4 * cfg.env.train.total_num_envs
    finally:
        fleet.close()


def test_evaluate_is_bounded_and_cancellable(fleet):
    import time

    from rlfleet.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2

    rstub = _rollout_stub(fleet.env_addr)
    _expect_invalid(
        lambda: rstub.Evaluate(
            rollout_pb2.EvaluateRequest(num_episodes=10**9, seed=0, inference_addresses=[fleet.inf_addr])
        ),
        "num_episodes: 1000000000 is not in",
    )
    _expect_invalid(
        lambda: rstub.Evaluate(
            rollout_pb2.EvaluateRequest(num_episodes=2, seed=-1, inference_addresses=[fleet.inf_addr])
        ),
        "seed: -1 is not in [0, 2**31)",
    )
    spec = rstub.Describe(env_pb2.DescribeEnvRequest())
    learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr)).PublishWeights(
        learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[fleet.inf_addr])
    )
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:  # 100k episodes would take hours: the deadline stops it
        rstub.Evaluate(
            rollout_pb2.EvaluateRequest(
                num_episodes=100_000, seed=0, deterministic=True, inference_addresses=[fleet.inf_addr]
            ),
            timeout=4,
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 8
    res = rstub.Evaluate(
        rollout_pb2.EvaluateRequest(num_episodes=2, seed=0, deterministic=True, inference_addresses=[fleet.inf_addr]),
        timeout=60,
    )
    assert len(res.episodes) == 2  # the worker is free again


def _joint_spec(spec, state_dim: int, action_dim: int, extra_entry: bool = True):
    """``spec`` (an env server's Describe) as a run over several simulators would widen it."""
    from rlfleet.wire.spaces import TensorSpace

    out = env_pb2.EnvSpec()
    out.CopyFrom(spec)
    out.observation_space["state"].CopyFrom(TensorSpace((state_dim,), np.float32, -10, 10).to_proto())
    if extra_entry:  # an entry only another simulator has (e.g. Meta-World's one-hot task id)
        out.observation_space["task_id"].CopyFrom(TensorSpace((3,), np.float32, 0, 1).to_proto())
    out.action_space.CopyFrom(TensorSpace((action_dim,), np.float32, -1, 1).to_proto())
    return out


def test_collect_and_evaluate_in_the_policy_spaces_of_a_run_over_several_simulators(fleet, cfg):
    """With a policy_spec (the joint spaces of a run whose servers host different simulators) the worker pads
    observations (1-D zero-padded, missing entries zeros), takes the policy's wider actions and executes its own
    first dimensions; Describe still reports the server's own spaces; a policy_spec it cannot fit is refused."""
    from rlfleet.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc

    rstub = rollout_pb2_grpc.RolloutServiceStub(channels.channel(fleet.env_addr))
    own = rstub.Describe(env_pb2.DescribeEnvRequest())
    own_state, own_action = own.observation_space["state"].shape[0], own.action_space.shape[0]
    joint = _joint_spec(own, own_state + 5, own_action + 3)
    lstub = learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr))
    lstub.PublishWeights(learner_pb2.PublishWeightsRequest(env_spec=joint, inference_addresses=[fleet.inf_addr]))
    # the policy's extra action dimensions must not reach the simulator: record what it is stepped with
    stepped = []
    inner = fleet.worker.env
    real_step = inner.step
    inner.step = lambda ids, actions: (stepped.append(np.asarray(actions).shape), real_step(ids, actions))[1]
    resp = rstub.Collect(
        rollout_pb2.CollectRequest(
            epoch=0,
            num_steps=4,
            inference_addresses=[fleet.inf_addr],
            learner_address=fleet.learner_addr,
            policy_spec=joint,
        )
    )
    assert resp.env_steps == 4 * cfg.env.train.total_num_envs
    part = fleet.learner.rollouts.pending[(0, 0)]["time"]
    n = cfg.env.train.total_num_envs
    assert part["obs.state"].shape == (4, n, own_state + 5) and not part["obs.state"][..., own_state:].any()
    assert part["obs.state"][..., :own_state].any()
    assert part["obs.task_id"].shape == (4, n, 3) and not part["obs.task_id"].any()
    assert part["actions"].shape[-1] == own_action + 3
    assert stepped and all(s[-1] == own_action for s in stepped)
    assert rstub.Describe(env_pb2.DescribeEnvRequest()).action_space.shape[0] == own_action
    ev = rstub.Evaluate(
        rollout_pb2.EvaluateRequest(
            num_episodes=2, seed=7, deterministic=True, inference_addresses=[fleet.inf_addr], policy_spec=joint
        )
    )
    assert len(ev.episodes) == 2
    small = _joint_spec(own, own_state - 1, own_action, extra_entry=False)
    _expect_invalid(
        lambda: rstub.Collect(
            rollout_pb2.CollectRequest(
                epoch=1,
                num_steps=2,
                inference_addresses=[fleet.inf_addr],
                learner_address=fleet.learner_addr,
                policy_spec=small,
            )
        ),
        "policy_spec: env[0] (gym:PandaPickCube-v0) cannot act in the run's policy spaces: observation 'state'",
    )


# --- issue 25: Collect's peers unreachable, refusing or slow ------------------------------------------------------
def _dead_address() -> str:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def _published(fleet):
    from rlfleet.v1 import learner_pb2, learner_pb2_grpc

    rstub = _rollout_stub(fleet.env_addr)
    spec = rstub.Describe(env_pb2.DescribeEnvRequest())
    learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr)).PublishWeights(
        learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[fleet.inf_addr])
    )
    return rstub


def _collect_error(rstub, timeout=30, **fields):
    from rlfleet.v1 import rollout_pb2

    with pytest.raises(grpc.RpcError) as err:
        rstub.Collect(rollout_pb2.CollectRequest(**{"epoch": 0, "num_steps": 4, **fields}), timeout=timeout)
    return err.value


def test_collect_names_what_is_wrong_with_its_peers_and_the_worker_stays_free(fleet, monkeypatch):
    """An unreachable learner held the worker ~300 s; a learner's refusal came back UNKNOWN with raw
    _InactiveRpcError text; a far min_weights_version and bad inference addresses came back INTERNAL."""
    import time

    from rlfleet.v1 import rollout_pb2
    from rlfleet.wire import clients as policy_client
    from services.env import server as env_server

    monkeypatch.setattr(env_server, "LEARNER_CONNECT_TIMEOUT_S", 2.0)
    monkeypatch.setattr(policy_client, "CONNECT_TIMEOUT_S", 2.0)
    rstub = _published(fleet)
    good = dict(inference_addresses=[fleet.inf_addr], learner_address=fleet.learner_addr)
    dead = _dead_address()
    t0 = time.monotonic()
    e = _collect_error(rstub, **dict(good, learner_address=dead))
    assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
    assert e.details() == f"learner_address: no learner answered at {dead} within 2s (unreachable)"
    assert time.monotonic() - t0 < 8  # before any step was collected for it
    e = _collect_error(rstub, **dict(good, epoch=10**9))  # the learner refuses the rollout: its status, named
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert e.details().startswith(
        f"the learner at {fleet.learner_addr} did not take the rollout of epoch "
        f"1000000000: INVALID_ARGUMENT: epoch: a rollout for epoch 1000000000"
    )
    assert "_InactiveRpcError" not in e.details()
    e = _collect_error(rstub, **dict(good, min_weights_version=10**6))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
    assert "min_weights_version: inference served weights version 0; epoch 0 needs version >= 1000000" in e.details()
    for garbage in ("x" * 1000, "\x00", "[unclosed: {", ""):
        e = _collect_error(rstub, **dict(good, inference_addresses=[fleet.inf_addr, garbage]))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("inference_addresses[1]: ")
        e = _collect_error(rstub, **dict(good, learner_address=garbage))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("learner_address: ")
    e = _collect_error(rstub, **dict(good, inference_addresses=[dead]))
    assert e.code() == grpc.StatusCode.UNAVAILABLE and f"inference server {dead} did not answer" in e.details()
    ok = rstub.Collect(rollout_pb2.CollectRequest(epoch=0, num_steps=4, **good), timeout=30)
    assert ok.env_steps == 4 * fleet.worker.env.num_envs and (0, 0) in fleet.learner.rollouts.pending


def test_a_learner_that_never_answers_costs_the_caller_its_deadline_not_the_worker(fleet):
    """The push to the learner ends with the caller's deadline (it used to wait 300 s, holding the worker: a valid
    Collect after it waited 270 s)."""
    import threading
    import time

    from rlfleet.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2

    release = threading.Event()

    class Stuck(learner_pb2_grpc.LearnerServiceServicer):
        def PushRollout(self, request_iterator, context):
            for _ in request_iterator:
                pass
            release.wait(120)  # takes the rollout, never answers
            return learner_pb2.PushRolloutResponse()

    stuck = servers.make_server(max_workers=4)
    learner_pb2_grpc.add_LearnerServiceServicer_to_server(Stuck(), stuck)
    stuck_addr = servers.bind(stuck, "127.0.0.1:0")
    stuck.start()
    try:
        rstub = _published(fleet)
        t0 = time.monotonic()
        e = _collect_error(rstub, timeout=6, inference_addresses=[fleet.inf_addr], learner_address=stuck_addr)
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        ok = rstub.Collect(
            rollout_pb2.CollectRequest(
                epoch=0, num_steps=4, inference_addresses=[fleet.inf_addr], learner_address=fleet.learner_addr
            ),
            timeout=30,
        )
        assert ok.env_steps > 0 and time.monotonic() - t0 < 15
    finally:
        release.set()
        stuck.stop(0)


def test_a_collocated_collect_waits_for_the_weights_it_needs(tmp_path):
    """The coordinator sends a synchronous epoch's Collect to a collocated env server while the learner still
    trains on the epoch before (weights_wait_s): the server steps once the learner's update publishes the version
    the Collect needs. Without the field an older policy still fails the call at once; a wait that runs out, or a
    bad wait, is named."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from rlfleet.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc
    from tests.conftest import Fleet, small_config

    cfg = small_config("cluster.component_placement.rollout=env", "rollout.pipeline_stage_num=1")
    fleet = Fleet(cfg, tmp_path / "run")
    try:
        rstub = rollout_pb2_grpc.RolloutServiceStub(channels.channel(fleet.env_addr))
        lstub = learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr))
        spec = rstub.Describe(env_pb2.DescribeEnvRequest())
        v0 = lstub.PublishWeights(
            learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[fleet.env_addr])
        ).weights_version

        def collect(epoch, **fields):
            request = rollout_pb2.CollectRequest(
                epoch=epoch, num_steps=16, learner_address=fleet.learner_addr, **fields
            )
            return rstub.Collect(request, timeout=90)

        assert collect(0, min_weights_version=v0).weights_version == v0
        with pytest.raises(grpc.RpcError) as err:  # no wait asked for: as before
            collect(1, min_weights_version=v0 + 1)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"needs version >= {v0 + 1}" in err.value.details()
        with ThreadPoolExecutor(1) as pool:
            ahead = pool.submit(collect, 1, min_weights_version=v0 + 1, weights_wait_s=60)
            time.sleep(1.0)
            assert not ahead.done()  # waiting for the weights, not stepping older ones
            trained = lstub.Train(
                learner_pb2.TrainRequest(epoch=0, worker_indices=[0], inference_addresses=[fleet.env_addr])
            )
            got = ahead.result(timeout=60)
        assert trained.weights_version == got.weights_version == v0 + 1
        assert got.env_steps == cfg.env.train.total_num_envs * 16
        assert (1, 0) in fleet.learner.rollouts.pending  # pushed to the learner as any epoch
        with pytest.raises(grpc.RpcError) as err:
            collect(2, min_weights_version=v0 + 5, weights_wait_s=0.3)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"weights version {v0 + 5} did not arrive within 0.3 s" in err.value.details()
        assert f"holds version {v0 + 1}" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            collect(2, min_weights_version=v0 + 1, weights_wait_s=-1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "weights_wait_s: -1" in err.value.details()
        assert collect(2, min_weights_version=v0 + 1, weights_wait_s=60).weights_version == v0 + 1  # still free
    finally:
        fleet.close()

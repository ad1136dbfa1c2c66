"""LearnerService over real gRPC: a rollout is committed only when its stream ends cleanly."""

import grpc
import numpy as np
import pytest

from rlfleet.v1 import learner_pb2_grpc
from rlfleet.wire import channels, servers
from rlfleet.wire.clients import push_rollout, rollout_chunks
from rlfleet.wire.codec import Rollout
from tests.services.learner.test_learner import SPECS, fake_rollout


@pytest.fixture
def learner_stub(fleet):
    fleet.learner.setup(SPECS, 4)
    return learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr)), fleet.learner


def test_push_rollout_in_chunks_commits(fleet, learner_stub):
    _, learner = learner_stub
    tm, pe, eps = fake_rollout(T=40)
    resp = push_rollout(fleet.learner_addr, Rollout(tm, pe, eps), 0, 0, "inc")
    assert (resp.num_steps, resp.num_envs) == (40, 8)
    got = learner.rollouts.pending[(0, 0)]
    assert np.array_equal(got["time"]["obs.state"], tm["obs.state"])
    assert got["episodes"] == eps  # EpisodeStat through the EpisodeStats message and back


def test_broken_stream_is_discarded(learner_stub):
    stub, learner = learner_stub
    tm, pe, eps = fake_rollout(T=40)
    chunks = list(rollout_chunks(Rollout(tm, pe, eps), 0, 0, "inc", chunk_bytes=2000))
    assert len(chunks) > 2
    with pytest.raises(grpc.RpcError) as err:
        stub.PushRollout(iter(chunks[:-1]))  # the sender died before its last chunk
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "without a chunk marked last; discarded" in err.value.details()
    reordered = [chunks[1], chunks[0], *chunks[2:]]
    with pytest.raises(grpc.RpcError) as err:
        stub.PushRollout(iter(reordered))
    assert "chunk starts at t=" in err.value.details()
    assert not learner.rollouts.pending


def test_vision_images_flow_through_the_pipeline(tmp_path):
    """PandaPickCubeVision-v0 + CNN policy: images go env -> inference -> learner, one PPO update."""
    from rlfleet.v1 import env_pb2, learner_pb2, rollout_pb2, rollout_pb2_grpc
    from tests.conftest import Fleet, small_config

    cfg = small_config(
        "env.train.env_id=PandaPickCubeVision-v0",
        "env.train.total_num_envs=4",
        "env.train.max_steps_per_rollout_epoch=8",
        "env.train.init_params={image_size: 32}",
        "actor.model.model_type=cnn",
        "actor.micro_batch_size=16",
        "actor.global_batch_size=32",
        "actor.model.image_feature_dim=32",
    )
    fleet = Fleet(cfg, tmp_path / "run")
    try:
        rstub = rollout_pb2_grpc.RolloutServiceStub(channels.channel(fleet.env_addr))
        spec = rstub.Describe(env_pb2.DescribeEnvRequest())
        assert list(spec.observation_space["wrist"].shape) == [32, 32, 3]
        assert spec.task_descriptions[0] == "pick up the red cube and lift it"
        lstub = learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr))
        lstub.PublishWeights(learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[fleet.inf_addr]))
        rstub.Collect(
            rollout_pb2.CollectRequest(
                epoch=0, num_steps=8, inference_addresses=[fleet.inf_addr], learner_address=fleet.learner_addr
            )
        )
        images = fleet.learner.rollouts.pending[(0, 0)]["time"]["obs.third_person"]
        assert images.shape == (8, 4, 32, 32, 3) and images.dtype == np.uint8 and images.std() > 1
        resp = lstub.Train(learner_pb2.TrainRequest(epoch=0, worker_indices=[0], inference_addresses=[fleet.inf_addr]))
        assert resp.weights_version == 1 and np.isfinite(resp.metrics["train/actor/policy_loss"])
        assert fleet.engine.version == 1
    finally:
        fleet.close()


@pytest.mark.parametrize(
    "model, logprob_type",
    [
        ("mlp", "action_level"),
        ("mlp", "token_level"),
        ("mlp", "chunk_level"),
        ("cnn", "token_level"),
        ("openvla", "token_level"),
        ("openvla_oft", "action_level"),
        ("openvla_oft", "chunk_level"),
        ("openpi", "chunk_level"),
        ("openpi", "token_level"),
        ("openpi+pi05+flow_noise", "chunk_level"),
        ("openvla_oft+bf16", "chunk_level"),
        ("openpi+bf16", "chunk_level"),
        ("openvla_oft+bf16+bf16_weights", "token_level"),
    ],
)
def test_learner_recomputes_the_inference_log_probs_exactly(tmp_path, model, logprob_type):
    """First PPO epoch: the learner's recomputed log-probs equal the inference server's (ratio starts at 1)."""
    from rlfleet.v1 import env_pb2, learner_pb2, rollout_pb2, rollout_pb2_grpc
    from tests.conftest import Fleet, small_config

    model, *variant = model.split("+")
    options = {
        "pi05": ["actor.model.openpi.pi05=true", "actor.model.max_prompt_tokens=80"],
        "flow_noise": ["actor.model.openpi.noise_method=flow_noise"],
        "bf16": ["actor.model.precision=bf16"],
        "bf16_weights": ["rollout.weights_precision=bf16"],
    }
    vision = ["env.train.env_id=PandaPickCubeVision-v0", "env.train.init_params={image_size: 32}"]
    chunk = 2 if model in ("openvla_oft", "openpi") else 1
    extra = {
        "mlp": [],
        "cnn": [*vision, "actor.model.image_feature_dim=32"],
        "openvla": [*vision, "actor.model.vla.image_size=32"],
        # OFT: a chunk of 2 actions per call, LoRA adapters only
        "openvla_oft": [
            *vision,
            "actor.model.vla.image_size=32",
            "actor.model.num_action_chunks=2",
            "actor.model.is_lora=true",
            "actor.model.lora_rank=4",
            "env.train.max_steps_per_rollout_epoch=16",
        ],
        "openpi": [*vision, "actor.model.num_action_chunks=2", "env.train.max_steps_per_rollout_epoch=16"],
    }[model]
    cfg = small_config(
        f"actor.model.model_type={model}",
        f"algorithm.logprob_type={logprob_type}",
        "env.train.total_num_envs=4",
        "env.train.max_steps_per_rollout_epoch=8",
        "actor.micro_batch_size=16",
        "actor.global_batch_size=32",
        *extra,
        *[o for v in variant for o in options[v]],
    )
    fleet = Fleet(cfg, tmp_path / "run")
    try:
        rstub = rollout_pb2_grpc.RolloutServiceStub(channels.channel(fleet.env_addr))
        spec = rstub.Describe(env_pb2.DescribeEnvRequest())
        lstub = learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr))
        lstub.PublishWeights(learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[fleet.inf_addr]))
        rstub.Collect(
            rollout_pb2.CollectRequest(
                epoch=0, num_steps=8, inference_addresses=[fleet.inf_addr], learner_address=fleet.learner_addr
            )
        )
        pending = fleet.learner.rollouts.pending[(0, 0)]["time"]
        width = {"action_level": chunk, "chunk_level": 1, "token_level": 4 * chunk}[logprob_type]
        assert pending["log_probs"].shape == (8, 4, width) and pending["actions"].shape == (8, 4, chunk, 4)
        if model == "openpi" and "flow_noise" in variant:  # the whole denoising chain travels
            assert pending["fi.chain"].shape == (8, 4, 5, 2, 32)
        elif model == "openpi":  # the stochastic denoising step travels as forward inputs
            assert pending["fi.x_next"].shape == (8, 4, 2, 32) and pending["fi.denoise_step"].shape == (8, 4)
        if model.startswith("openvla"):  # the prompt and the sampled action tokens travel as forward inputs
            assert pending["fi.action_bins"].shape == (8, 4, 4 * chunk) and pending["fi.prompt_ids"].dtype == np.int64
        resp = lstub.Train(learner_pb2.TrainRequest(epoch=0, worker_indices=[0], inference_addresses=[fleet.inf_addr]))
        # bf16: autocast in both services, at different batch sizes (4-row requests, 16-row micro-batches): 0 here;
        # with the inference server's parameters in bf16 as well: 0.6e-2 (π0) to 1.4e-2 (OFT, token level)
        bound = {"bf16": 1e-3, "bf16_weights": 5e-2}.get(variant[-1] if variant else "", 1e-5)
        assert resp.metrics["train/actor/first_logprob_abs_diff"] < bound
        assert all(np.isfinite(v) for v in resp.metrics.values())
    finally:
        fleet.close()


def test_grpo_groups_share_a_start_and_train_without_a_critic(tmp_path):
    from rlfleet.v1 import env_pb2, learner_pb2, rollout_pb2, rollout_pb2_grpc
    from tests.conftest import Fleet, small_config

    cfg = small_config(
        "algorithm.adv_type=grpo",
        "algorithm.loss_type=actor",
        "algorithm.group_size=4",
        "env.train.auto_reset=false",
        "env.train.max_episode_steps=10",
        "env.train.max_steps_per_rollout_epoch=10",
        "actor.micro_batch_size=40",
        "actor.global_batch_size=80",
        "algorithm.filter_rewards=[-1000.0, 1000.0]",
    )
    fleet = Fleet(cfg, tmp_path / "run")
    try:
        rstub = rollout_pb2_grpc.RolloutServiceStub(channels.channel(fleet.env_addr))
        spec = rstub.Describe(env_pb2.DescribeEnvRequest())
        lstub = learner_pb2_grpc.LearnerServiceStub(channels.channel(fleet.learner_addr))
        lstub.PublishWeights(learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[fleet.inf_addr]))
        for epoch in range(2):
            rstub.Collect(
                rollout_pb2.CollectRequest(
                    epoch=epoch,
                    num_steps=10,
                    inference_addresses=[fleet.inf_addr],
                    learner_address=fleet.learner_addr,
                    min_weights_version=epoch,
                )
            )
            first = fleet.learner.rollouts.pending[(epoch, 0)]["time"]["obs.state"][0]  # [8 envs, 13]
            assert np.allclose(first[:4], first[0]) and np.allclose(first[4:], first[4])  # two groups
            assert not np.allclose(first[0], first[4])
            resp = lstub.Train(
                learner_pb2.TrainRequest(epoch=epoch, worker_indices=[0], inference_addresses=[fleet.inf_addr])
            )
            m = resp.metrics
            assert m["rollout/grpo_groups"] == 2 and np.isfinite(m["train/actor/policy_loss"])
            assert m["train/critic/value_loss"] == 0.0 and "train/critic/explained_variance" not in m
        assert resp.weights_version == 2
    finally:
        fleet.close()


def test_publish_to_a_dead_inference_server_fails_fast(learner_stub):
    """A killed inference server must not hold up Train for the publish timeout: the learner reports the
    failed address at once and the coordinator republishes after the restart."""
    import socket
    import time

    _, learner = learner_stub
    learner.publisher.timeout = 60
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        learner.publish([dead])
    assert time.monotonic() - t0 < 10
    assert dead in str(err.value)


def test_rollouts_for_far_epochs_and_0d_tensors_are_refused_before_buffering(learner_stub):
    from rlfleet.v1 import learner_pb2
    from rlfleet.wire import codec

    stub, learner = learner_stub
    tm, pe, eps = fake_rollout(T=8)
    chunks = list(rollout_chunks(Rollout(tm, pe, eps), 10**9, 0, "inc"))
    with pytest.raises(grpc.RpcError) as err:
        stub.PushRollout(iter(chunks))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "a rollout for epoch 1000000000; this learner trained epoch -1 and accepts epochs 0..1" in err.value.details()
    )
    bad = learner_pb2.RolloutChunk(epoch=0, num_steps=1, last=True)
    codec.encode(np.float32(1.0), bad.data.tensors["rewards"])
    with pytest.raises(grpc.RpcError) as err:
        stub.PushRollout(iter([bad]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "a 0-d tensor" in err.value.details()
    assert not learner.rollouts.pending


# --- issue 25: rollouts that used to be accepted and then broke Train --------------------------------------------
def _bad(field, value=None, shape=None, pe=False):
    def make():
        tm, pe_, eps = fake_rollout(T=8)
        target = pe_ if pe else tm
        if shape is not None:
            target[field] = np.zeros(shape, target[field].dtype)
        else:
            target[field] = target[field].copy()
            target[field].reshape(-1)[3] = value
        return Rollout(tm, pe_, eps)

    return make


BAD_ROLLOUTS = [  # (what, rollout, the field the refusal names)
    ("values 3e38", _bad("values", 3e38), "rollout['values']: value 3e+38"),
    ("actions 3e38", _bad("actions", 3e38), "rollout['actions']: value 3e+38"),
    ("fi.actions -3e38", _bad("fi.actions", -3e38), "rollout['fi.actions']: value -3e+38"),
    ("rewards 3e38", _bad("rewards", 3e38), "rollout['rewards']: value 3e+38"),
    ("next_obs 3e38", _bad("next_obs.state", 3e38, pe=True), "rollout['next_obs.state']: value 3e+38"),
    ("values [T, N, 2]", _bad("values", shape=(8, 8, 2)), "rollout['values']: shape [8, 8, 2] where [8, 8]"),
    ("terminated [T, N, 2]", _bad("terminated", shape=(8, 8, 2)), "rollout['terminated']: shape [8, 8, 2]"),
    (
        "final_obs [M + 1]",
        _bad("final_obs.state", shape=(9, 13), pe=True),
        "rollout['final_obs.state']: float32 [9, 13]",
    ),
    ("fi.actions width 7", _bad("fi.actions", shape=(8, 8, 7)), "rollout['fi.actions']: float32 [8, 8, 7] where"),
    ("all-false loss_mask", _bad("loss_mask", shape=(8, 8)), "rollout['loss_mask']: all 64 samples are masked out"),
]


def test_bad_rollouts_are_refused_naming_the_field_and_good_data_stays(fleet, learner_stub):
    from rlfleet.v1 import learner_pb2

    stub, learner = learner_stub
    good = Rollout(*fake_rollout(T=8))
    stub.PushRollout(rollout_chunks(good, 0, 0, "inc"))  # a good rollout first: it must survive what follows
    for what, make, named in BAD_ROLLOUTS:
        with pytest.raises(grpc.RpcError) as err:
            stub.PushRollout(rollout_chunks(make(), 0, 0, "inc"), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.value.details())
        assert named in err.value.details(), (what, err.value.details())
    assert list(learner.rollouts.pending) == [(0, 0)]
    assert np.array_equal(learner.rollouts.pending[(0, 0)]["time"]["values"], good.time_major["values"])
    for epoch in range(2):  # training goes on, and so do checkpoints
        if epoch:
            stub.PushRollout(rollout_chunks(Rollout(*fake_rollout(T=8, seed=epoch)), epoch, 0, "inc"))
        resp = stub.Train(learner_pb2.TrainRequest(epoch=epoch, worker_indices=[0]), timeout=60)
        assert all(np.isfinite(v) for v in resp.metrics.values())
    assert stub.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(), timeout=60).path


class _FakeCoordinator:
    """CoordinatorService.Status over real gRPC, listing ``envs`` env servers (what the learner asks on a scale-up)."""

    def __init__(self, envs: int):
        from rlfleet.v1 import coordinator_pb2, coordinator_pb2_grpc

        self.envs, self.calls = envs, 0
        outer = self

        class Servicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
            def Status(self, request, context):
                outer.calls += 1
                st = coordinator_pb2.RunStatus()
                for i in range(outer.envs):
                    st.services.add(role=coordinator_pb2.ENV, index=i, address=f"127.0.0.1:{9000 + i}")
                st.services.add(role=coordinator_pb2.LEARNER, index=0, address="127.0.0.1:8999")
                return st

        self.server = servers.make_server(max_workers=2)
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(Servicer(), self.server)
        self.address = servers.bind(self.server, "127.0.0.1:0")
        self.server.start()


def test_rollouts_for_workers_the_run_does_not_have_are_refused_before_buffering(cfg, tmp_path):
    """Worker indices past the run's env servers are refused at the first chunk; a scale-up's new server is
    accepted once the coordinator lists it."""
    import resource

    from services.learner import server as learner_server
    from tests.services.learner.test_learner import SPECS

    coord = _FakeCoordinator(envs=1)
    srv, addr, learner, _ = learner_server.serve(cfg, "127.0.0.1:0", str(tmp_path / "run"), coordinator=coord.address)
    try:
        learner.setup(SPECS, 4)
        learner.rollouts.PROBE_INTERVAL_S = 0.0
        stub = learner_pb2_grpc.LearnerServiceStub(channels.channel(addr))
        big = Rollout(*fake_rollout(T=64))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for worker in (1, 7, 40, 2**31 - 1):
            with pytest.raises(grpc.RpcError) as err:
                stub.PushRollout(rollout_chunks(big, 0, worker, "inc"), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"worker_index: {worker} is not one of this run's env servers (0..0" in err.value.details()
        assert not learner.rollouts.pending and coord.calls >= 1
        coord.envs = 3  # coordinatorctl scale env 3: the new servers are registered before they collect
        for worker in (2, 1, 0):
            stub.PushRollout(rollout_chunks(big, 0, worker, "inc"), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            stub.PushRollout(rollout_chunks(big, 0, 3, "inc"), timeout=30)
        assert "worker_index: 3 is not one of this run's env servers (0..2" in err.value.details()
        assert sorted(learner.rollouts.pending) == [(0, 0), (0, 1), (0, 2)]
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 * 1024  # KiB: nothing piled up
    finally:
        srv.stop(0)
        coord.server.stop(0)
        learner.close()


# --- issue 34: a rollout by shared-memory handle from an env server on this host ----------------------------------------
def test_push_rollout_through_shared_memory_gives_the_grpc_path_bits(fleet, learner_stub):
    from rlfleet.wire import shm
    from rlfleet.wire.clients import WireStats

    _, learner = learner_stub
    before = set(shm.segments_of())  # (other tests' servers in this process may still hold theirs)
    tm, pe, eps = fake_rollout(T=40)
    arena = shm.Arena("rollout", slots=1, min_bytes=0)
    # the observations in the arena's buffers (as the env server keeps them), the rest copied into its ring
    buf = arena.buffers({"obs.state": (tm["obs.state"].shape, np.float32)})["obs.state"]
    buf[:] = tm["obs.state"]
    tm["obs.state"] = buf
    got = {}
    for epoch, use in ((0, None), (1, arena)):
        stats = WireStats()
        push_rollout(fleet.learner_addr, Rollout(tm, pe, eps), epoch, 0, "inc", arena=use, stats=stats)
        got[epoch] = learner.rollouts.pending.pop((epoch, 0))
        assert (stats.shm_bytes > 0) == (use is not None) and stats.bytes > 0
    assert got[1]["time"].keys() == got[0]["time"].keys() == tm.keys()
    for k in tm:
        a, b = got[1]["time"][k], got[0]["time"][k]
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes() == tm[k].tobytes(), k
    assert got[1]["episodes"] == got[0]["episodes"] == eps
    # what the learner keeps is its own copy: the env server may rewrite its buffers once the push returned
    kept = got[1]["time"]["obs.state"].copy()
    tm["obs.state"][:] = 0
    assert np.array_equal(got[1]["time"]["obs.state"], kept)
    arena.close()
    del buf, tm  # the last views of the buffers (this test's): unmapped with them
    assert set(shm.segments_of()) <= before  # and the learner dropped its mappings when the push ended


def test_forged_rollout_handles_are_invalid_argument_naming_the_field(fleet, learner_stub):
    from rlfleet.wire import shm

    stub, learner = learner_stub
    tm, pe, eps = fake_rollout(T=8)
    arena = shm.Arena("forger", slots=1, min_bytes=0)
    (chunk,) = rollout_chunks(Rollout(tm, pe, eps), 0, 0, "inc", arena=arena)
    chunk.data.tensors["obs.state"].shared.key = bytes(16)
    with pytest.raises(grpc.RpcError) as err:
        stub.PushRollout(iter([chunk]))
    arena.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rollout['obs.state'].shared.key: does not match the key of segment" in err.value.details()
    assert not learner.rollouts.pending


def test_a_learners_yes_to_shared_memory_is_asked_once_and_asked_again_when_it_no_longer_holds(
    fleet, learner_stub, tmp_path, monkeypatch
):
    """push_rollout offers shared memory once per learner, not once per push (the offer's round trip came after
    every rollout); a push that fails asks again; and a kept yes that a learner at that address no longer honours
    (here: one started with cluster.shared_memory inline) costs one refused attempt, then the same rollout inline:
    nothing lost."""
    from rlfleet.errors import InvalidRequest
    from rlfleet.wire import clients, shm
    from services.learner import server as learner_server
    from tests.conftest import small_config

    _, learner = learner_stub
    offers = []
    real_offer = clients.offer_shared_memory
    monkeypatch.setattr(clients, "offer_shared_memory", lambda *a, **kw: offers.append(1) or real_offer(*a, **kw))
    arena = shm.Arena("rollout", slots=1, min_bytes=0)
    tm, pe, eps = fake_rollout(T=8)
    for epoch in (0, 1):
        stats = clients.WireStats()
        push_rollout(fleet.learner_addr, Rollout(tm, pe, eps), epoch, 0, "inc", arena=arena, stats=stats)
        assert stats.shm_bytes > 0  # by handle, both times
    assert len(offers) == 1
    assert np.array_equal(learner.rollouts.pending[(1, 0)]["time"]["obs.state"], tm["obs.state"])
    with pytest.raises(InvalidRequest, match="worker_index: 99 is not one of this run's env servers"):
        push_rollout(fleet.learner_addr, Rollout(tm, pe, eps), 1, 99, "inc", arena=arena)
    # refused for the kept yes, so offered again and sent once more (refused again: it is the push that is wrong)
    assert len(offers) == 2
    push_rollout(fleet.learner_addr, Rollout(tm, pe, eps), 1, 0, "inc", arena=arena)
    assert len(offers) == 3  # after a failed push the next one asks again

    srv, addr, inline, _ = learner_server.serve(
        small_config("cluster.shared_memory=inline"), "127.0.0.1:0", str(tmp_path / "inline")
    )
    try:
        inline.setup(SPECS, 4)
        with clients._channels_lock:
            clients._takes_shm.add(addr)  # as if an earlier learner at this address had said yes
        offers.clear()
        stats = clients.WireStats()
        push_rollout(addr, Rollout(tm, pe, eps), 0, 0, "inc", arena=arena, stats=stats)
        assert len(offers) == 1 and addr not in clients._takes_shm  # asked again: this learner says no
        got = inline.rollouts.pending[(0, 0)]
        for k in tm:
            assert got["time"][k].tobytes() == tm[k].tobytes(), k
        assert got["episodes"] == eps
    finally:
        srv.stop(0)
        inline.close()
        arena.close()

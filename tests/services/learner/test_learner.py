"""Learner core: rollout validation, a PPO update, checkpoint round trip (weights + optimizer state)."""

import copy
import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch

from rlfleet.config.views import learner_view
from rlfleet.data.metrics import read_metrics
from rlfleet.errors import FailedPrecondition, InvalidRequest
from rlfleet.wire import codec
from rlfleet.wire.codec import EpisodeStat
from rlfleet.wire.spaces import TensorSpace
from services.learner.learner import Learner, latest_checkpoint, update_threads

SPECS = {"state": TensorSpace((13,), "float32")}


def fake_rollout(T=16, N=8, seed=0):
    rng = np.random.default_rng(seed)
    actions = rng.normal(size=(T, N, 4)).astype(np.float32)
    tm = {
        "obs.state": rng.normal(size=(T, N, 13)).astype(np.float32),
        "actions": actions[:, :, None],
        "fi.actions": actions,
        "log_probs": np.full((T, N, 1), -4.0, np.float32),
        "values": np.zeros((T, N), np.float32),
        "rewards": rng.random((T, N)).astype(np.float32),
        "terminated": np.zeros((T, N), bool),
        "truncated": np.zeros((T, N), bool),
        "loss_mask": np.ones((T, N), bool),
    }
    if T:
        tm["truncated"][T // 2] = True
    final = {"state": rng.normal(size=(N if T else 0, 13)).astype(np.float32)}
    index = np.arange(N) + (T // 2) * N if T else []
    tail = codec.make_tail({"state": rng.normal(size=(N, 13)).astype(np.float32)}, index, final)
    return tm, tail, [EpisodeStat(0, 3.0, 8, True, True)]


@pytest.fixture
def learner(cfg, tmp_path):
    cfg.runner.save_interval = 1
    le = Learner(learner_view(cfg), tmp_path / "run")
    le.setup(SPECS, 4)
    yield le
    le.close()


def test_receive_validates(learner):
    tm, pe, eps = fake_rollout()
    bad = dict(tm, actions=tm["actions"][:, :, :, :3])
    with pytest.raises(InvalidRequest, match=r"rollout\['actions'\]: shape \[16, 8, 1, 3\]"):
        learner.rollouts.receive(0, 0, bad, pe, eps)
    bad = dict(tm)
    bad["rewards"] = tm["rewards"].copy()
    bad["rewards"][2, 3] = np.inf
    with pytest.raises(InvalidRequest, match=r"rollout\['rewards'\]: non-finite"):
        learner.rollouts.receive(0, 0, bad, pe, eps)
    with pytest.raises(InvalidRequest, match="missing tensors"):
        learner.rollouts.receive(0, 0, {k: v for k, v in tm.items() if k != "values"}, pe, eps)
    with pytest.raises(FailedPrecondition, match=r"no committed rollout from worker\(s\) \[0\]"):
        learner.train(0, [0])
    empty, pe0, _ = fake_rollout(T=0)
    with pytest.raises(InvalidRequest, match="0 time steps x 8 envs"):
        learner.rollouts.receive(0, 0, empty, pe0, eps)
    with pytest.raises(InvalidRequest, match=r"rollout\['terminated'\]: dtype float32 where bool"):
        learner.rollouts.receive(0, 0, dict(tm, terminated=tm["terminated"].astype(np.float32)), pe, eps)
    with pytest.raises(InvalidRequest, match=r"rollout\['actions'\]: dtype uint8 where float32"):
        learner.rollouts.receive(0, 0, dict(tm, actions=tm["actions"].astype(np.uint8)), pe, eps)
    # nothing was lost: a good rollout still trains
    learner.rollouts.receive(0, 0, tm, pe, eps)
    assert np.isfinite(learner.train(0, [0])["train/loss"])


def test_no_checkpoint_from_non_finite_state(learner):
    tm, pe, eps = fake_rollout()
    learner.rollouts.receive(0, 0, tm, pe, eps)
    learner.train(0, [0])
    good = learner.save_checkpoint()
    with torch.no_grad():
        next(learner.model.parameters()).fill_(float("nan"))
    with pytest.raises(FailedPrecondition, match=r"non-finite values \(last good checkpoint: .*global_step_1"):
        learner.save_checkpoint()
    assert latest_checkpoint(learner.run_dir) == good


def test_train_logs_rlinf_metrics_and_checkpoints(learner, tmp_path):
    tm, pe, eps = fake_rollout()
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    learner.rollouts.receive(0, 0, tm, pe, eps)
    m = learner.train(0, [0])
    for key in (
        "train/actor/policy_loss",
        "train/actor/approx_kl",
        "train/actor/clip_fraction",
        "train/actor/clipped_ratio",
        "train/actor/grad_norm",
        "train/actor/lr",
        "train/actor/entropy_loss",
        "train/critic/value_loss",
        "train/critic/value_clip_ratio",
        "train/critic/explained_variance",
        "train/loss",
        "env/success_once",
        "env/return",
        "env/episode_len",
        "env/reward",
        "rollout/advantages_mean",
        "rollout/advantages_max",
        "rollout/advantages_min",
        "rollout/returns_mean",
        "rollout/rewards",
        "time/train",
    ):
        assert key in m, key
    assert learner.version == 1 and learner.env_steps == 16 * 8
    assert any(not torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    with pytest.raises(InvalidRequest, match="epoch: 5 is not the next epoch"):
        learner.train(5, [0])
    records = read_metrics(tmp_path / "run")
    assert records[-1]["step"] == 1 and "train/actor/policy_loss" in records[-1]
    assert (tmp_path / "run" / "tensorboard").exists()
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt.name == "global_step_1" and (ckpt / "state" / ".metadata").exists()
    assert json.loads((ckpt / "learner_state.json").read_text())["epoch"] == 0


def test_resume_restores_weights_optimizer_and_counters(cfg, learner, tmp_path):
    tm, pe, eps = fake_rollout()
    learner.rollouts.receive(0, 0, tm, pe, eps)
    learner.train(0, [0])
    cfg.runner.resume_dir = str(tmp_path / "run")
    other = Learner(learner_view(cfg), tmp_path / "run")
    other.setup(SPECS, 4)
    assert (other.epoch, other.version, other.env_steps) == (0, 1, 128)
    for k, v in learner.model.state_dict().items():
        assert torch.equal(v, other.model.state_dict()[k]), k
    s1, s2 = learner.optimizer.state_dict()["state"], other.optimizer.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)
    # both continue identically
    torch.manual_seed(3)
    learner.rollouts.receive(1, 0, *fake_rollout(seed=1))
    m1 = learner.train(1, [0])
    torch.manual_seed(3)
    other.rollouts.receive(1, 0, *fake_rollout(seed=1))
    m2 = other.train(1, [0])
    assert np.isclose(m1["train/loss"], m2["train/loss"])
    other.close()


def test_update_threads_follow_the_mode_and_the_policy(cfg, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    cfg.cluster.torch_num_threads = 1
    assert cfg.actor.model.model_type == "mlp"
    assert update_threads(learner_view(cfg)) == 1  # an MLP's update is too small to split over cores
    cfg.actor.model.model_type = "cnn"
    assert update_threads(learner_view(cfg)) == 3  # sync: nothing else runs during the update
    assert update_threads(learner_view(cfg), local_ranks=2) == 1  # two ranks share the cores
    cfg.algorithm.max_staleness = 1
    assert update_threads(learner_view(cfg)) == 1  # async: the envs collect beside it
    cfg.cluster.learner_num_threads = 2
    assert update_threads(learner_view(cfg)) == 2
    cfg.actor.model.model_type = "mlp"
    assert update_threads(learner_view(cfg)) == 2  # the key, when set, decides


def test_update_runs_on_its_threads_and_gives_them_back(learner):
    before = torch.get_num_threads()
    learner.update_threads = before + 1
    seen, update = [], learner.algorithm.trainer.update
    learner.algorithm.trainer.update = lambda *a, **kw: (seen.append(torch.get_num_threads()), update(*a, **kw))[1]
    tm, pe, eps = fake_rollout()
    learner.rollouts.receive(0, 0, tm, pe, eps)
    learner.train(0, [0])
    assert seen == [before + 1] and torch.get_num_threads() == before


def test_samples_more_than_one_version_old_get_truncated_importance_weights(learner):
    learner.algorithm.trainer.alg = dataclasses.replace(learner.alg, importance_weight_cap=1.5)
    tm, pe, eps = fake_rollout()
    tm["weights_version"] = np.zeros((16, 8), np.int64)
    tm["weights_version"][:, :4] = 2  # envs 0-3 acted with the current weights, envs 4-7 two versions before
    learner.version = 2
    learner.rollouts.receive(0, 0, tm, pe, eps)
    seen = {}
    step = learner.algorithm.trainer._step
    learner.algorithm.trainer._step = lambda model, opt, rows, *rest, **kw: (
        seen.update(rows),
        step(model, opt, rows, *rest, **kw),
    )[1]
    m = learner.train(0, [0])
    assert m["rollout/stale_fraction"] == 0.5
    stale = torch.tensor(([False] * 4 + [True] * 4) * 16)
    w = seen["is_weights"]
    assert torch.all(w[~stale] == 1.0) and torch.all(w[stale] <= 1.5) and torch.all(w[stale] > 0)
    # stale rows: PPO's ratio is taken against the policy that started the update, not the behaviour log-probs
    assert torch.all(seen["old_log_probs"][~stale] == -4.0) and torch.all(seen["old_log_probs"][stale] != -4.0)
    assert 0.0 <= m["train/actor/is_weight_truncated"] <= 1.0 and m["train/actor/is_weight_mean"] > 0


def test_fresh_samples_train_as_plain_ppo(learner):
    tm, pe, eps = fake_rollout()
    tm["weights_version"] = np.zeros((16, 8), np.int64)
    learner.version = 1  # one version old: PPO's own ratio is the correction
    learner.rollouts.receive(0, 0, tm, pe, eps)
    m = learner.train(0, [0])
    assert m["rollout/stale_fraction"] == 0.0 and "train/actor/is_weight_mean" not in m


def test_decoupled_staleness_1_corrects_every_stale_sample(learner):
    learner.algorithm.trainer.alg = dataclasses.replace(learner.alg, decoupled_staleness=1)
    tm, pe, eps = fake_rollout()
    tm["weights_version"] = np.zeros((16, 8), np.int64)
    learner.version = 1
    learner.rollouts.receive(0, 0, tm, pe, eps)
    m = learner.train(0, [0])
    assert m["rollout/stale_fraction"] == 1.0 and m["train/actor/is_weight_mean"] > 0


def test_critic_warmup_trains_only_the_critic_first(cfg, tmp_path):
    """algorithm.critic_warmup_epochs=1: epoch 0 moves the critic's own modules and nothing else (the actor, its
    log std and the observation normaliser's consumers hold still); epoch 1 trains everything."""
    cfg.algorithm.critic_warmup_epochs = 1
    le = Learner(learner_view(cfg), tmp_path / "run")
    le.setup(SPECS, 4)
    try:
        critic = {n for n, p in le.model.named_parameters() if any(p is q for q in le.model.critic_parameters())}
        assert critic and all(n.startswith("critic.") for n in critic)
        before = {n: p.detach().clone() for n, p in le.model.named_parameters()}
        le.rollouts.receive(0, 0, *fake_rollout())
        m = le.train(0, [0])
        assert m["train/critic_warmup"] == 1.0
        moved = {n for n, p in le.model.named_parameters() if not torch.equal(before[n], p)}
        assert moved and moved <= critic, moved - critic
        mid = {n: p.detach().clone() for n, p in le.model.named_parameters()}
        le.rollouts.receive(1, 0, *fake_rollout(seed=1))
        m = le.train(1, [0])
        assert m["train/critic_warmup"] == 0.0
        assert any(not torch.equal(mid[n], p) for n, p in le.model.named_parameters() if n not in critic)
    finally:
        le.close()


def _drift_from_start(cfg, tmp_path, kl_beta: float, epochs: int = 4) -> tuple[float, Learner]:
    """Mean |log p - log p_start| of the sampled actions after ``epochs`` updates with algorithm.kl_beta."""
    cfg.algorithm.kl_beta = kl_beta
    cfg.actor.optim.lr = 3e-3
    le = Learner(learner_view(cfg), tmp_path / f"run_beta{kl_beta}")
    le.setup(SPECS, 4)
    start = {k: v.clone() for k, v in le.model.state_dict().items()}
    for epoch in range(epochs):
        le.rollouts.receive(epoch, 0, *fake_rollout(seed=epoch))
        m = le.train(epoch, [0])
        assert ("train/actor/kl_loss" in m) == (kl_beta > 0)
    tm, _, _ = fake_rollout(seed=99)
    obs = {"state": torch.as_tensor(tm["obs.state"]).reshape(-1, 13)}
    fi = {"actions": torch.as_tensor(tm["fi.actions"]).reshape(-1, 4)}
    with torch.no_grad():
        now = le.model.evaluate(obs, fi).log_probs
        le.model.load_state_dict(start)
        then = le.model.evaluate(obs, fi).log_probs
    return float((now - then).abs().mean()), le


def test_kl_penalty_holds_the_policy_near_the_reference(cfg, tmp_path):
    """algorithm.kl_beta > 0: a frozen copy of the starting policy is the reference; its KL penalty is logged as
    train/actor/kl_loss and keeps the trained policy closer to where it started than the same run without it."""
    free, le0 = _drift_from_start(copy.deepcopy(cfg), tmp_path, 0.0)
    held, le1 = _drift_from_start(copy.deepcopy(cfg), tmp_path, 5.0)
    try:
        assert le0.ref_model is None and le1.ref_model is not None
        assert not any(p.requires_grad for p in le1.ref_model.parameters())
        assert free > 0 and held < 0.6 * free, (held, free)
    finally:
        le0.close()
        le1.close()


def test_kl_reference_on_resume_is_the_starting_model(cfg, tmp_path):
    """On --resume the reference is the model the run started from (as built), not the restored checkpoint."""
    cfg.algorithm.kl_beta = 1.0
    cfg.runner.save_interval = 1
    le = Learner(learner_view(cfg), tmp_path / "run")
    le.setup(SPECS, 4)
    start = {k: v.clone() for k, v in le.ref_model.state_dict().items()}
    le.rollouts.receive(0, 0, *fake_rollout())
    le.train(0, [0])
    le.close()
    cfg.runner.resume_dir = str(tmp_path / "run")
    le2 = Learner(learner_view(cfg), tmp_path / "run")
    le2.setup(SPECS, 4)
    try:
        assert all(torch.equal(start[k], v) for k, v in le2.ref_model.state_dict().items())
        assert any(not torch.equal(start[k], v) for k, v in le2.model.state_dict().items())
    finally:
        le2.close()


def test_kl_reference_of_a_lora_policy_is_its_base_without_a_copy(tmp_path):
    """With LoRA only the adapters train: the KL reference is the policy with its adapters off (exactly the
    starting model), so the learner holds no second copy of the weights."""
    from rlfleet.config import load_config

    cfg = load_config(
        "pandapickcube_vision_grpo_openvla_oft_tiny",
        ["algorithm.kl_beta=0.1", "actor.model.vla.image_size=32", "actor.model.lora_rank=4"],
    )
    specs = {"third_person": TensorSpace((32, 32, 3), "uint8"), "state": TensorSpace((7,), "float32")}
    le = Learner(learner_view(cfg), tmp_path / "run")
    try:
        le.setup(specs, 4)
        assert le.ref_model is None and le.model.trains_adapters_only
        g = torch.Generator().manual_seed(0)
        obs = {
            "third_person": torch.randint(0, 256, (6, 32, 32, 3), dtype=torch.uint8, generator=g),
            "state": torch.randn(6, 7, generator=g),
        }
        with torch.no_grad():
            start = le.model.act(obs, False, ["pick up the red cube and lift it"] * 6)
            for name, p in le.model.named_parameters():
                if "lora_B" in name:  # what training does: the adapters move, the base stays
                    p.add_(torch.randn_like(p) * 0.3)
        rows = {**{f"obs.{k}": v for k, v in obs.items()}, **{f"fi.{k}": v for k, v in start.forward_inputs.items()}}
        every = torch.arange(6)
        moved = le.algorithm.trainer.log_probs(le.model, rows, every)
        ref = le.algorithm.trainer.reference_log_probs(le.model, le.ref_model, rows, every)
        assert torch.allclose(ref, start.log_probs, atol=1e-5)
        assert not torch.allclose(moved, start.log_probs, atol=1e-3)
    finally:
        le.close()


# --- issue 25: inputs that used to poison or bloat the learner -------------------------------------------------
def test_forward_inputs_are_checked_against_what_the_policy_produces(learner):
    from rlfleet.wire.codec import InputSpec

    assert learner.rollouts.fi_specs == {"actions": InputSpec((4,), "float32")}  # asked of the policy at set-up
    tm, pe, eps = fake_rollout()
    with pytest.raises(
        InvalidRequest,
        match=r"rollout\['fi.actions'\]: float32 \[16, 8, 7\] where float "
        r"\[16, 8, \*\[4\]\] was expected",
    ):
        learner.rollouts.receive(0, 0, dict(tm, **{"fi.actions": np.zeros((16, 8, 7), np.float32)}), pe, eps)
    with pytest.raises(InvalidRequest, match=r"unknown tensors \['fi.tokens'\]"):
        learner.rollouts.receive(0, 0, dict(tm, **{"fi.tokens": np.zeros((16, 8, 3), np.int64)}), pe, eps)
    with pytest.raises(InvalidRequest, match=r"rollout\['loss_mask'\]: all 128 samples are masked out"):
        learner.rollouts.receive(0, 0, dict(tm, loss_mask=np.zeros((16, 8), bool)), pe, eps)
    assert not learner.rollouts.pending
    learner.rollouts.receive(0, 0, tm, pe, eps)
    assert np.isfinite(learner.train(0, [0])["train/loss"])


def test_forward_input_specs_leave_the_random_stream_alone(learner):
    from services.learner.rollouts import forward_input_specs

    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    forward_input_specs(learner.model, SPECS)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("field", ["values", "actions", "fi.actions", "rewards", "log_probs"])
def test_huge_finite_values_are_refused_and_training_goes_on(learner, field):
    """3e38 in values/actions used to make every later Train fail (INTERNAL) and SaveCheckpoint refuse."""
    tm, pe, eps = fake_rollout()
    bad = dict(tm)
    bad[field] = tm[field].copy()
    bad[field].reshape(-1)[5] = 3e38
    with pytest.raises(InvalidRequest, match=rf"rollout\['{field}'\]: value 3e\+38 .* beyond the schema's bound"):
        learner.rollouts.receive(0, 0, bad, pe, eps)
    with pytest.raises(InvalidRequest, match=r"rollout\['next_obs.state'\]: value 3e\+38"):
        learner.rollouts.receive(0, 0, tm, dict(pe, **{"next_obs.state": np.full((8, 13), 3e38, np.float32)}), eps)
    assert not learner.rollouts.pending
    learner.rollouts.receive(0, 0, tm, pe, eps)
    m = learner.train(0, [0])
    assert all(np.isfinite(v) for v in m.values())
    assert learner.save_checkpoint().exists()


def test_reward_normaliser_stays_usable_after_rewards_at_the_bound(learner):
    """Rewards of 3e38 pushed the normaliser's variance to 9e76 (every later reward scaled to ~1e-38); the largest
    reward the schema lets through leaves finite statistics, and an overflowing batch leaves them untouched."""
    from rlfleet.wire.codec import REWARD_BOUND
    from services.learner.batch import RewardScaler

    scaler = RewardScaler(0.99)
    dones = np.zeros((16, 8), bool)
    out = scaler(0, np.full((16, 8), REWARD_BOUND, np.float32), dones)
    assert np.isfinite(out).all() and np.isfinite(scaler.rms.var.item())
    before = {k: v.clone() for k, v in scaler.state_dict().items()}
    with pytest.raises(FailedPrecondition, match="rewards of worker 0: their discounted returns overflow"):
        scaler(0, np.full((16, 8), np.finfo(np.float64).max, np.float64), dones)
    assert all(torch.equal(before[k], v) for k, v in scaler.state_dict().items())


def test_a_batch_with_nothing_to_train_leaves_the_observation_normaliser_finite(learner):
    """No sample trains (all masked; the intake refuses such a rollout, GRPO's filter can still make one): the
    normaliser's statistics of no rows would be NaN for every later act."""
    tm, pe, eps = fake_rollout()
    tm["loss_mask"] = np.zeros((16, 8), bool)
    learner.rollouts.pending[(0, 0)] = {"time": tm, "tail": pe, "episodes": eps}  # past the intake's check
    learner.train(0, [0])
    assert all(torch.isfinite(b).all() for b in learner.model.buffers())


def test_rollouts_of_workers_the_run_does_not_have_are_refused(learner):
    """40 rollouts for made-up worker indices took the learner from 369 to 1656 MB until the next Train."""
    tm, pe, eps = fake_rollout()
    assert learner.rollouts.num_workers == 1  # cluster.num_env_servers
    for worker in (1, 5, 2**31 - 1, -1):
        with pytest.raises(
            InvalidRequest,
            match=rf"worker_index: {worker} is not one of this run's env servers "
            r"\(0\.\.0",
        ):
            learner.rollouts.receive(0, worker, tm, pe, eps)
    assert not learner.rollouts.pending
    # the run scales up (coordinatorctl scale env 3): the new servers push before the Train that names them;
    # the learner asks the coordinator
    asked = []
    learner.rollouts.scale_probe = lambda: asked.append(1) or 3
    learner.rollouts.receive(0, 2, tm, pe, eps)
    learner.rollouts.receive(0, 1, tm, pe, eps)
    assert len(asked) == 1 and learner.rollouts.num_workers == 3
    with pytest.raises(InvalidRequest, match=r"worker_index: 3 is not one of this run's env servers \(0\.\.2"):
        learner.rollouts.receive(0, 3, tm, pe, eps)
    learner.rollouts.receive(0, 0, tm, pe, eps)
    learner.train(0, [0, 1, 2])
    # scaled down to 1: Train names the workers, and the next epoch takes only them
    learner.rollouts.scale_probe = None
    learner.rollouts.receive(1, 0, tm, pe, eps)
    learner.train(1, [0])
    assert learner.rollouts.num_workers == 1
    with pytest.raises(InvalidRequest, match="worker_index: 1"):
        learner.rollouts.receive(2, 1, tm, pe, eps)


def test_resumed_run_logs_each_epoch_once(cfg, tmp_path):
    """A kill after epochs past the last checkpoint: --resume trains them again, metrics.jsonl holds them once."""
    cfg.runner.save_interval = 2
    le = Learner(learner_view(cfg), tmp_path / "run")
    le.setup(SPECS, 4)
    for epoch in range(3):  # checkpoint at step 2; steps 1, 2, 3 logged; then the kill
        le.rollouts.receive(epoch, 0, *fake_rollout(seed=epoch))
        le.train(epoch, [0])
    le.close()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    cfg.runner.resume_dir = str(tmp_path / "run")
    le2 = Learner(learner_view(cfg), tmp_path / "run")
    le2.setup(SPECS, 4)
    try:
        assert le2.epoch == 1
        le2.rollouts.receive(2, 0, *fake_rollout(seed=2))
        le2.train(2, [0])
        assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    finally:
        le2.close()


def test_only_eval_learner_loads_weights_without_optimizer_state(cfg, tmp_path):
    """runner.only_eval (what `coordinatorctl eval` sets): the checkpoint's weights, no optimizer nor Adam state,
    and training or checkpointing refused by name."""
    cfg.runner.save_interval = 1
    le = Learner(learner_view(cfg), tmp_path / "run")
    le.setup(SPECS, 4)
    le.rollouts.receive(0, 0, *fake_rollout())
    le.train(0, [0])
    trained = {k: v.clone() for k, v in le.state_dict().items()}
    trained_memory = le.memory()[0]
    le.close()
    assert trained_memory["optimizer"] > 0

    cfg.runner.resume_dir = str(tmp_path / "run")
    cfg.runner.only_eval = True
    ev = Learner(learner_view(cfg), tmp_path / "run")
    ev.setup(SPECS, 4)
    try:
        assert ev.optimizer is None and ev.epoch == 0 and ev.version == 1
        got = ev.state_dict()
        assert set(got) == set(trained) and all(torch.equal(got[k], trained[k]) for k in got)
        memory = ev.memory()[0]
        assert memory == {"parameters": trained_memory["parameters"], "optimizer": 0}
        with pytest.raises(FailedPrecondition, match="runner.only_eval: .* takes no rollouts"):
            ev.rollouts.receive(1, 0, *fake_rollout(seed=1))
        with pytest.raises(FailedPrecondition, match="runner.only_eval"):
            ev.train(1, [0])
        with pytest.raises(FailedPrecondition, match="runner.only_eval"):
            ev.save_checkpoint()
    finally:
        ev.close()


# --- bootstrapping in the learner (issue 36: the rollout carries next and final observations, not values) ---------
def test_the_learners_values_are_the_numbers_the_inference_server_serves(learner):
    """V(obs) from the learner (padded to the family's blocks, as the inference server acts) equals, bit for bit,
    the value the served policy answers for the same row in an Act of any size."""
    from rlfleet.policies.local import forward

    rng = np.random.default_rng(3)
    obs = rng.normal(size=(37, 13)).astype(np.float32)
    fi = {"fi.actions": torch.zeros(37, 4)}
    ours = learner.values({"obs.state": torch.from_numpy(obs), **fi})
    served = copy.deepcopy(learner.model).eval()
    for rows in (slice(0, 37), slice(5, 6), slice(3, 30)):
        out = forward(served, {"state": obs[rows]}, False, None, None, "cpu", 32, 0)
        assert torch.equal(torch.as_tensor(out.values), ours[rows]), rows


def test_truncated_episodes_bootstrap_from_their_final_observation_in_the_learner(learner):
    """gamma * V(final obs) is added to the reward of exactly the rows whose episode was truncated (not those that
    terminated), and V(next obs) closes the GAE: checked against compute_gae on values computed here."""
    from services.learner import ppo
    from services.learner.batch import RewardScaler, build_batch

    tm, tail, eps = fake_rollout(T=6, N=4)
    tm["truncated"][:] = False
    tm["truncated"][2, 1] = True
    tm["terminated"][4, 3] = True
    final = np.random.default_rng(1).normal(size=(2, 13)).astype(np.float32)
    tail = codec.make_tail({"state": tail["next_obs.state"][:4]}, [2 * 4 + 1, 4 * 4 + 3], {"state": final})
    learner.rollouts.receive(0, 0, tm, tail, eps)
    part = learner.rollouts.take(0, [0])
    alg = dataclasses.replace(learner.alg, normalize_rewards=False)
    batch = build_batch(part, [0], alg, RewardScaler(alg.gamma), learner.values, True)

    def v(obs):
        return learner.values({"obs.state": torch.as_tensor(obs), "fi.actions": torch.zeros(len(obs), 4)})

    rewards = torch.as_tensor(tm["rewards"]).clone()
    rewards[2, 1] += alg.gamma * v(final[:1])[0]  # the truncated row only: row (4, 3) terminated
    dones = torch.as_tensor(tm["terminated"] | tm["truncated"]).float()
    adv, ret = ppo.compute_gae(
        rewards, torch.as_tensor(tm["values"]), dones, v(tail["next_obs.state"]), alg.gamma, alg.gae_lambda
    )
    assert torch.allclose(batch.advantages, adv, atol=1e-6) and torch.allclose(batch.returns, ret, atol=1e-6)
    off = build_batch(part, [0], dataclasses.replace(alg, bootstrap_truncated=False), RewardScaler(0.9), learner.values)
    assert not torch.allclose(off.advantages, batch.advantages)  # the bootstrap is really in there


@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_the_critic_on_a_thread_of_its_own_takes_the_same_steps(cfg, tmp_path, kl_beta):
    """A synchronous MLP update on 2+ cores runs the critic's forward and backward on a second thread beside the
    actor's (Trainer.critic_apart), both from features computed once per update: every statistic and every weight
    is the same bit for bit as on one thread (cluster.learner_num_threads=1, the features per step), with and
    without a KL penalty to the reference policy."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the critic stays on the update's thread")
    cfg.algorithm.kl_beta = kl_beta
    runs = []
    for threads in (None, 1):
        cfg.cluster.learner_num_threads = threads
        le = Learner(learner_view(cfg), tmp_path / f"run{threads}")
        le.setup(SPECS, 4)
        trainer = le.algorithm.trainer
        assert trainer.critic_apart(le.model) == (threads is None)
        assert not trainer.critic_apart(le.model, critic_only=True)  # a critic warm-up has no actor half
        features, calls = le.model.features, []
        le.model.features = lambda obs, _f=features: (calls.append(len(next(iter(obs.values())))), _f(obs))[1]
        stats = []
        for epoch in range(3):
            tm, pe, eps = fake_rollout(seed=epoch)
            le.rollouts.receive(epoch, 0, tm, pe, eps)
            calls.clear()
            m = le.train(epoch, [0])
            stats.append({k: v for k, v in m.items() if k.startswith("train/")})
            if threads is None:  # the update's features: once, for every row (before it: the bootstrap values')
                assert m["train/optimizer_steps"] > 1 and len(calls) == 2 and calls[-1] == 128, calls
        assert (trainer._critic_thread is not None) == (threads is None)
        runs.append((stats, {k: v.clone() for k, v in le.model.state_dict().items()}))
        le.close()
    (apart, w_apart), (one, w_one) = runs
    assert apart == one
    assert w_apart.keys() == w_one.keys() and all(torch.equal(w_apart[k], w_one[k]) for k in w_one)


def test_the_update_holds_its_two_threads_on_two_cores(cfg, tmp_path):
    """With the critic on its own thread, the update runs the actor's half on the first of the learner's cores and
    the critic's on the last one (the scheduler would otherwise wake the critic's thread on the actor's core after a
    rollout's idle time, and the two halves take turns); after the update the learner's thread may run on every
    core it had again. A learner on one thread pins nothing."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: the critic stays on the update's thread")
    for threads in (None, 1):
        cfg.cluster.learner_num_threads = threads
        le = Learner(learner_view(cfg), tmp_path / f"run{threads}")
        le.setup(SPECS, 4)
        trainer = le.algorithm.trainer
        seen = []
        step = trainer._step

        def watched(*args, _step=step, _trainer=trainer, **kw):
            critic = _trainer._critic_thread
            on = critic.submit(os.sched_getaffinity, 0).result() if critic is not None else None
            seen.append((os.sched_getaffinity(0), on))
            return _step(*args, **kw)

        trainer._step = watched
        tm, pe, eps = fake_rollout(seed=0)
        le.rollouts.receive(0, 0, tm, pe, eps)
        le.train(0, [0])
        assert seen and os.sched_getaffinity(0) == set(cores)  # the learner's thread: every core again
        if threads is None:
            assert all(mine == {cores[0]} and critic == {cores[-1]} for mine, critic in seen)
        else:
            assert all(mine == set(cores) and critic is None for mine, critic in seen)
        le.close()


def test_an_update_whose_cores_cannot_be_set_runs_unpinned(cfg, tmp_path, monkeypatch):
    """Where the system refuses to move a thread (a cpuset that forbids it), the update with the critic on its own
    thread runs as it would unpinned: it trains, nothing breaks the critic's thread."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the critic stays on the update's thread")

    def refuse(pid, cores):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    le = Learner(learner_view(cfg), tmp_path / "run")
    le.setup(SPECS, 4)
    assert le.algorithm.trainer.critic_apart(le.model)
    for epoch in range(2):
        tm, pe, eps = fake_rollout(seed=epoch)
        le.rollouts.receive(epoch, 0, tm, pe, eps)
        m = le.train(epoch, [0])
        assert m["train/optimizer_steps"] > 0 and math.isfinite(m["train/loss"])
    assert le.algorithm.trainer._critic_thread is not None
    le.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_the_updates_gradient_clipping_is_torchs_bit_for_bit(dtype, max_norm):
    """The trainer clips an MLP's gradients with torch's own operations, without its grouping: the same norm and
    the same clipped gradients, bit for bit, clipping (a small max norm) or not; mixed dtypes go through torch's."""
    from services.learner.trainer import _clip_grad_norm

    gen = torch.Generator().manual_seed(3)
    shapes = [(128, 13), (128,), (128, 128), (128,), (4, 128), (4,), (4,)]

    def params(dtypes):
        out = []
        for shape, dt in zip(shapes, dtypes):
            p = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64).to(dt))
            p.grad = torch.randn(shape, generator=gen, dtype=torch.float64).to(dt) * 0.3
            out.append(p)
        return out

    for dtypes in ([dtype] * len(shapes), [torch.float32, torch.float64] * 4):
        ours = params(dtypes)
        theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        for p, q in zip(ours, theirs):
            q.grad = p.grad.clone()
        before = [p.grad.clone() for p in ours]
        norm = _clip_grad_norm(ours, max_norm)
        expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
        assert torch.equal(norm, expected)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours, theirs))
        clipped = not all(torch.equal(p.grad, b) for p, b in zip(ours, before))
        assert clipped == (max_norm < 1)  # the small max norm clips, the large one leaves the gradients alone

"""SAC on the seam, in the learner core (no gRPC): rollouts become replay transitions, the update runs once the
buffer holds algorithm.learning_starts, the checkpoint carries the buffer and a resumed learner continues exactly;
the start-up memory check counts the buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfleet.config import load_config
from rlfleet.config.views import learner_view
from rlfleet.errors import ResourceExhausted
from rlfleet.wire import codec
from rlfleet.wire.codec import EpisodeStat
from rlfleet.wire.spaces import TensorSpace
from services.learner.learner import Learner

torch.set_num_threads(1)
SPECS = {"state": TensorSpace((13,), "float32")}
SMALL = [
    "actor.model.hidden_dims=[32,32]",
    "actor.global_batch_size=32",
    "actor.micro_batch_size=32",
    "algorithm.learning_starts=150",
    "algorithm.utd_ratio=0.25",
    "runner.save_interval=1",
    "cluster.learner_num_threads=1",
]


def sac_rollout(T=10, N=8, seed=0):
    rng = np.random.default_rng(seed)
    actions = rng.uniform(-1, 1, size=(T, N, 4)).astype(np.float32)
    tm = {
        "obs.state": rng.normal(size=(T, N, 13)).astype(np.float32),
        "actions": actions[:, :, None],
        "fi.actions": actions,
        "log_probs": np.full((T, N, 1), -2.0, np.float32),
        "values": np.zeros((T, N), np.float32),
        "rewards": rng.random((T, N)).astype(np.float32),
        "terminated": np.zeros((T, N), bool),
        "truncated": np.zeros((T, N), bool),
        "loss_mask": np.ones((T, N), bool),
    }
    tm["truncated"][T // 2] = True
    final = {"state": rng.normal(size=(N, 13)).astype(np.float32)}
    tail = codec.make_tail({"state": rng.normal(size=(N, 13)).astype(np.float32)}, np.arange(N) + (T // 2) * N, final)
    return tm, tail, [EpisodeStat(0, 3.0, 8, True, True)]


def make(tmp_path, *overrides) -> Learner:
    le = Learner(learner_view(load_config("pandapickcube_sac", [*SMALL, *overrides])), tmp_path / "run")
    le.setup(SPECS, 4)
    return le


def test_sac_trains_from_the_buffer_and_resumes_exactly(tmp_path):
    le = make(tmp_path)
    metrics = []
    for epoch in range(3):
        le.rollouts.receive(epoch, 0, *sac_rollout(seed=epoch))
        metrics.append(le.train(epoch, [0]))
    assert [m["replay/size"] for m in metrics] == [80, 160, 240]
    assert "train/critic/loss" not in metrics[0]  # 80 < learning_starts
    assert metrics[1]["train/optimizer_steps"] == 20 and metrics[2]["train/optimizer_steps"] == 20  # 0.25 x 80
    assert {"train/actor/loss", "train/alpha", "train/critic/q_mean", "replay/staleness"} <= set(metrics[2])
    digest = le.algorithm.buffer.digest()

    other = make(tmp_path, f"runner.resume_dir={tmp_path / 'run'}")
    assert other.algorithm.buffer.digest() == digest and other.algorithm.steps == le.algorithm.steps == 40
    for k, v in le.model.state_dict().items():
        assert torch.equal(v, other.model.state_dict()[k]), k
    for learner in (le, other):
        learner.rollouts.receive(3, 0, *sac_rollout(seed=3))
    m1, m2 = le.train(3, [0]), other.train(3, [0])
    untimed = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in (m1, m2)]
    assert untimed[0] == untimed[1] and untimed[0]["train/optimizer_steps"] == 20  # the same samples, noise, step
    assert le.algorithm.buffer.digest() == other.algorithm.buffer.digest()
    le.close()
    other.close()


def test_a_buffer_that_does_not_fit_is_refused_by_its_key(tmp_path):
    le = Learner(
        learner_view(load_config("pandapickcube_sac", [*SMALL, "algorithm.replay_capacity=100000000000"])),
        tmp_path / "run",
    )
    with pytest.raises(ResourceExhausted, match=r"algorithm\.replay_capacity=100,000,000,000 \(the replay buffer\)"):
        le.setup(SPECS, 4)
    assert le.model is None  # refused before the policy was built
    le.close()

"""RLPD's demonstrations: a LeRobot v3.0 dataset (as collect-demos writes one) becomes transitions (frame t with
frame t + 1, the frame's reward, never terminal), kept per rank beside the replay buffer; every batch draws
``algorithm.demo_ratio`` of its rows from them; the start-up memory check counts them; a dataset that does not fit
the env is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfleet.config import ConfigError, load_config
from rlfleet.config.views import learner_view
from rlfleet.data.datasets import Dataset, DatasetWriter, Episode
from rlfleet.errors import FailedPrecondition
from rlfleet.wire.spaces import TensorSpace
from services.learner.algorithms.factory import make_algorithm
from services.learner.algorithms.rlpd import demo_transitions
from services.learner.group import RankGroup
from services.learner.replay import buffer_bytes

torch.set_num_threads(1)
SPECS = {"state": TensorSpace((13,), "float32")}


def write_demos(root, lengths=(5, 7)) -> None:
    w = DatasetWriter(root, env_id="PandaPickCube-v0", simulator="gym", fps=10, source="test")
    for e, T in enumerate(lengths):
        state = np.arange(T * 13, dtype=np.float32).reshape(T, 13) + 1000 * e
        actions = np.full((T, 4), 0.5 if e else -0.5, np.float32)
        w.add(Episode({"state": state}, actions, np.arange(T, dtype=np.float32), np.zeros(T, bool), "", e))
    w.close()


def test_episodes_become_transitions_with_the_next_frame(tmp_path):
    write_demos(tmp_path / "d")
    rows = demo_transitions(Dataset(tmp_path / "d"), ["state"], 4)
    assert len(rows["reward"]) == 4 + 6  # an episode's last frame has no next observation
    s, ns = rows["obs.state"], rows["next_obs.state"]
    assert np.array_equal(ns[:3], s[1:4]) and np.array_equal(ns[4:9], s[5:10])
    assert np.array_equal(ns[3], np.arange(52, 65, dtype=np.float32))  # episode 0's last frame, as a next obs
    assert np.array_equal(rows["reward"][:4], [0, 1, 2, 3]) and not rows["terminated"].any()
    assert np.array_equal(rows["action"][4:], np.full((6, 4), 0.5, np.float32))
    with pytest.raises(FailedPrecondition, match="no observation \\['wrist'\\] the policy sees"):
        demo_transitions(Dataset(tmp_path / "d"), ["state", "wrist"], 4)
    with pytest.raises(FailedPrecondition, match="actions are 4-D, the env's 7-D"):
        demo_transitions(Dataset(tmp_path / "d"), ["state"], 7)


def rlpd(tmp_path, *overrides, world=1, rank=0):
    cfg = load_config(
        "pandapickcube_sac",
        ["algorithm.name=rlpd", f"sft.dataset_path={tmp_path / 'd'}", "algorithm.replay_capacity=64", *overrides],
    )
    return make_algorithm(learner_view(cfg), RankGroup(rank=rank, world=world))  # (set-up and sampling: no collective)


def test_every_batch_draws_its_share_from_the_demonstrations(tmp_path):
    write_demos(tmp_path / "d")
    alg = rlpd(tmp_path, "algorithm.demo_ratio=0.25")
    need, key = alg.planned_bytes(SPECS, 4)
    assert need == buffer_bytes(64, SPECS, 4) + buffer_bytes(12, SPECS, 4)
    assert "algorithm.replay_capacity=64" in key and "12 frames of sft.dataset_path" in key
    alg.setup(SPECS, 4)
    assert len(alg.demos) == 10 and len(alg.buffer) == 0
    online = {
        "obs.state": np.full((8, 13), -1, np.float32),
        "next_obs.state": np.full((8, 13), -1, np.float32),
        "action": np.zeros((8, 4), np.float32),
        "reward": np.zeros(8, np.float32),
        "terminated": np.zeros(8, bool),
        "truncated": np.zeros(8, bool),
        "weights_version": np.zeros(8, np.int32),
    }
    alg.buffer.add(online)
    batch = alg.sample(16)
    from_demos = batch["obs.state"][:, 0] >= 0
    assert from_demos.sum() == 4 and not from_demos[:12].any()  # 25% of the rows, after the online ones


def test_two_ranks_share_the_demonstrations(tmp_path):
    write_demos(tmp_path / "d")
    shares = []
    for rank in (0, 1):
        alg = rlpd(tmp_path, world=2, rank=rank)
        alg.setup(SPECS, 4)
        shares.append({float(x) for x in alg.demos.data["obs.state"][: len(alg.demos), 0]})
    assert len(shares[0]) == len(shares[1]) == 5 and not shares[0] & shares[1]


def test_rlpd_and_sac_need_the_sac_family():
    with pytest.raises(ConfigError, match="'actor.model.model_type': 'mlp' with algorithm.name rlpd"):
        load_config(None, ["algorithm.name=rlpd"])
    with pytest.raises(ConfigError, match="'algorithm.name': 'ppo' with actor.model.model_type sac"):
        load_config(None, ["actor.model.model_type=sac"])
    with pytest.raises(ConfigError, match="'algorithm.demo_ratio': must be in \\(0, 1\\), got 1.5"):
        load_config("pandapickcube_sac", ["algorithm.demo_ratio=1.5"])


def test_a_missing_dataset_is_named(tmp_path):
    with pytest.raises(Exception, match="d"):
        rlpd(tmp_path).planned_bytes(SPECS, 4)

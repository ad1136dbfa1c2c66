"""Scripted-expert demonstrations through the env server's VecEnv and backend, recorded as a LeRobot v3.0 dataset."""

from __future__ import annotations

import numpy as np
import pytest

from rlfleet.data.datasets import Dataset, DatasetWriter
from services.env.backends.base import BackendUnavailable
from services.env.demos import collect_demonstrations, main
from services.env.vec_env import VecEnv


def test_expert_demonstrations_are_recorded_and_succeed(tmp_path):
    env = VecEnv("PandaPickCube-v0", 3, max_episode_steps=30, auto_reset=False)
    w = DatasetWriter(tmp_path / "d", env_id="PandaPickCube-v0", simulator="gym", fps=10, source="test")
    stats = collect_demonstrations(env, w, 4, 123, log=lambda s: None)
    w.close()
    env.close()
    d = Dataset(tmp_path / "d")
    assert stats["episodes"] == 4 and len(d) == 4
    assert [m["seed"] for m in d.episodes_meta] == sorted(m["seed"] for m in d.episodes_meta)
    assert {m["seed"] for m in d.episodes_meta} <= set(range(123, 123 + stats["attempts"]))
    for ep in d:
        assert ep.length == 30 and ep.success.any() and ep.instruction
        assert ep.observations["state"].shape == (30, 13) and ep.actions.shape == (30, 4)
        # the recorded observation is the one the action was taken on: the first is the reset state
    again = VecEnv("PandaPickCube-v0", 1, max_episode_steps=30, auto_reset=False)
    first = d.episode(0)
    obs = again.reset([0], [first.seed])
    np.testing.assert_allclose(obs["state"][0], first.observations["state"][0])
    again.close()


def test_an_env_without_an_expert_says_so(tmp_path):
    env = VecEnv("Pendulum-v1", 1, max_episode_steps=5, auto_reset=False)
    w = DatasetWriter(tmp_path / "d", env_id="Pendulum-v1", simulator="gym", fps=10, source="test")
    with pytest.raises(BackendUnavailable, match="no scripted expert"):
        collect_demonstrations(env, w, 1, 0, log=lambda s: None)
    env.close()


def test_cli_writes_a_vision_dataset(tmp_path, capsys):
    code = main(
        [
            "--config",
            "pandapickcube_vision_sft_openvla_oft_tiny",
            "--out",
            str(tmp_path / "d"),
            "--episodes",
            "2",
            "env.train.max_episode_steps=12",
            "sft.only_successful=false",
        ]
    )
    assert code == 0
    d = Dataset(tmp_path / "d")
    assert len(d) == 2 and d.meta["env_id"] == "PandaPickCubeVision-v0"
    assert d.observation_features["third_person"]["shape"] == [64, 64, 3]
    assert "wrote" in capsys.readouterr().out
    # LeRobot v3.0 (tests/rlfleet/test_lerobot.py loads such a dataset with lerobot): cameras as videos
    assert (d.meta["codebase_version"], d.meta["fps"]) == ("v3.0", 10)
    assert d.features["observation.images.third_person"]["dtype"] == "video"
    assert d.features["observation.state"]["dtype"] == "float32"

"""`coordinatorctl start maniskill_pushcube_ppo_mlp` end to end: env servers from the maniskill environment
(mani-skill 3.0.1, sapien 3.0.3, CPU torch), inference and learner from the main one, real PPO on PushCube-v1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.services.coordinator.test_end_to_end import assert_coordinator_loaded_no_env_code, modules_env

pytestmark = [pytest.mark.slow, pytest.mark.sim]

CTL = [sys.executable, "-m", "services.coordinator.cli"]


def test_maniskill_pushcube_runs_end_to_end_in_its_own_environment(tmp_path):
    from tests.simenv import sim_python

    sim_python("maniskill")  # builds the environment first (or skips, saying why), outside the run's timings
    proc = subprocess.run(
        [
            *CTL,
            "start",
            "maniskill_pushcube_ppo_mlp",
            f"runner.logger.log_path={tmp_path}",
            "runner.max_epochs=2",
            "runner.experiment_name=ms",
            "env.train.total_num_envs=4",
            "env.train.max_steps_per_rollout_epoch=25",
            "env.train.max_episode_steps=25",
            "env.eval.total_num_envs=4",
            "env.eval.num_episodes=4",
            "env.eval.max_episode_steps=10",
            "actor.micro_batch_size=50",
            "actor.global_batch_size=100",
            "algorithm.update_epoch=2",
            "actor.model.hidden_dims=[32,32]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=modules_env(tmp_path / "modules.json"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_coordinator_loaded_no_env_code(tmp_path / "modules.json")
    log = (tmp_path / "ms" / "logs" / "env_0.log").read_text()
    assert "maniskill:PushCube-v1" in log and "mani-skill 3.0.1" in log and "sapien 3.0.3" in log
    summary = json.loads((tmp_path / "ms" / "summary.json").read_text())
    assert summary["env_id"] == "PushCube-v1" and summary["final_eval"]["eval/num_episodes"] == 4
    assert 0.0 <= summary["final_eval"]["eval/success_once"] <= 1.0
    metrics = [json.loads(line) for line in (tmp_path / "ms" / "metrics.jsonl").read_text().splitlines()]
    assert any("train/actor/policy_loss" in m for m in metrics)

"""The results table's path, shortened: scripted-expert demonstrations -> supervised fine-tuning -> RL from that
model through every service, with the base evaluated before training and evaluation videos written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlfleet.data.metrics import read_metrics

pytestmark = pytest.mark.slow

CTL = [sys.executable, "-m", "services.coordinator.cli"]
SHORT = [
    "env.train.max_episode_steps=16",
    "env.eval.max_episode_steps=16",
    "env.train.total_num_envs=4",
    "env.eval.total_num_envs=4",
    "env.eval.num_episodes=4",
]


@pytest.mark.parametrize(
    "rl_config,extra",
    [
        ("pandapickcube_vision_ppo_openvla_oft_sft", []),
        ("pandapickcube_vision_grpo_openvla_oft_sft", ["algorithm.group_size=2"]),
    ],
)
def test_demos_sft_then_rl(tmp_path, rl_config, extra):
    sft_cfg = "pandapickcube_vision_sft_openvla_oft_tiny"
    common = [f"runner.logger.log_path={tmp_path}", *SHORT]
    demos = subprocess.run(
        [
            *CTL,
            "collect-demos",
            sft_cfg,
            *common,
            "sft.num_demos=3",
            "sft.only_successful=false",
            "env.train.max_steps_per_rollout_epoch=16",
            "actor.global_batch_size=16",
            "actor.micro_batch_size=16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demos.returncode == 0, demos.stdout[-2000:] + demos.stderr[-2000:]
    assert "wrote 3 episodes" in demos.stdout
    sft = subprocess.run(
        [
            *CTL,
            "sft",
            sft_cfg,
            *common,
            "sft.max_steps=4",
            "sft.batch_size=8",
            "env.train.max_steps_per_rollout_epoch=16",
            "actor.global_batch_size=16",
            "actor.micro_batch_size=16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert sft.returncode == 0, sft.stdout[-2000:] + sft.stderr[-2000:]
    model = tmp_path / sft_cfg / "sft_model"
    assert (model / "model.safetensors").is_file() and "actor.model.model_path=" in sft.stdout
    rl = subprocess.run(
        [
            *CTL,
            "start",
            rl_config,
            *common,
            f"actor.model.model_path={model}",
            "runner.max_epochs=2",
            "runner.val_check_interval=0",
            "env.eval.video_episodes=2",
            "env.train.max_steps_per_rollout_epoch=16",
            "actor.global_batch_size=16",
            "actor.micro_batch_size=16",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert rl.returncode == 0, rl.stdout[-3000:] + rl.stderr[-3000:]
    run = tmp_path / rl_config
    summary = json.loads((run / "summary.json").read_text())
    assert summary["initial_eval"]["eval/num_episodes"] == 4 and summary["initial_eval"]["step"] == 0
    assert summary["epochs"] == 2 and summary["final_eval"]["eval/num_episodes"] == 4
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    assert len(rows) == 2 and rows[0]["train/actor/first_logprob_abs_diff"] < 1e-5
    # algorithm.kl_beta: the penalty to the SFT model as reference. In epoch 0 that model also collected the
    # rollouts, so the KL to the reference is the KL to the behaviour policy (approx_kl: the same k3 estimator with
    # the log-ratio's sign flipped, equal to second order): 0 at the first step, > 0 once the policy has moved, and
    # exactly 0 while it has not (GRPO where every group's episodes end alike: no advantage, no step moves it)
    kl = [r["train/actor/kl_loss"] for r in rows]
    moved = [r["train/actor/approx_kl"] > 0 for r in rows]  # the policy left the weights it collected with
    assert kl[0] == pytest.approx(rows[0]["train/actor/approx_kl"], rel=0.2, abs=1e-12), rows[0]
    assert (kl[0] > 0) == moved[0] and (kl[1] > 0) == (moved[0] or moved[1]), (kl, moved)
    if "_ppo_" in rl_config:
        assert moved[0]  # PPO's critic gives the samples advantages: the policy moves away from the reference
    for step in (0, 2):
        gifs = sorted((run / "videos" / f"eval_epoch{step:04d}").glob("*.gif"))
        assert [g.name.split("_")[0] for g in gifs] == ["episode000", "episode001"], gifs
        assert "_seed1000000_" in gifs[0].name

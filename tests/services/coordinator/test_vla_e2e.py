"""The built-in VLA configs end to end through every service (`coordinatorctl start NAME`), shortened."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlfleet.data.metrics import read_metrics

pytestmark = pytest.mark.slow

CTL = [sys.executable, "-m", "services.coordinator.cli"]


@pytest.mark.parametrize(
    "name, lora, ranks",
    [
        ("pandapickcube_vision_ppo_openvla_tiny", False, 1),
        pytest.param("metaworld_mt10_ppo_pi05_tiny", False, 1, marks=pytest.mark.sim),
        # the learner as 2 ranks (FSDP2 over gloo): LoRA adapters sharded, the π0 expert's blocks sharded. One rank of
        # the same configs is what tests/services/learner/test_rank_group.py compares these two ranks with, step by step
        ("pandapickcube_vision_grpo_openvla_oft_tiny", True, 2),
        pytest.param("metaworld_mt10_ppo_pi0_tiny", False, 2, marks=pytest.mark.sim),
    ],
    ids=lambda v: f"{v}rank" if isinstance(v, int) else None,
)
def test_vla_config_runs_end_to_end(tmp_path, name, lora, ranks):
    # the LoRA run also takes a KL penalty: its reference is the base with the adapters off (no second copy)
    kl = ["algorithm.kl_beta=0.05"] if lora else []
    proc = subprocess.run(
        [
            *CTL,
            "start",
            name,
            f"runner.logger.log_path={tmp_path}",
            "runner.max_epochs=3",
            "runner.val_check_interval=2",
            "env.eval.num_episodes=4",
            "env.eval.total_num_envs=4",
            f"cluster.learner_world_size={ranks}",
            *kl,
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 3 and summary["final_eval"]["eval/num_episodes"] == 4
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    assert [r["train/weights_version"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(r["train/learner_ranks"] == ranks for r in rows)
    for r in rows:
        assert all(v == v and abs(v) < 1e6 for k, v in r.items() if k.startswith("train/") and "bytes" not in k), r
        assert r["train/actor/first_logprob_abs_diff"] < 1e-5
        assert ("train/actor/kl_loss" in r) == lora
    sync = rows[-1]["train/weight_sync_bytes"]
    if lora:  # only the adapters travel after the first full set
        assert 0 < sync < 1_000_000, sync
    else:  # every tensor is trained: the full set every time
        assert sync > 2_000_000, sync


def test_vllm_backend_trains_end_to_end_through_a_failed_reload(tmp_path):
    """rollout.backend=vllm: the inference server runs from the vLLM environment, vLLM decodes the action tokens,
    and the first weight reload is cut off half-way (fault injection): the server rebuilds its engine and the run
    goes on, every epoch training on vLLM's log-probs with the learner's recomputation within 1e-3."""
    import os

    name = "pandapickcube_vision_ppo_openvla_tiny"
    from tests.simenv import backend_python

    backend_python("vllm")  # built (or skipped with the reason) before the run's clock starts
    proc = subprocess.run(
        [
            *CTL,
            "start",
            name,
            "rollout.backend=vllm",
            f"runner.logger.log_path={tmp_path}",
            "runner.max_epochs=3",
            "runner.val_check_interval=2",
            "env.eval.num_episodes=4",
            "env.eval.total_num_envs=4",
        ],
        capture_output=True,
        text=True,
        timeout=500,
        env={**os.environ, "RLFLEET_FAULT_VLLM_RELOAD_FAILURES": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / name
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    assert [r["train/weights_version"] for r in rows] == [1.0, 2.0, 3.0]
    for r in rows:
        assert r["train/actor/first_logprob_abs_diff"] < 1e-3, r
    log = (run / "logs" / "inference_0.log").read_text()
    assert "vllm" in log.lower() and "reload for version 1 failed" in log and "rebuilding the engine" in log, log[
        -3000:
    ]

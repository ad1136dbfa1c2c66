"""`coordinatorctl start` with every logger backend in its offline mode: the learner's W&B and SwanLab run files hold
exactly what metrics.jsonl holds (real wandb and swanlab packages; no network)."""

from __future__ import annotations

import os
import subprocess

import pytest

from rlfleet.data.metrics import read_metrics
from tests.rlfleet.test_loggers import _swanlab_scalars, _wandb_history
from tests.services.coordinator.test_end_to_end import CTL, TINY

pytestmark = pytest.mark.slow


def test_learner_logs_to_wandb_and_swanlab_offline(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("swanlab")
    env = {**os.environ, "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)
    proc = subprocess.run(
        [
            *CTL,
            "start",
            *TINY,
            f"runner.logger.log_path={tmp_path}",
            "runner.experiment_name=lg",
            "runner.max_epochs=3",
            "runner.val_check_interval=0",
            "runner.logger.logger_backends=[tensorboard,wandb,swanlab]",
            "runner.logger.wandb_mode=offline",
            "runner.logger.swanlab_mode=offline",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "lg"
    assert "tensorboard/, wandb/, swanlog/, checkpoints/" in proc.stdout
    assert "is off" not in (run / "logs" / "learner_0.log").read_text()
    expected: dict[int, dict[str, float]] = {}
    for record in read_metrics(run):  # train and final-eval records of one step are one W&B/SwanLab step
        expected.setdefault(record["step"], {}).update(
            {k: v for k, v in record.items() if k not in ("step", "wall_time") and v is not None}
        )
    assert sorted(expected) == [1, 2, 3] and "eval/success_once" in expected[3]
    (wandb_file,) = run.glob("wandb/offline-run-*/run-*.wandb")
    assert _wandb_history(wandb_file) == expected
    (swanlab_file,) = run.glob("swanlog/run-*/run-*.swanlab")
    assert _swanlab_scalars(swanlab_file) == expected

"""The run stops once it has learned: runner.early_stop_success_rate held on runner.early_stop_evals evaluations in
a row (the default run: 95% twice), counted over --resume; off with a null rate."""

from __future__ import annotations

import json
import subprocess

import pytest

from rlfleet.config import ConfigError, load_config
from services.coordinator.report import learned
from tests.services.coordinator.tiny_run import CTL
from tests.services.coordinator.tiny_run import TINY as TINY_RUN

TINY = [
    *TINY_RUN,
    "runner.val_check_interval=1",
    "runner.early_stop_success_rate=0.0",  # every evaluation reaches it: the count of evaluations decides
]


def evals(*rates):
    return [{"step": 5 * (i + 1), "eval/success_once": r, "eval/num_episodes": 100.0} for i, r in enumerate(rates)]


def test_the_last_evaluations_in_a_row_decide():
    assert learned(evals(0.96, 0.97), 0.95, 2) == (
        "eval success_once >= 95% on 2 evaluations in a row (96.0%, 97.0%; runner.early_stop_success_rate)"
    )
    assert learned(evals(0.5, 0.96), 0.95, 2) is None  # one in a row so far
    assert learned(evals(0.96, 0.5, 0.97), 0.95, 2) is None  # a miss starts the count again
    assert learned(evals(0.97, 0.5, 0.96, 0.99, 1.0), 0.95, 2).endswith(
        "(99.0%, 100.0%; runner.early_stop_success_rate)"
    )
    assert (
        learned(evals(0.96), 0.95, 1)
        == "eval success_once >= 95% on 1 evaluation (96.0%; runner.early_stop_success_rate)"
    )
    assert learned(evals(1.0, 1.0, 1.0), None, 1) is None  # off
    assert learned([], 0.0, 1) is None
    assert learned([{"step": 5, "eval/success_once": None}], 0.0, 1) is None  # no value is no success


def test_the_default_run_stops_at_95_percent_twice_and_the_keys_are_checked():
    cfg = load_config(None)
    assert cfg.runner.early_stop_success_rate == 0.95 and cfg.runner.early_stop_evals == 2
    assert load_config(None, ["runner.early_stop_success_rate=null"]).runner.early_stop_success_rate is None
    with pytest.raises(ConfigError, match="runner.early_stop_evals"):
        load_config(None, ["runner.early_stop_evals=0"])
    with pytest.raises(ConfigError, match="runner.early_stop_success_rate"):
        load_config(None, ["runner.early_stop_success_rate=95"])


@pytest.mark.slow
def test_a_run_stops_after_n_evaluations_in_a_row_counted_over_resume(tmp_path):
    run = tmp_path / "early"
    base = [*CTL, "start", *TINY, f"runner.logger.log_path={tmp_path}", "runner.experiment_name=early"]
    # 3 in a row wanted; the budget (2 epochs) ends the first part after 2 evaluations
    first = subprocess.run(
        [*base, "runner.early_stop_evals=3", "runner.max_epochs=2"], capture_output=True, text=True, timeout=240
    )
    assert first.returncode == 0, first.stdout + first.stderr
    assert "training done after" in first.stdout and "runner.max_epochs=2 reached" in first.stdout
    # `coordinatorctl status RUN_DIR` of the ended run: its summary, not "no running coordinator"
    status = subprocess.run([*CTL, "status", str(run)], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.startswith(f"early: ended: runner.max_epochs=2 reached  ({run})"), status.stdout
    assert "  final evaluation: success_once " in status.stdout and "over 4 episodes" in status.stdout
    assert "  2 epochs, 400 env steps" in status.stdout
    assert f"last checkpoint: {run / 'checkpoints' / 'global_step_2'}" in status.stdout
    # resumed with room for 10 epochs: the third evaluation in a row (epoch 3) ends it
    resumed = subprocess.run(
        [*CTL, "start", "--resume", str(run), "runner.max_epochs=10"], capture_output=True, text=True, timeout=240
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    why = "eval success_once >= 0% on 3 evaluations in a row"
    assert why in resumed.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 3 and summary["stop_reason"].startswith(why), summary["stop_reason"]
    assert [e["step"] for e in summary["eval_history"]] == [1, 2, 3]
    # the final evaluation is the last one in a row (not run again), the checkpoint is the stopping epoch's
    assert summary["final_eval"]["eval/num_episodes"] == 4 and summary["final_eval"] == summary["eval_history"][-1]
    assert summary["checkpoint"].endswith("global_step_3")
    assert "final evaluation: success_once" in resumed.stdout and "last checkpoint:" in resumed.stdout
    status = subprocess.run([*CTL, "status", str(run)], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.startswith(f"early: ended: {why}"), status.stdout
    assert "  3 epochs, 600 env steps" in status.stdout and "global_step_3" in status.stdout

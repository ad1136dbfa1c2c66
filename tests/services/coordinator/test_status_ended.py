"""`coordinatorctl status RUN_DIR` of a run no coordinator runs any more: its folder's account of how it ended
(a finished run's summary, a stopped run's last evaluation, a crashed run's metrics), read as untrusted files.
A real run's folder: tests/services/coordinator/test_early_stop.py."""

from __future__ import annotations

import json

import pytest

from services.coordinator import cli
from services.coordinator.ended import ended_run


def run_folder(tmp_path, summary=None, metrics=(), checkpoints=(), dead_pid=True):
    run = tmp_path / "r"
    (run / "checkpoints").mkdir(parents=True)
    for n in checkpoints:
        (run / "checkpoints" / f"global_step_{n}").mkdir()
        (run / "checkpoints" / f"global_step_{n}" / "learner_state.json").write_text("{}")
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if dead_pid:  # a coordinator.json whose process is gone
        (run / "coordinator.json").write_text(json.dumps({"address": "127.0.0.1:1", "pid": 2**22 + 12345}))
    return run


EV = {"eval/success_once": 0.97, "eval/num_episodes": 100.0, "eval/return": 12.5}
TRAIN = [{"step": s, "env/env_steps": 1024.0 * s, "train/loss": 0.1} for s in (1, 2, 3, 4)]


def test_a_finished_run_prints_its_summary(tmp_path, capsys):
    why = "eval success_once >= 95% on 2 evaluations in a row (96.0%, 97.0%; runner.early_stop_success_rate)"
    summary = {
        "experiment_name": "x",
        "epochs": 4,
        "env_steps": 4096,
        "train_wall_time_s": 21.6,
        "stop_reason": why,
        "final_eval": {"step": 4, **EV},
        "checkpoint": "ignored",
    }
    run = run_folder(tmp_path, summary, TRAIN + [{"step": 4, **EV}], checkpoints=(2, 4))
    assert cli.main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"x: ended: {why}  ({run})\n"), out
    assert "  final evaluation: success_once 97.0% [" in out and "over 100 episodes, return 12.50" in out
    assert "  4 epochs, 4096 env steps, 22s of training" in out
    assert f"  last checkpoint: {run / 'checkpoints' / 'global_step_4'}" in out
    assert "--resume" not in out  # it ended with its final evaluation: nothing to continue


def test_a_stopped_run_names_its_last_evaluation_and_the_resume(tmp_path):
    summary = {"epochs": 4, "env_steps": 4096, "stop_reason": "coordinatorctl stop", "final_eval": {}}
    summary["eval_history"] = [{"step": 2, **EV}]
    lines = ended_run(run_folder(tmp_path, summary, TRAIN, checkpoints=(4,)))
    assert lines[0].startswith("r: ended: coordinatorctl stop")
    assert lines[1].startswith(
        "  no final evaluation (the run was stopped); last evaluation @ epoch 2: success_once 97"
    )
    assert lines[-1] == f"  continue it with: coordinatorctl start --resume {tmp_path / 'r'}"


def test_a_crashed_run_and_a_stale_summary_read_from_the_metrics(tmp_path):
    # no summary: the run died (kill -9, a learner crash)
    lines = ended_run(run_folder(tmp_path, None, TRAIN[:3] + [{"step": 2, **EV}], checkpoints=(2,)))
    assert "ended without a summary" in lines[0] and lines[1] == "  3 epochs, 3072 env steps (metrics.jsonl)"
    assert lines[2].startswith("  last evaluation @ epoch 2: success_once 97.0%")
    assert "--resume" in lines[-1]


def test_a_stale_summary_of_an_earlier_part_is_not_the_answer(tmp_path):
    # a summary of 2 epochs, then a resumed part trained 4 and died: the metrics say more than the summary
    summary = {"epochs": 2, "env_steps": 2048, "stop_reason": "runner.max_epochs=2 reached", "final_eval": EV}
    lines = ended_run(run_folder(tmp_path, summary, TRAIN, checkpoints=(2, 4)))
    assert "ended without a summary" in lines[0] and lines[1].startswith("  4 epochs, 4096 env steps")


def test_hostile_values_are_left_out_and_a_bad_file_is_named(tmp_path, capsys):
    summary = {
        "experiment_name": ["x"],
        "epochs": "many",
        "stop_reason": "a\nb",
        "final_eval": {"eval/success_once": 7},
    }
    lines = ended_run(run_folder(tmp_path, summary))
    assert lines[0].startswith("r: ended: a b") and "  ? epochs, ? env steps" in lines
    (tmp_path / "r" / "summary.json").write_text("{not json")
    assert cli.main(["status", str(tmp_path / "r")]) == 2
    assert "summary.json" in capsys.readouterr().err


def test_a_folder_without_results_keeps_todays_answer(tmp_path):
    (tmp_path / "empty").mkdir()
    assert ended_run(tmp_path / "empty") is None
    with pytest.raises(SystemExit, match="no running coordinator found"):
        cli.main(["status", str(tmp_path / "empty")])

"""benchmarks/time_to_success.py's reading of a run: the time to a threshold leaves out every evaluation up to and
including the one that reached it (eval/wall_time_s is stamped after that evaluation)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import time_to_success  # noqa: E402


def test_times_leave_out_every_evaluation_up_to_the_one_that_reached_the_threshold(tmp_path):
    records = [
        {"step": 4, "time/elapsed": 2.0, "env/env_steps": 4096.0},
        {"step": 5, "time/elapsed": 2.5, "env/env_steps": 5120.0},
        {"step": 5, "eval/success_once": 0.6, "eval/env_steps": 5120.0, "eval/wall_time_s": 3.5, "time/eval": 1.0},
        {"step": 10, "time/elapsed": 6.0, "env/env_steps": 10240.0},
        {"step": 10, "eval/success_once": 0.96, "eval/env_steps": 10240.0, "eval/wall_time_s": 7.5, "time/eval": 1.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    h = time_to_success.hits(tmp_path)
    assert h[0.5] == (5, 5120.0, 3.5, 2.5)  # 3.5 s at the end of the first evaluation, 1.0 s of it evaluating
    assert h[0.9] == h[0.95] == (10, 10240.0, 7.5, 5.0)  # both evaluations' 2.5 s left out
    assert h[0.95][3] == records[3]["time/elapsed"] - 1.0  # the training clock at that epoch, less the first evaluation
    assert h["rate"] == 10240.0 / 5.0


def test_each_run_is_read_against_the_raw_rate_just_before_and_after_it():
    """The raw simulator is measured before the first run and after each run (the host's speed drifts over minutes
    here): a run's ratio uses its own two; the table gives the median run's with the runs' range."""
    mean, spread = time_to_success.raw_interval(8000.0, 10000.0)
    assert mean == 9000.0 and spread == "8,000-10,000"
    with pytest.raises(ValueError, match="0.0 before"):
        time_to_success.raw_interval(0.0, 9000.0)
    runs = [
        {"rate": 3600.0, "raw": (8000.0, 10000.0)},  # 40%
        {"rate": 3000.0, "raw": (10000.0, 10000.0)},  # 30%
        {"rate": 4500.0, "raw": (10000.0, 8000.0)},  # 50%
    ]
    assert time_to_success.run_ratio(runs[0], "rate") == pytest.approx(0.4)
    assert time_to_success.runs_ratio_cell(runs, "rate") == "40% (30%-50%)"
    assert time_to_success.runs_ratio_cell(runs, "floor") == "-"  # no floor in these runs
    assert time_to_success.runs_ratio_cell([*runs, {"rate": 1.0}], "rate") == "-"  # a run without its raw rates


def test_the_floor_is_the_stepping_acting_and_update_of_every_training_epoch(tmp_path):
    """The synchronous loop with every call between its parts free: the slower server's stepping and acting plus the
    learner's update, summed over the epochs; no floor from a run that lacks one of them."""
    parts = {"time/env": 0.10, "time/inference_wait": 0.015, "time/train": 0.045}
    records = [
        {"step": 1, "time/elapsed": 0.2, "env/env_steps": 1024.0, **parts},
        {"step": 2, "time/elapsed": 0.4, "env/env_steps": 2048.0, **parts, "time/env": 0.12},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    h = time_to_success.hits(tmp_path)
    assert h["floor"] == pytest.approx(2048.0 / (0.16 + 0.18))
    assert h["rate"] == pytest.approx(2048.0 / 0.4) and h["floor"] > h["rate"]
    h["raw"] = (10000.0, 10000.0)
    assert time_to_success.floor_cell([h, h]) == f"{h['floor']:,.0f}, 60% (60%-60%)"
    records[1].pop("time/inference_wait")  # e.g. a run from before the key: no floor rather than a wrong one
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "floor" not in time_to_success.hits(tmp_path)
    assert time_to_success.floor_cell([h, {}]) == "-"


def test_an_asynchronous_run_has_no_floor(tmp_path):
    """Its update overlaps the rollouts: the sum of the parts is no floor of its epochs."""
    parts = {"time/env": 0.10, "time/inference_wait": 0.015, "time/train": 0.045}
    records = [
        {"step": 1, "time/elapsed": 0.2, "env/env_steps": 1024.0, "rollout/staleness": 0.0, **parts},
        {"step": 2, "time/elapsed": 0.3, "env/env_steps": 2048.0, "rollout/staleness": 1.0, **parts},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    h = time_to_success.hits(tmp_path)
    assert "rate" in h and "floor" not in h

"""The learning curve survives partial, odd or cut-off metrics records."""

import json

from services.coordinator.plots import plot_learning_curve


def test_partial_and_forged_records_are_skipped(tmp_path):
    lines = [json.dumps({"step": 1, "env/env_steps": 800, "env/success_once": 0.5, "env/return": 1.0}),
             json.dumps({"step": 2, "eval/success_once": 1.0}),  # no eval/env_steps
             json.dumps({"step": 3, "env/env_steps": "lots"}),   # not a number
             json.dumps([1, 2, 3]),                               # not a record
             '{"step": 4, "env/env_ste']                          # cut off by a crash
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    out = plot_learning_curve(tmp_path)
    assert out is not None and out.stat().st_size > 0

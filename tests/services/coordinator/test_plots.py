"""The learning curve survives partial, odd or cut-off metrics records."""

import json

import matplotlib.pyplot as plt

from services.coordinator.plots import plot_learning_curve


def _plotted(monkeypatch, run_dir):
    """Run plot_learning_curve and return {line label: (xs, ys)} of the figure it drew."""
    figures = []
    close = plt.close

    def keep(fig=None):
        figures.append(fig)
        close(fig)

    monkeypatch.setattr(plt, "close", keep)
    out = plot_learning_curve(run_dir)
    assert out is not None and out.stat().st_size > 0
    assert len(figures) == 1
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for ax in figures[0].axes
        for line in ax.get_lines()
    }


def test_partial_and_forged_records_are_skipped(tmp_path, monkeypatch):
    lines = [
        json.dumps({"step": 1, "env/env_steps": 800, "env/success_once": 0.5, "env/return": 1.0}),
        json.dumps({"step": 2, "eval/success_once": 1.0}),  # no eval/env_steps
        json.dumps({"step": 3, "env/env_steps": "lots"}),  # not a number
        json.dumps([1, 2, 3]),  # not a record
        json.dumps(
            {
                "step": 4,
                "env/env_steps": 1600,
                "env/success_once": "half",
                "env/return": None,
                "eval/env_steps": 1600,
                "eval/success_once": 0.25,
            }
        ),  # odd train values, a good eval
        '{"step": 5, "env/env_ste',
    ]  # cut off by a crash
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    curves = _plotted(monkeypatch, tmp_path)
    # only the well-formed values are drawn: step 1's training point, step 4's evaluation
    assert curves == {
        "train env/success_once": ([0.8], [0.5]),
        "eval/success_once": ([1.6], [0.25]),
        "env/return": ([0.8], [1.0]),
    }

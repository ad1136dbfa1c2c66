"""Learning-curve PNG from a run's metrics.jsonl."""

from __future__ import annotations

import pathlib

from rlfleet.data.metrics import read_metrics


def plot_learning_curve(run_dir: str | pathlib.Path) -> pathlib.Path | None:
    records = read_metrics(run_dir)

    def has(r, *keys):  # partial or odd records (a crash mid-write, a hand-edited file) are skipped
        return all(isinstance(r.get(k), (int, float)) for k in keys)

    train = [r for r in records if has(r, "env/env_steps")]
    evals = [r for r in records if has(r, "eval/success_once", "eval/env_steps")]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r["env/env_steps"] / 1000 for r in train]
    if any(has(r, "env/success_once") for r in train):
        ax1.plot(
            [x for x, r in zip(xs, train) if has(r, "env/success_once")],
            [r["env/success_once"] for r in train if has(r, "env/success_once")],
            label="train env/success_once",
            alpha=0.7,
        )
    if evals:
        ax1.plot(
            [r["eval/env_steps"] / 1000 for r in evals],
            [r["eval/success_once"] for r in evals],
            "o-",
            label="eval/success_once",
        )
    ax1.set_xlabel("env steps (k)")
    ax1.set_ylabel("success rate")
    ax1.set_ylim(-0.02, 1.02)
    ax1.grid(alpha=0.3)
    if ax1.get_legend_handles_labels()[0]:
        ax1.legend()
    rets = [(x, r["env/return"]) for x, r in zip(xs, train) if has(r, "env/return")]
    if rets:
        ax2.plot(*zip(*rets), label="env/return")
    ax2.set_xlabel("env steps (k)")
    ax2.set_ylabel("episode return")
    ax2.grid(alpha=0.3)
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend()
    fig.suptitle(pathlib.Path(run_dir).name)
    fig.tight_layout()
    out = pathlib.Path(run_dir) / "learning_curve.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out

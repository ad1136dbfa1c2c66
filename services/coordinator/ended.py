"""`coordinatorctl status RUN_DIR` of a run that no coordinator runs any more: what its folder says about how it
ended (summary.json, else metrics.jsonl and coordinator_state.json: a run that crashed or was killed writes no
summary). Every file is read as untrusted (rlfleet.untrusted): a value of the wrong type is left out, a file that
is not JSON is a BadFile naming it."""

from __future__ import annotations

import math
import pathlib

from rlfleet.data.checkpoint_files import latest_checkpoint
from rlfleet.data.intervals import rate_of
from rlfleet.data.metrics import read_metrics
from rlfleet.untrusted import read_json

MAX_SUMMARY_BYTES = 16 << 20  # a summary is KBs (its eval history grows by ~1 KB per evaluation)


def _int(d: dict, key: str) -> int | None:
    v = d.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _num(d: dict, key: str) -> float | None:
    v = d.get(key)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def _str(d: dict, key: str, limit: int = 500) -> str | None:
    v = d.get(key)
    return v[:limit].replace("\n", " ") if isinstance(v, str) else None


def _eval(ev) -> str | None:
    """'success_once 97.0% [...] over 100 episodes, return 12.34' of an evaluation record, or None."""
    if not isinstance(ev, dict):
        return None
    rate, n, ret = _num(ev, "eval/success_once"), _num(ev, "eval/num_episodes"), _num(ev, "eval/return")
    if rate is None or not 0 <= rate <= 1:
        return None
    line = (
        f"success_once {rate_of(rate, int(n))} over {int(n)} episodes" if n and n >= 1 else f"success_once {rate:.1%}"
    )
    return line + (f", return {ret:.2f}" if ret is not None else "")


def _last_step(records: list[dict]) -> tuple[int | None, int | None]:
    """(epochs trained, env steps) from metrics.jsonl's training records (step = epochs done)."""
    epochs = steps = None
    for r in records:
        if "train/weights_version" in r or "train/loss" in r or "env/env_steps" in r:
            s, e = _int(r, "step"), _num(r, "env/env_steps")
            if s is not None and (epochs is None or s >= epochs):
                epochs = s
                steps = int(e) if e is not None else steps
    return epochs, steps


def ended_run(run_dir: str | pathlib.Path) -> list[str] | None:
    """The lines that tell how the run of folder ``run_dir`` ended, or None when the folder holds no run's results
    (no summary.json, no metrics.jsonl: not a run folder, or a run that is only starting)."""
    run_dir = pathlib.Path(run_dir)
    summary_path = run_dir / "summary.json"
    summary = (
        read_json(summary_path, max_bytes=MAX_SUMMARY_BYTES, root=run_dir, what="run summary")
        if (summary_path.is_file())
        else None
    )
    records = read_metrics(run_dir)
    if summary is None and not records:
        return None
    epochs, env_steps = _last_step(records)
    ckpt = latest_checkpoint(run_dir) if (run_dir / "checkpoints").is_dir() else None
    name = (summary and _str(summary, "experiment_name", 200)) or run_dir.name
    if summary is not None and (epochs is None or (_int(summary, "epochs") or 0) >= epochs):
        why = _str(summary, "stop_reason") or "unknown"
        lines = [f"{name}: ended: {why}  ({run_dir})"]
        final = _eval(summary.get("final_eval"))
        if final:
            lines.append(f"  final evaluation: {final}")
        else:
            last = summary.get("eval_history")
            last = last[-1] if isinstance(last, list) and last else None
            ev = _eval(last)
            step = _int(last, "step") if isinstance(last, dict) else None
            lines.append(
                "  no final evaluation (the run was stopped)"
                + (f"; last evaluation @ epoch {step}: {ev}" if ev and step is not None else "")
            )
        epochs_s, steps_s, wall = (
            _int(summary, "epochs"),
            _int(summary, "env_steps"),
            _num(summary, "train_wall_time_s"),
        )
        lines.append(
            f"  {epochs_s if epochs_s is not None else '?'} epochs, {steps_s if steps_s is not None else '?'} env steps"
            + (f", {wall:.0f}s of training" if wall is not None else "")
        )
        bottleneck = _str(summary, "bottleneck")
        if bottleneck:
            lines.append(f"  bottleneck: {bottleneck}")
        resume = not final
    else:  # no summary, or one older than the epochs trained since (a resumed run that then died)
        lines = [
            f"{name}: ended without a summary (no coordinator runs it: it crashed or was killed)  ({run_dir})",
            f"  {epochs if epochs is not None else '?'} epochs, {env_steps if env_steps is not None else '?'} env steps"
            " (metrics.jsonl)",
        ]
        evals = [r for r in records if _eval(r) and _int(r, "step") is not None]
        if evals:
            lines.append(f"  last evaluation @ epoch {_int(evals[-1], 'step')}: {_eval(evals[-1])}")
        resume = True
    lines.append(f"  last checkpoint: {ckpt}" if ckpt else "  no checkpoint")
    lines.append(f"  run files: {run_dir}  (summary.json, metrics.jsonl, logs/)")
    if resume and ckpt:
        lines.append(f"  continue it with: coordinatorctl start --resume {run_dir}")
    return lines

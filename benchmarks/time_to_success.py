"""Time to 50/90/95% evaluation success_once: runs `coordinatorctl start` (the default run unless told
otherwise) with frequent evaluations and reads the run's metrics.jsonl.

    python benchmarks/time_to_success.py [key=value ...]        # extra overrides for coordinatorctl start
    python benchmarks/time_to_success.py --run-dir runs/X       # only analyse an existing run

Wall time counts from the first rollout (service start-up excluded) and includes the evaluations; the column
'w/o eval' subtracts the time spent evaluating before that point.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlfleet.metrics import read_metrics  # noqa: E402

THRESHOLDS = (0.5, 0.9, 0.95)


def analyse(run_dir: pathlib.Path) -> None:
    records = read_metrics(run_dir)
    evals = [r for r in records if r.get("eval/success_once") is not None]
    if not evals:
        raise SystemExit(f"no evaluations in {run_dir}/metrics.jsonl")
    print(f"\nrun: {run_dir}  ({len(evals)} evaluations of {int(evals[-1]['eval/num_episodes'])} episodes)")
    print("| eval success_once >= | epoch | env steps | wall time (s) | w/o eval (s) |")
    print("|---|---|---|---|---|")
    eval_time = 0.0
    hit: dict[float, tuple] = {}
    for r in evals:
        for th in THRESHOLDS:
            if th not in hit and r["eval/success_once"] >= th:
                hit[th] = (r["step"], r["eval/env_steps"], r["eval/wall_time_s"], r["eval/wall_time_s"] - eval_time)
        eval_time += r.get("time/eval", 0.0)
    for th in THRESHOLDS:
        if th in hit:
            step, steps, wall, train = hit[th]
            print(f"| {th:.0%} | {step} | {steps:,.0f} | {wall:.0f} | {train:.0f} |")
        else:
            print(f"| {th:.0%} | not reached | | | |")
    last = evals[-1]
    print(f"final: success_once {last['eval/success_once']:.1%} at epoch {last['step']}, "
          f"{last['eval/env_steps']:,.0f} env steps, {last['eval/wall_time_s']:.0f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default=None, help="analyse this run instead of starting one")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = ap.parse_args()
    if args.run_dir:
        analyse(pathlib.Path(args.run_dir))
        return
    log_path = tempfile.mkdtemp(prefix="rlfleet-tts-")
    cmd = [sys.executable, "-m", "services.coordinator.cli", "start", "runner.val_check_interval=5",
           f"runner.logger.log_path={log_path}", "runner.experiment_name=time_to_success", *args.overrides]
    print("$ coordinatorctl start " + " ".join(cmd[4:]), flush=True)
    subprocess.run(cmd, check=True)
    analyse(pathlib.Path(log_path) / "time_to_success")


if __name__ == "__main__":
    main()

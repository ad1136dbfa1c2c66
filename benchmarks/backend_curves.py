"""Learning curves of one config with each inference backend on the same seeds (rollout.backend: hf | vllm):
runs ``coordinatorctl start CONFIG rollout.backend=B runner.seed=S`` for every pair (or reads runs already in
--out), then prints, per block of epochs, the mean training reward per env step, the policy entropy, the PPO
approx-KL, the gap between the log-probs inference sent and the learner's recomputation, and env steps/s; and the
final evaluation of each run.

    python benchmarks/backend_curves.py [--config pandapickcube_vision_ppo_openvla_tiny] [--seeds 1,2]
        [--backends hf,vllm] [--block 5] [--out /tmp/backend_curves] [--reuse] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlfleet.data.metrics import read_metrics  # noqa: E402

COLUMNS = [
    ("env/reward", "reward/step", "{:.4f}"),
    ("train/actor/entropy_loss", "entropy", "{:.2f}"),
    ("train/actor/approx_kl", "approx_kl", "{:.4f}"),
    ("train/actor/first_logprob_abs_diff", "logp gap", "{:.1e}"),
    ("rollout/env_steps_per_s", "env steps/s", "{:.0f}"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="pandapickcube_vision_ppo_openvla_tiny")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--backends", default="hf,vllm")
    ap.add_argument("--block", type=int, default=5, help="epochs per row")
    ap.add_argument("--out", default="/tmp/backend_curves")
    ap.add_argument("--reuse", action="store_true", help="read finished runs in --out instead of running again")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    runs = {}
    for seed in args.seeds.split(","):
        for backend in args.backends.split(","):
            base = pathlib.Path(args.out) / f"{backend}-s{seed}"
            run = base / args.config
            if not (args.reuse and (run / "summary.json").is_file()):
                cmd = [
                    sys.executable,
                    "-m",
                    "services.coordinator.cli",
                    "start",
                    args.config,
                    f"rollout.backend={backend}",
                    f"runner.seed={seed}",
                    f"runner.logger.log_path={base}",
                    "runner.early_stop_success_rate=null",  # the curves over the whole budget
                    *args.overrides,
                ]
                print("$", " ".join(cmd), flush=True)
                if subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, env=dict(os.environ)).returncode:
                    print(f"run failed: {run}/logs", file=sys.stderr)
                    return 1
            runs[(backend, seed)] = run
    print(f"\n{args.config}, per block of {args.block} epochs (training metrics; reward is the mean per env step)\n")
    print("| backend | seed | epochs | " + " | ".join(c[1] for c in COLUMNS) + " |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    for (backend, seed), run in runs.items():
        rows = [r for r in read_metrics(run) if "train/loss" in r]
        for start in range(0, len(rows), args.block):
            block = rows[start : start + args.block]
            cells = []
            for key, _, fmt in COLUMNS:
                vals = [r[key] for r in block if key in r]
                cells.append(fmt.format(sum(vals) / len(vals)) if vals else "-")
            print(f"| {backend} | {seed} | {start + 1}-{start + len(block)} | " + " | ".join(cells) + " |")
    evals = {key: [r for r in read_metrics(run) if "eval/success_once" in r] for key, run in runs.items()}
    steps = sorted({int(r["step"]) for rows in evals.values() for r in rows})
    print("\nevaluation success_once by epoch (0 = the model before training)\n")
    print("| backend | seed | " + " | ".join(f"epoch {s}" for s in steps) + " |")
    print("|---|---|" + "---|" * len(steps))
    for (backend, seed), rows in evals.items():
        by = {int(r["step"]): r["eval/success_once"] for r in rows}
        print(f"| {backend} | {seed} | " + " | ".join(f"{by[s]:.2f}" if s in by else "-" for s in steps) + " |")
    print("\n| backend | seed | final eval success_once | final eval return | training time (s) |")
    print("|---|---|---|---|---|")
    for (backend, seed), run in runs.items():
        s = json.loads((run / "summary.json").read_text())
        ev = s.get("final_eval", {})
        print(
            f"| {backend} | {seed} | {ev.get('eval/success_once', float('nan')):.2f} | "
            f"{ev.get('eval/return', float('nan')):.2f} | {s.get('train_wall_time_s', 0):.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

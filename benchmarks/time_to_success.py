"""Time to 50/90/95% evaluation success_once over seeds, synchronous vs asynchronous training.

    python benchmarks/time_to_success.py [--config NAME] [--seeds 1,2,3] [--modes sync,async] [key=value ...]
    python benchmarks/time_to_success.py --run-dir runs/X        # only analyse an existing run

Each (mode, seed) is one `coordinatorctl start` of the default run or ``--config`` (e.g. pandapickcube_sac; plus the
overrides) with an evaluation of
100 seeded episodes every 5 epochs, stopped at the first evaluation at 95% (runner.early_stop_success_rate,
runner.early_stop_evals=1). Times are training wall time from the first rollout, evaluations excluded (their time is subtracted); env steps are training env steps. The
whole-loop rate is training env steps / training wall time (evaluations excluded), next to the raw simulator's
steps/s on all cores (the physical limit: benchmarks/throughput.py's raw stepping, one process per core), with
random actions and, where the task has a scripted expert, with the expert's actions (the grasp-and-lift steps of a
solved task, which cost the physics engine more than random actions do). The random-action rate is measured before
the first run and after each run (this host's speed drifts over minutes, and a run's stepping with it): each run's
ratio is read against the mean of the raw rates just before and just after it; the table gives the median run's,
with the runs' range in parentheses. The last column is the synchronous loop's floor: the same env steps over only the
slower env server's stepping and acting plus the learner's update, epoch by epoch (every call, push, publish and
wait between them taken as free): what the loop could reach without a faster simulator, policy or update.
Runs go to runner.logger.log_path when given, else a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlfleet.data.metrics import read_metrics  # noqa: E402

THRESHOLDS = (0.5, 0.9, 0.95)
MODES = {"sync": "algorithm.max_staleness=0", "async": "algorithm.max_staleness=1"}


def hits(run_dir: pathlib.Path) -> dict:
    """Per threshold: (epoch, env steps, wall s, wall s without evaluations) of the first evaluation reaching it;
    plus the run's whole-loop env steps/s."""
    records = read_metrics(run_dir)
    evals = [
        r
        for r in records
        if isinstance(r.get("eval/success_once"), (int, float)) and isinstance(r.get("eval/env_steps"), (int, float))
    ]
    out, eval_time = {}, 0.0
    for r in evals:
        eval_time += r.get("time/eval", 0.0)  # eval/wall_time_s is stamped after this evaluation: its time too
        for th in THRESHOLDS:
            if th not in out and r["eval/success_once"] >= th:
                out[th] = (r["step"], r["eval/env_steps"], r["eval/wall_time_s"], r["eval/wall_time_s"] - eval_time)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    train = [r for r in records if isinstance(r.get("time/elapsed"), (int, float))]
    if train:
        # the evaluations before the last epoch's record (an evaluation at step s follows epoch s's record)
        wall = train[-1]["time/elapsed"] - sum(
            r.get("time/eval", 0.0) for r in evals if 0 < r["step"] < train[-1]["step"]
        )
        out["rate"] = train[-1].get("env/env_steps", 0) / max(wall, 1e-9)
        # the floor of a synchronous run only: in an asynchronous one the update overlaps the rollouts
        floor = floor_seconds(train) if all(r.get("rollout/staleness", 0) == 0 for r in train) else None
        if floor:
            out["floor"] = train[-1].get("env/env_steps", 0) / floor
    out["final"] = summary.get("final_eval", {}).get("eval/success_once")
    return out


FLOOR_KEYS = ("time/env", "time/inference_wait", "time/train")


def floor_seconds(train: list[dict]) -> float | None:
    """The part of the training epochs' wall time that only a faster simulator, policy or update can take off: per
    epoch, the slower env server's stepping (``time/env``) and acting (``time/inference_wait``, collocated: the
    policy's forward in the env server) plus the learner's batch and update (``time/train``). Summed over the
    epochs, it is the synchronous loop with every call, push, publish and wait between them free. The two maxima
    may come from different env servers, so it can be a few ms per epoch high (the loop rate it gives a little
    low). Synchronous runs only (in an asynchronous one the update overlaps the rollouts). None where a run lacks
    these keys."""
    if not train or any(k not in r for r in train for k in FLOOR_KEYS):
        return None
    return sum(r[k] for r in train for k in FLOOR_KEYS)


def analyse(run_dir: pathlib.Path) -> None:
    h = hits(run_dir)
    print(f"\nrun: {run_dir}")
    print("| eval success_once >= | epoch | env steps | wall time (s) | w/o eval (s) |")
    print("|---|---|---|---|---|")
    for th in THRESHOLDS:
        if th in h:
            step, steps, wall, train = h[th]
            print(f"| {th:.0%} | {step} | {steps:,.0f} | {wall:.0f} | {train:.0f} |")
        else:
            print(f"| {th:.0%} | not reached | | | |")
    if "rate" in h:
        print(f"whole loop: {h['rate']:,.0f} env steps/s (evaluations excluded)")
    if "floor" in h:
        print(f"stepping + acting + update alone: {h['floor']:,.0f} env steps/s (every other cost taken as free)")


def raw_all_cores(cores: int, overrides=(), actions: str = "random", config: str | None = None) -> float | None:
    """The raw simulator's env steps/s with one stepping process per core (benchmarks/throughput.py --raw), for the
    run's config; ``actions`` "random" or "expert" (None when the task has no scripted expert)."""
    from rlfleet.config import load_config, to_yaml

    cfg = load_config(config, list(overrides))
    here = pathlib.Path(__file__).with_name("throughput.py")
    procs = [
        subprocess.Popen(
            [sys.executable, str(here), "--raw", to_yaml(cfg), "--steps", "400", "--raw-actions", actions],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(cores)
    ]
    outs = [p.communicate() for p in procs]
    failed = [err for p, (_, err) in zip(procs, outs) if p.returncode]
    if failed and actions == "expert" and "no scripted expert" in failed[0]:
        return None
    if failed:
        raise SystemExit(f"raw simulator stepping ({actions} actions) failed:\n{failed[0].strip()[-2000:]}")
    return sum(json.loads(out.strip().splitlines()[-1])["rate"] for out, _ in outs)


def raw_interval(before: float, after: float) -> tuple[float, str]:
    """Two raw rates (just before and just after a run; or the lowest and highest of a reading) -> (their mean,
    "before-after" as text)."""
    if before <= 0 or after <= 0:
        raise ValueError(f"raw simulator rates must be positive, got {before} before and {after} after the runs")
    return (before + after) / 2, f"{min(before, after):,.0f}-{max(before, after):,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default=None, help="analyse this run instead of starting any")
    ap.add_argument("--config", default=None, help="a built-in config or YAML (default: the default run)")
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated run seeds")
    ap.add_argument("--modes", default="sync,async", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for coordinatorctl start")
    args = ap.parse_args()
    if args.run_dir:
        analyse(pathlib.Path(args.run_dir))
        return
    args.seeds = [int(x) for x in args.seeds.split(",")]
    args.modes = args.modes.split(",")
    if set(args.modes) - set(MODES):
        ap.error(f"--modes: {sorted(set(args.modes) - set(MODES))} not in {list(MODES)}")
    given = [o for o in args.overrides if o.startswith("runner.logger.log_path=")]
    log_path = given[-1].split("=", 1)[1] if given else tempfile.mkdtemp(prefix="rlfleet-tts-")
    cores = os.cpu_count() or 1
    raws = [raw_all_cores(cores, args.overrides, config=args.config)]  # before the first run, then after each
    print(f"raw simulator before the runs, {cores} processes (one per core): {raws[0]:,.0f} env steps/s", flush=True)
    rows = {}
    for mode in args.modes:
        for seed in args.seeds:
            name = f"tts_{mode}_seed{seed}"
            cmd = [
                sys.executable,
                "-m",
                "services.coordinator.cli",
                "start",
                "--quiet",
                *([args.config] if args.config else []),
                "runner.val_check_interval=5",
                "runner.early_stop_success_rate=0.95",
                "runner.early_stop_evals=1",  # the time to the first evaluation at 95%
                f"runner.seed={seed}",
                MODES[mode],
                f"runner.experiment_name={name}",
                *args.overrides,
            ]
            if not given:
                cmd.append(f"runner.logger.log_path={log_path}")
            print("$ coordinatorctl start " + " ".join(cmd[5:]), flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            run = sorted(pathlib.Path(log_path).glob(f"{name}*"), key=lambda p: p.stat().st_mtime)[-1]
            rows[(mode, seed)] = h = hits(run)
            raws.append(raw_all_cores(cores, args.overrides, config=args.config))
            h["raw"] = (raws[-2], raws[-1])  # the raw rate just before and just after this run
            analyse(run)
            print(f"raw simulator after this run: {raws[-1]:,.0f} env steps/s", flush=True)
    _, spread = raw_interval(min(raws), max(raws))
    expert = raw_all_cores(cores, args.overrides, "expert", config=args.config)
    print(
        f"\nraw simulator, {cores} processes (one per core): {statistics.mean(raws):,.0f} env steps/s with random "
        f"actions (mean of {len(raws)} measurements, before, between and after the runs: {spread}), "
        + (f"{expert:,.0f} with the scripted expert's (after)" if expert else "no scripted expert")
    )
    if max(raws) - min(raws) > 0.1 * statistics.mean(raws):
        print(f"note: the raw rate moved {(max(raws) - min(raws)) / statistics.mean(raws):.0%} during the runs")
    print(
        f"\n| mode | seeds | to 50% (s / k steps) | to 90% (s / k steps) | to 95% median (s) | to 95% worst (s) | "
        f"to 95% env steps (median, worst) | whole loop env steps/s | / raw on {cores} cores, random: median run "
        f"(runs' range), expert | stepping + acting + update alone: env steps/s, / random raw |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        runs = [rows[(mode, s)] for s in args.seeds]

        def cell(th):
            got = [r[th] for r in runs if th in r]
            if len(got) < len(runs):
                return f"{len(got)}/{len(runs)} reached"
            return f"{statistics.median(g[3] for g in got):.0f} / {statistics.median(g[1] for g in got) / 1000:.0f}k"

        got95 = [r[0.95] for r in runs if 0.95 in r]
        med95 = f"{statistics.median(g[3] for g in got95):.0f}" if len(got95) == len(runs) else "-"
        worst95 = (
            f"{max(g[3] for g in got95):.0f}" if len(got95) == len(runs) else f"not reached by {len(runs) - len(got95)}"
        )
        steps95 = (
            f"{statistics.median(g[1] for g in got95) / 1000:.0f}k, {max(g[1] for g in got95) / 1000:.0f}k"
            if got95
            else "-"
        )
        rate = statistics.median(r.get("rate", 0.0) for r in runs)
        floor = floor_cell(runs) if mode == "sync" else "- (the update overlaps the rollouts)"
        print(
            f"| {mode} | {', '.join(map(str, args.seeds))} | {cell(0.5)} | {cell(0.9)} | {med95} | {worst95} | "
            f"{steps95} | {rate:,.0f} | {runs_ratio_cell(runs, 'rate')}, "
            f"{f'{rate / expert:.0%}' if expert else '-'} | {floor} |"
        )


def run_ratio(run: dict, key: str) -> float | None:
    """A run's ``key`` rate ("rate": the whole loop, "floor") against the mean of the raw rates measured just
    before and just after it (the host's speed drifts over minutes here: a run is compared with its own minutes)."""
    if key not in run or "raw" not in run:
        return None
    mean, _ = raw_interval(*run["raw"])
    return run[key] / mean


def runs_ratio_cell(runs: list[dict], key: str) -> str:
    """The median run's ratio to its raw rate, with the runs' range: "40% (38%-42%)"; "-" if any run lacks it."""
    ratios = [run_ratio(r, key) for r in runs]
    if not ratios or any(x is None for x in ratios):
        return "-"
    return f"{statistics.median(ratios):.0%} ({min(ratios):.0%}-{max(ratios):.0%})"


def floor_cell(runs: list[dict]) -> str:
    """The median run's floor (floor_seconds: its stepping, acting and update alone) and its ratio to the raw rate."""
    floors = [r["floor"] for r in runs if "floor" in r]
    if len(floors) < len(runs):
        return "-"
    return f"{statistics.median(floors):,.0f}, {runs_ratio_cell(runs, 'floor')}"


if __name__ == "__main__":
    main()

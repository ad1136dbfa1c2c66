"""Where the cores go: CPU time of each service of a training run per 1,024 env steps, against the raw simulator.

    python benchmarks/cpu_accounting.py [--warmup 20] [--window 20] [key=value ...]

Starts `coordinatorctl start` (the default run plus the overrides, evaluations off), lets it warm up, then reads
each process's CPU time (user + system, all threads, from /proc) at the start and the end of a window, and the
training env steps the run logged in between. The last lines put the total next to the budget that a whole-loop
rate of 60% of the raw simulator (random actions, one stepping process per core; benchmarks/time_to_success.py)
leaves: at rate r on c cores the run may spend c / r core-seconds per env step, of which the simulation itself
takes c / raw. Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from time_to_success import raw_all_cores  # noqa: E402

from rlfleet.data.metrics import read_metrics  # noqa: E402

STEPS = 1024  # the report's unit: core-ms per this many env steps (one epoch of the default run)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def services_of(pid: int) -> dict[int, str]:
    """The coordinator and every process it started, by role (`env[0]`, `inference[0]`, ...)."""
    out = {pid: "coordinator"}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in pathlib.Path(f"/proc/{parent}/task").iterdir():
            for child in (task / "children").read_text().split():
                argv = pathlib.Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
                args = [a.decode(errors="replace") for a in argv]
                module = next((a for a in args if a.startswith("services.")), None)
                index = args[args.index("--index") + 1] if "--index" in args else "0"
                out[int(child)] = f"{module.split('.')[1]}[{index}]" if module else " ".join(args[:2])
                todo.append(int(child))
    return out


def env_steps(log_path: pathlib.Path) -> tuple[float, int]:
    runs = sorted(log_path.glob("*/metrics.jsonl"))
    rows = [r for r in read_metrics(runs[-1]) if "env/env_steps" in r] if runs else []
    return (rows[-1]["env/env_steps"], len(rows)) if rows else (0.0, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds after the start before the window opens")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured")
    ap.add_argument(
        "--raw",
        type=float,
        default=None,
        help="the raw simulator's env steps/s on all cores (default: measured after the run)",
    )
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for coordinatorctl start")
    args = ap.parse_args()
    log_path = pathlib.Path(tempfile.mkdtemp(prefix="rlfleet-cpu-"))
    cmd = [
        sys.executable,
        "-m",
        "services.coordinator.cli",
        "start",
        "--quiet",
        "runner.val_check_interval=0",
        "runner.max_env_steps=10000000",
        f"runner.logger.log_path={log_path}",
        *args.overrides,
    ]
    print("$ coordinatorctl start " + " ".join(cmd[5:]), flush=True)
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, "MUJOCO_GL": "egl"})
    try:
        time.sleep(args.warmup)
        if run.poll() is not None:
            raise SystemExit(f"the run ended (exit {run.returncode}) before the window opened")
        procs = services_of(run.pid)
        start = {pid: cpu_seconds(pid) for pid in procs}
        steps0, epochs0 = env_steps(log_path)
        t0 = time.monotonic()
        time.sleep(args.window)
        end = {pid: cpu_seconds(pid) for pid in procs}
        steps1, epochs1 = env_steps(log_path)
        wall = time.monotonic() - t0
    finally:
        run.terminate()
        run.wait(60)
    steps = steps1 - steps0
    if steps <= 0:
        raise SystemExit("no training epoch finished inside the window: lengthen --window")
    cores = os.cpu_count() or 1
    per = lambda seconds: seconds / steps * STEPS * 1000  # noqa: E731 - core-ms per STEPS env steps
    print(
        f"\n{epochs1 - epochs0} epochs, {steps:,.0f} env steps in {wall:.1f} s: {steps / wall:,.0f} env steps/s "
        f"(the window's rate; epochs finishing at its edges make it +-1 epoch)"
    )
    print(f"\n| process | core-ms per {STEPS:,} env steps | share |")
    print("|---|---|---|")
    total = sum(end[p] - start[p] for p in procs)
    for pid, role in sorted(procs.items(), key=lambda kv: kv[1]):
        print(f"| {role} | {per(end[pid] - start[pid]):,.0f} | {(end[pid] - start[pid]) / total:.0%} |")
    print(f"| **all** | **{per(total):,.0f}** | on {cores} cores: {per(cores * wall):,.0f} available |")
    if args.raw is None:
        args.raw = raw_all_cores(cores, args.overrides)
    expert = raw_all_cores(cores, args.overrides, "expert")
    sim = cores / args.raw * STEPS * 1000
    budget = sim / 0.6
    print(
        f"\nraw simulator on {cores} cores: {args.raw:,.0f} env steps/s, i.e. {sim:,.0f} core-ms per {STEPS:,} "
        f"steps; a whole loop at 60% of it may spend {budget:,.0f} core-ms per {STEPS:,} steps in all, "
        f"{budget - sim:,.0f} of them outside the simulator; this run spent {per(total):,.0f}."
    )
    if expert:
        print(
            f"the same steps with the scripted expert's actions (grasping and lifting, as a solved task does): "
            f"{expert:,.0f} env steps/s, {cores / expert * STEPS * 1000:,.0f} core-ms per {STEPS:,} steps."
        )


if __name__ == "__main__":
    main()

"""The README's results table: a supervised (SFT) base policy, then RL from it, per (simulator, model, algorithm).

For each row: scripted-expert demonstrations (`coordinatorctl collect-demos`), behaviour cloning
(`coordinatorctl sft`), then the RL run (`coordinatorctl start`) that evaluates the base on the same seeded episodes
before its first epoch and again every `runner.val_check_interval` epochs. Steps whose output already exists are
reused (the dataset, the SFT model); `--fresh` redoes them. The table is printed from the runs' summary.json files,
and `--publish` copies each row's learning curve and a few final-evaluation videos into docs/images/results/.

    python benchmarks/results_table.py                       # every row (about an hour each on 2 cores)
    python benchmarks/results_table.py --rows panda_oft_ppo  # one row
    python benchmarks/results_table.py --table-only          # print the table of runs already done
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
CTL = [sys.executable, "-m", "services.coordinator.cli"]


@dataclass(frozen=True)
class Row:
    simulator: str
    model: str
    algorithm: str
    sft_config: str
    rl_config: str


ROWS = {
    "panda_oft_ppo": Row(
        "PandaPickCubeVision-v0",
        "OpenVLA-OFT tiny",
        "PPO",
        "pandapickcube_vision_sft_openvla_oft_tiny",
        "pandapickcube_vision_ppo_openvla_oft_sft",
    ),
    "panda_oft_grpo": Row(
        "PandaPickCubeVision-v0",
        "OpenVLA-OFT tiny",
        "GRPO",
        "pandapickcube_vision_sft_openvla_oft_tiny",
        "pandapickcube_vision_grpo_openvla_oft_sft",
    ),
    "metaworld_pi0_ppo": Row(
        "Meta-World MT1 reach-v3",
        "π0 tiny",
        "PPO (Flow-SDE)",
        "metaworld_mt1_sft_pi0_tiny",
        "metaworld_mt1_ppo_pi0_sft",
    ),
}


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd[2:] if cmd[:2] == CTL[:2] else cmd), flush=True)
    code = subprocess.call(cmd, cwd=ROOT)
    if code:
        raise SystemExit(f"results_table: `{' '.join(cmd)}` failed with exit code {code}")


def produce(row: Row, log_path: str, fresh: bool) -> None:
    sft_dir = pathlib.Path(log_path) / row.sft_config
    paths = [f"runner.logger.log_path={log_path}"]
    if fresh or not (sft_dir / "demos" / "meta" / "info.json").is_file():
        run([*CTL, "collect-demos", row.sft_config, *paths])
    if fresh or not (sft_dir / "sft_model" / "model.safetensors").is_file():
        run([*CTL, "sft", row.sft_config, *paths])
    # the table's runs train their whole budget (no early stop: runner.early_stop_success_rate)
    rl = [*paths, "runner.early_stop_success_rate=null", f"actor.model.model_path={sft_dir / 'sft_model'}"]
    run([*CTL, "start", row.rl_config, *rl])


def table(rows: dict[str, Row], log_path: str) -> list[dict]:
    out = []
    for key, row in rows.items():
        summary_path = ROOT / log_path / row.rl_config / "summary.json"
        if not summary_path.is_file():
            print(f"  ({key}: no run yet at {summary_path.parent})")
            continue
        s = json.loads(summary_path.read_text())
        base = (s.get("initial_eval") or {}).get("eval/success_once")
        last = s["final_eval"] or (s["eval_history"][-1] if s["eval_history"] else {})  # a stopped run: its last eval
        final = last.get("eval/success_once")
        after = [e["eval/success_once"] for e in s["eval_history"] if e["step"] > 0]
        best = max(after, default=None)
        recent = sum(after[-5:]) / len(after[-5:]) if after else None  # one 100-episode eval is +-5 pts noisy
        sft = (
            json.loads((ROOT / log_path / row.sft_config / "sft_model" / "sft_summary.json").read_text())
            if (ROOT / log_path / row.sft_config / "sft_model" / "sft_summary.json").is_file()
            else {}
        )
        out.append(
            {
                "row": key,
                **row.__dict__,
                "base": base,
                "final": final,
                "best": best,
                "last5_mean": recent,
                "episodes": int(last.get("eval/num_episodes", 0)),
                "last_eval_epoch": last.get("step"),
                "stop_reason": s["stop_reason"],
                "env_steps": s["env_steps"],
                "train_wall_time_s": s["train_wall_time_s"],
                "sft_episodes": sft.get("episodes"),
                "sft_steps": sft.get("steps"),
                "sft_wall_time_s": sft.get("wall_time_s"),
                "run_dir": s["run_dir"],
                "curve": s.get("learning_curve"),
            }
        )
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    print(
        "\n| simulator | model | algorithm | SFT base | after RL (last / best / mean of last 5 evals) | gain (last) "
        "| env steps | RL training time | SFT data, steps | stopped by |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in out:
        gain = "-" if r["base"] is None or r["final"] is None else f"{100 * (r['final'] - r['base']):+.0f} pts"
        print(
            f"| {r['simulator']} | {r['model']} | {r['algorithm']} | {pct(r['base'])} | {pct(r['final'])} / "
            f"{pct(r['best'])} / {pct(r['last5_mean'])} | {gain} | {r['env_steps'] / 1000:.0f}k | {r['train_wall_time_s'] / 60:.1f} min | "
            f"{r['sft_episodes']} demos, {r['sft_steps']} steps | {r['stop_reason']} |"
        )
    print(
        f"\n(success_once on {out[0]['episodes'] if out else 100} seeded evaluation episodes; base = the SFT model "
        f"evaluated before the first RL epoch)"
    )
    return out


def publish(results: list[dict], videos_per_row: int = 2) -> None:
    dest = ROOT / "docs" / "images" / "results"
    dest.mkdir(parents=True, exist_ok=True)
    for r in results:
        if r["curve"] and pathlib.Path(r["curve"]).is_file():
            shutil.copy(r["curve"], dest / f"{r['row']}_curve.png")
        evals = sorted((pathlib.Path(r["run_dir"]) / "videos").glob("eval_epoch*"))
        if evals:
            for old in dest.glob(f"{r['row']}_*.gif"):
                old.unlink()
            gifs = sorted(evals[-1].glob("*.gif"), key=lambda p: ("success" not in p.name, p.name))
            for g in gifs[:videos_per_row]:
                shutil.copy(g, dest / f"{r['row']}_final_{g.name}")
            if evals[0].name == "eval_epoch0000":
                for g in sorted(evals[0].glob("*.gif"))[:1]:
                    shutil.copy(g, dest / f"{r['row']}_base_{g.name}")
    (dest / "results.json").write_text(json.dumps(results, indent=1))
    print(f"published curves and videos to {dest}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows ({', '.join(ROWS)})")
    p.add_argument("--log-path", default="runs", help="runner.logger.log_path of every step")
    p.add_argument("--table-only", action="store_true", help="only print the table of existing runs")
    p.add_argument("--fresh", action="store_true", help="collect demonstrations and fine-tune again")
    p.add_argument("--publish", action="store_true", help="copy curves and videos into docs/images/results")
    args = p.parse_args()
    unknown = [k for k in args.rows.split(",") if k not in ROWS]
    if unknown:
        print(f"results_table: unknown row(s) {unknown} (known: {', '.join(ROWS)})", file=sys.stderr)
        return 2
    rows = {k: ROWS[k] for k in args.rows.split(",")}
    if not args.table_only:
        for row in rows.values():
            produce(row, args.log_path, args.fresh)
    results = table(rows, args.log_path)
    if args.publish:
        publish(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

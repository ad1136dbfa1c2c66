"""`coordinatorctl eval` end to end: a short real run (real processes, gRPC, MuJoCo, PPO), then its run folder, a
checkpoint, the checkpoint compared with itself, an exported VLA model folder against its checkpoint, and bad
inputs (one line, exit code 2). The report helpers' arithmetic is checked without services at the end."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from rlfleet.data.intervals import wilson
from tests.services.coordinator.tiny_run import CTL
from tests.services.coordinator.tiny_run import TINY as TINY_RUN

TINY = [
    *TINY_RUN,
    "runner.max_epochs=2",
    "runner.val_check_interval=0",
]


def ctl(*args, timeout=300):
    return subprocess.run([*CTL, *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trained MLP run (2 epochs of the default task, shortened): its folder."""
    base = tmp_path_factory.mktemp("eval")
    proc = ctl("start", *TINY, f"runner.logger.log_path={base}", "runner.experiment_name=trained")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return base / "trained"


@pytest.mark.slow
def test_eval_of_a_run_folder_writes_reports_with_intervals(run, tmp_path):
    out = tmp_path / "ev"
    proc = ctl("eval", run, "env.eval.num_episodes=6", "--out", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "episodes 4/6" in proc.stdout and "episodes 6/6" in proc.stdout  # progress, one line per env batch
    report = json.loads((out / "report.json").read_text())
    assert report["evaluated"]["checkpoint"] == str(run / "checkpoints" / "global_step_2")
    assert [e["episode"] for e in report["episodes"]] == list(range(6))
    assert [e["seed"] for e in report["episodes"]] == [1_000_000 + i for i in range(6)]
    o = report["overall"]
    assert o["episodes"] == 6 and list(report["tasks"]) == ["PandaPickCube-v0"]
    for metric in ("success_once", "success_at_end"):
        k = sum(e[metric] for e in report["episodes"])
        assert o[metric]["successes"] == k and o[metric]["ci95"] == pytest.approx(list(wilson(k, 6)))
    assert o["return"]["mean"] == pytest.approx(sum(e["return"] for e in report["episodes"]) / 6)
    # the checkpoint's weights: its first 4 episodes are the run's final evaluation (same seeds, same weights)
    final = json.loads((run / "summary.json").read_text())["final_eval"]
    assert sum(e["return"] for e in report["episodes"][:4]) / 4 == pytest.approx(final["eval/return"], abs=1e-6)
    md = (out / "report.md").read_text()
    low, high = o["success_once"]["ci95"]
    assert f"[{100 * low:.1f}, {100 * high:.1f}]" in md and "| PandaPickCube-v0 | 6 |" in md
    assert "learner: resumed from" in (out / "logs" / "learner_0.log").read_text()  # loaded, never trained
    assert not any("train/loss" in line for line in (out / "metrics.jsonl").read_text().splitlines())


@pytest.mark.slow
def test_a_checkpoint_compared_with_itself_differs_by_zero(run, tmp_path):
    ckpt = run / "checkpoints" / "global_step_2"
    out = tmp_path / "cmp"
    proc = ctl("eval", "--compare", ckpt, run, "--out", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a, b = (json.loads((out / x / "report.json").read_text()) for x in "AB")
    assert a["evaluated"]["kind"] == "checkpoint" and b["evaluated"]["kind"] == "run"
    assert [(e["seed"], e["return"], e["success_once"]) for e in a["episodes"]] == [
        (e["seed"], e["return"], e["success_once"]) for e in b["episodes"]
    ]  # the same episodes, the same policy
    c = json.loads((out / "compare.json").read_text())
    for metric in ("success_once", "success_at_end"):
        d = c["overall"][metric]
        assert d["difference"] == 0 and d["ci95"][0] <= 0 <= d["ci95"][1] and d["ci95"][0] < d["ci95"][1]
    assert c["overall"]["return"]["difference"] == 0
    assert "A - B over the same 4 episodes: success_once +0.0 points [" in proc.stdout
    assert "+0.0 points" in (out / "compare.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}/no-such-run"], "no-such-run: no such folder"),
        (["{tmp}"], "neither a run folder"),
        (
            ["{run}", "actor.model.hidden_dims=[64,64]"],
            "not a checkpoint of the config's actor.model (mlp): actor_mean.0.bias [32] in the checkpoint, [64] in the "
            "config's model",
        ),
        (["{run}", "env.eval.env_id=NoSuchTask-v9"], "'env.eval.env_id': unknown env id 'NoSuchTask-v9'"),
        (
            ["{run}", "--config", "pandapickcube_vision_ppo_openvla_tiny"],
            "a checkpoint of a mlp policy (its run's config.yaml), and the config's actor.model.model_type is openvla",
        ),
        (["{run}", "no.such_key=1"], "config error"),
    ],
    ids=["missing", "not-a-run", "other-shape", "unknown-task", "other-model-type", "bad-key"],
)
def test_bad_inputs_give_one_line_and_exit_code_2(run, tmp_path, args, message):
    proc = ctl("eval", *[a.format(run=run, tmp=tmp_path) for a in args])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("coordinatorctl eval: ") and message in lines[0], proc.stderr
    assert not (run / "eval").exists() or not any((run / "eval").iterdir())  # nothing started, nothing written


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}/no-such-run", "{tmp}/out"], "no-such-run: no such folder"),
        (["{run}", "--step", "7", "{tmp}/out"], "--step 7: no complete checkpoint global_step_7 in"),
        (["{run}", "{full}"], "full: exists and is not empty"),
        (["{run}", "{tmp}/out"], "mlp policies have no released layout to export"),
        (["{run}/checkpoints/global_step_2", "--lora", "adapter", "{tmp}/out"], "mlp policies have no released layout"),
        (["{run}", "--layout", "hub", "{tmp}/out"], "--layout: 'hub' is not one of upstream, rlfleet"),
        (["{run}", "--layout", "rlfleet", "{tmp}/out"], "mlp policies have no released layout"),
    ],
    ids=["missing", "no-such-step", "out-not-empty", "mlp", "mlp-checkpoint", "unknown-layout", "mlp-rlfleet-layout"],
)
def test_export_bad_inputs_give_one_line_and_exit_code_2(run, tmp_path, args, message):
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    proc = ctl("export", *[a.format(run=run, tmp=tmp_path, full=full) for a in args])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("coordinatorctl export: ") and message in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_exported_vla_model_folder_evaluates_like_its_checkpoint(tmp_path):
    """The released layouts (`coordinatorctl export`) of a briefly trained tiny VLA: the checkpoint's weights (the
    upstream layout, OpenVLA's, sharded, without the value head; rlfleet's with it), and the upstream export compared
    with its checkpoint on the same episodes: the same outcome, episode by episode."""
    name = "pandapickcube_vision_ppo_openvla_tiny"
    short = [
        "runner.max_epochs=1",
        "runner.val_check_interval=0",
        "env.eval.num_episodes=4",
        "env.eval.total_num_envs=4",
    ]
    proc = ctl("start", name, f"runner.logger.log_path={tmp_path}", *short, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = tmp_path / name / "checkpoints" / "global_step_1"
    export, ours = tmp_path / "export", tmp_path / "export-rlfleet"
    proc = ctl("export", tmp_path / name, "--step", 1, export, "--max-shard-size", "2MB", timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"exported {ckpt} (openvla, upstream layout" in proc.stdout
    assert (export / "config.json").is_file() and (export / "model.safetensors.index.json").is_file()
    assert "vision_backbone_id" in json.loads((export / "config.json").read_text())
    proc = ctl("export", ckpt, ours, "--layout", "rlfleet", timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (ours / "model.safetensors").is_file() and (ours / "config.json").is_file()
    # the exported weights are the checkpoint's: the same policy built from each, tensor by tensor (the upstream
    # layout has no value head: it starts fresh)
    code = (
        "import sys, json, pathlib, torch; from rlfleet.config import load_config; "
        "from rlfleet.policies import build_policy; from services.learner.checkpoint import load_policy_state; "
        "from rlfleet.data.checkpoint_files import specs_from_json; c = pathlib.Path(sys.argv[1]); "
        "st = json.loads((c / 'learner_state.json').read_text()); "
        "obs, adim = specs_from_json(st['obs_specs']), st['action_dim']; "
        "cfg = load_config(c.parent.parent / 'config.yaml'); m = cfg.actor.model; "
        "a = build_policy(m, obs, adim, True, cfg.algorithm.logprob_type); load_policy_state(c, a); sa = a.state_dict()\n"
        "for e, but in zip(sys.argv[2::2], sys.argv[3::2]):\n"
        " b = build_policy(load_config(c.parent.parent / 'config.yaml', [f'actor.model.model_path={e}']).actor.model,"
        " obs, adim, True, cfg.algorithm.logprob_type); sb = b.state_dict()\n"
        " assert set(sa) == set(sb), set(sa) ^ set(sb)\n"
        " bad = [k for k in sa if not k.startswith(but) and not torch.equal(sa[k], sb[k])]; assert not bad, bad[:3]\n"
        "print('equal', len(sa))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ckpt), str(export), "value_head.", str(ours), "-"],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("equal"), proc.stderr[-3000:]
    out = tmp_path / "cmp"
    proc = ctl(
        "eval",
        "--compare",
        ckpt,
        export,
        "--config",
        tmp_path / name / "config.yaml",
        "--out",
        out,
        "env.eval.video_episodes=1",
        timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a, b = (json.loads((out / x / "report.json").read_text()) for x in "AB")
    assert b["evaluated"]["kind"] == "model" and a["evaluated"]["kind"] == "checkpoint"
    assert [(e["success_once"], e["length"]) for e in a["episodes"]] == [
        (e["success_once"], e["length"]) for e in b["episodes"]
    ]
    assert [e["return"] for e in a["episodes"]] == pytest.approx([e["return"] for e in b["episodes"]], abs=1e-4)
    assert json.loads((out / "compare.json").read_text())["overall"]["success_once"]["difference"] == 0
    for r, x in ((a, "A"), (b, "B")):  # videos as in training: the first N episodes, seed and outcome in the name
        assert [pathlib.Path(v).name for v in r["videos"]] == [p.name for p in (out / x / "videos").iterdir()]
        assert len(r["videos"]) == 1 and "seed1000000" in r["videos"][0]


@pytest.mark.slow
@pytest.mark.sim
def test_metaworld_mt10_is_evaluated_on_its_fixed_initial_states_per_task(tmp_path):
    """A benchmark with fixed initial states (env.eval.use_fixed_reset_state_ids in the MT10 config): episode i
    starts from state i, the report is broken down per task, and the run's final evaluation is reproduced."""
    proc = ctl(
        "start",
        "metaworld_mt10_ppo_mlp",
        f"runner.logger.log_path={tmp_path}",
        "runner.experiment_name=mt10",
        "runner.max_epochs=1",
        "runner.val_check_interval=0",
        "env.train.total_num_envs=10",
        "env.train.max_steps_per_rollout_epoch=16",
        "env.eval.total_num_envs=5",
        "env.eval.num_episodes=10",
        "env.eval.max_episode_steps=20",
        "actor.micro_batch_size=80",
        "actor.global_batch_size=160",
        "actor.model.hidden_dims=[32,32]",
        "runner.max_wall_time_s=null",
        "runner.max_env_steps=null",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "mt10"
    proc = ctl("eval", run, "env.eval.num_episodes=12", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((run / "eval" / "global_step_1" / "report.json").read_text())
    assert report["env"]["fixed_initial_states"] and report["env"]["env_id"] == "MT10"
    assert [e["reset_state_id"] for e in report["episodes"]] == list(range(12))
    assert len(report["tasks"]) == 10 and sum(t["episodes"] for t in report["tasks"].values()) == 12
    assert report["tasks"]["reach the goal position"]["episodes"] == 2  # states 0 and 10: the same task class
    final = json.loads((run / "summary.json").read_text())["final_eval"]
    assert sum(e["return"] for e in report["episodes"][:10]) / 10 == pytest.approx(final["eval/return"], abs=1e-4)
    assert "| **all** | 12 |" in (run / "eval" / "global_step_1" / "report.md").read_text()


# --- without services ----------------------------------------------------------------------------------------------
def _report(outcomes, returns=None):
    rows = [
        {
            "episode": i,
            "seed": 10 + i,
            "reset_state_id": -1,
            "task": "T" if i % 2 else "U",
            "instruction": "",
            "success_once": s,
            "success_at_end": s,
            "return": (returns or [float(s)] * len(outcomes))[i],
            "length": 5,
        }
        for i, s in enumerate(outcomes)
    ]
    from services.coordinator.offline_eval import group_stats

    tasks = {}
    for r in rows:
        tasks.setdefault(r["task"], []).append(r)
    return {
        "evaluated": {"path": "x", "kind": "checkpoint", "checkpoint": "x", "model_type": "mlp"},
        "env": {
            "simulator": "gym",
            "env_id": "E",
            "num_episodes": len(rows),
            "seed": 10,
            "fixed_initial_states": False,
            "deterministic": True,
            "max_episode_steps": 5,
        },
        "overall": group_stats(rows),
        "tasks": {k: group_stats(v) for k, v in tasks.items()},
        "lost_episodes": 0,
        "eval_time_s": 0.0,
        "videos": [],
        "episodes": rows,
    }


def test_report_and_comparison_arithmetic():
    from rlfleet.data.intervals import paired_difference
    from services.coordinator.offline_eval import compare_markdown, compare_reports, report_markdown

    a = _report([True] * 8 + [False] * 2)
    b = _report([True] * 5 + [False] * 5)
    assert a["overall"]["success_once"]["successes"] == 8
    assert a["overall"]["success_once"]["ci95"] == list(wilson(8, 10))
    md = report_markdown(a)
    assert "| **all** | 10 | 80.0% [49.0, 94.3] |" in md and "| U | 5 |" in md
    c = compare_reports(a, b)
    d, low, high = paired_difference([True] * 8 + [False] * 2, [True] * 5 + [False] * 5)
    assert c["overall"]["success_once"]["difference"] == pytest.approx(0.3) == pytest.approx(d)
    assert c["overall"]["success_once"]["ci95"] == [low, high] and low < 0.3 < high
    assert set(c["tasks"]) == {"T", "U"} and c["tasks"]["T"]["episodes"] == 5
    assert "+30.0 points [" in compare_markdown(c)
    from services.coordinator.offline_eval import EvalError

    with pytest.raises(EvalError, match="different episodes"):
        compare_reports(a, _report([True] * 4))


def test_training_eval_lines_carry_the_interval():
    from services.coordinator.report import eval_line

    line = eval_line(
        {
            "eval/success_once": 0.8,
            "eval/return": 1.5,
            "eval/num_episodes": 100.0,
            "eval/libero/success_once": 0.5,
            "eval/libero/num_episodes": 50.0,
        }
    )
    assert line.startswith("success_once 80.0% [71.1, 86.7] return 1.50 over 100 episodes")
    assert "(libero 50.0% [36.6, 63.4])" in line

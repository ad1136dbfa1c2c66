"""`coordinatorctl eval`: a trained policy evaluated on seeded episodes by the same services a run uses.

    coordinatorctl eval RUN_DIR | RUN_DIR/checkpoints/global_step_N | MODEL_DIR [--config CFG] [key=value ...]
    coordinatorctl eval --compare A B [--config CFG] [key=value ...]

What is evaluated: a run folder (its newest complete checkpoint), one checkpoint, or a model folder in its family's
released layout (what ``coordinatorctl export`` writes: the family's upstream layout, e.g. openvla-7b's, or rlfleet's
config.json + model.safetensors; VLA policies). The config is the
run's config.yaml (a checkpoint's run is two folders up) unless ``--config`` names one; overrides apply on top
(e.g. ``env.eval.num_episodes=200``, ``env.eval.use_fixed_reset_state_ids=true``, ``env.eval.video_episodes=4``).

How the weights reach the inference servers: the local launcher starts the env servers, inference servers and one
learner as ``coordinatorctl start`` does, with ``runner.only_eval`` set: the learner never trains, builds no
optimizer and loads no optimizer state (the memory check counts weights only). For a checkpoint it starts with
``runner.resume_dir`` set to the checkpoint folder (its set-up restores the policy as a resumed run does), for a
model folder with ``actor.model.model_path`` set to it (the policy is built from it, as an SFT base is); its first
PublishWeights sends the full set to every inference server, as at the start of a run. Then the coordinator's own
evaluator (services/coordinator/evaluation.py) runs env.eval's episodes: episode i is reset with seed + i and, with
env.eval.use_fixed_reset_state_ids on a benchmark with fixed initial states (LIBERO, Meta-World), from state
i % num_reset_states; videos as in training (env.eval.video_episodes, into OUT/videos).

Written to the output folder: report.json (overall and per task: success_once, success_at_end with their 95%
Wilson intervals, return, episode length; every episode's outcome) and report.md; with ``--compare``, A/ and B/
(each a full report, the same episodes) and compare.json / compare.md: the difference A - B with its paired 95%
interval (rlfleet.data.intervals.paired_difference).
"""

from __future__ import annotations

import json
import pathlib
import time
from dataclasses import dataclass

import numpy as np

from rlfleet.config import ConfigError, load_config
from rlfleet.data.intervals import format_difference, format_rate, paired_difference, wilson


class EvalError(Exception):
    """Bad input to `coordinatorctl eval` (exit code 2): one line naming what is wrong."""


@dataclass
class Target:
    path: pathlib.Path
    kind: str  # "run" | "checkpoint" | "model"
    checkpoint: pathlib.Path | None = None
    run_dir: pathlib.Path | None = None  # whose config.yaml is the default config

    @property
    def name(self) -> str:
        if self.kind == "model":
            return self.path.name
        run = self.run_dir.name if self.run_dir else "run"
        return f"{run}-{self.checkpoint.name}"


def verify(target: Target):
    """A checkpoint target's files checked whole before anything reads them (rlfleet.data.checkpoint_files: DCP
    metadata through a restricted unpickler, shards long enough, learner_state.json and the reward normaliser's
    header); -> what was read (None for a model folder), or EvalError in one line naming the bad file."""
    if target.checkpoint is None:
        return None
    from rlfleet.data.checkpoint_files import verify_checkpoint
    from rlfleet.untrusted import BadFile

    try:
        return verify_checkpoint(target.checkpoint)
    except (BadFile, OSError) as exc:
        raise EvalError(str(exc)) from None


def resolve(path: str) -> Target:
    """What ``path`` names, or EvalError saying why it names nothing evaluable."""
    p = pathlib.Path(path)
    from rlfleet.policies.hub import parse_hub_id, resolve_model_path

    if not p.exists() and parse_hub_id(path) is not None:  # a model id on the hub: its snapshot in the hub cache
        try:
            p = pathlib.Path(resolve_model_path(path))
        except (FileNotFoundError, ValueError) as exc:
            raise EvalError(str(exc).removeprefix("actor.model.model_path: ")) from None
    if not p.exists():
        raise EvalError(f"{p}: no such folder")
    if not p.is_dir():
        raise EvalError(f"{p}: not a folder (give a run folder, RUN/checkpoints/global_step_N or a model folder)")
    from rlfleet.data.checkpoint_files import is_checkpoint, latest_checkpoint  # the learner's own finding

    if is_checkpoint(p):
        run = p.parent.parent
        return Target(p, "checkpoint", p, run if (run / "config.yaml").is_file() else None)
    if (p / "config.yaml").is_file() or (p / "checkpoints").is_dir():
        ckpt = latest_checkpoint(p)
        if ckpt is None:
            raise EvalError(
                f"{p}: no complete checkpoint in {p / 'checkpoints'} (a run saves one every "
                f"runner.save_interval epochs and at its end)"
            )
        return Target(p, "run", ckpt, p)
    if (p / "config.json").is_file():
        return Target(p, "model")
    if p.name.startswith("global_step_"):
        raise EvalError(f"{p}: an incomplete checkpoint (no learner_state.json: its run stopped while saving it)")
    raise EvalError(
        f"{p}: neither a run folder (config.yaml, checkpoints/), a checkpoint (learner_state.json) nor "
        f"a model folder (config.json, as coordinatorctl export writes)"
    )


def eval_config(target: Target, config: str | None, overrides: list[str]):
    """The config the target is evaluated with: --config, else its run's config.yaml; + overrides; + where the
    weights come from."""
    base = config
    if base is None:
        if target.run_dir is None:
            raise EvalError(
                f"{target.path}: give --config CONFIG (the config to evaluate it with: its env.eval and "
                f"actor.model); "
                + ("a model folder has no run config" if target.kind == "model" else "no config.yaml two folders up")
            )
        base = str(target.run_dir / "config.yaml")
    where = (
        [f"runner.resume_dir={target.checkpoint.resolve()}"]
        if target.checkpoint is not None
        else [f"actor.model.model_path={target.path.resolve()}", "runner.resume_dir=null"]
    )
    where.append("runner.only_eval=true")  # the learner loads the weights only: no optimizer, no Adam state
    try:
        cfg = load_config(base, [*overrides, *where])
    except ConfigError as exc:
        raise EvalError(f"config error: {exc}") from None
    if cfg.cluster.launcher != "local":
        raise EvalError(
            f"'cluster.launcher': eval starts its services on this machine: cluster.launcher=local "
            f"(the config says {cfg.cluster.launcher})"
        )
    return cfg


def _flat_model(cfg) -> dict:
    from omegaconf import OmegaConf

    from rlfleet.config import _flatten

    flat = {}
    for k, v in _flatten(cfg).items():
        if k.startswith("actor.model.") and k != "actor.model.model_path":
            flat[k] = OmegaConf.to_container(v) if OmegaConf.is_config(v) else v
    return flat


def checkpoint_spaces(ckpt: pathlib.Path) -> tuple[dict, int]:
    from rlfleet.data.checkpoint_files import read_learner_state, specs_from_json

    state = read_learner_state(ckpt)  # checked: its fields' types and ranges
    return specs_from_json(state["obs_specs"]), int(state["action_dim"])


def check_weights(cfg, target: Target, info=None) -> None:
    """Refuse weights of another model type or shape than the config's actor.model, naming what differs (``info``:
    :func:`verify`'s reading of a checkpoint target, its tensors as its metadata declares them)."""
    if target.kind == "model":
        from rlfleet.untrusted import BadFile, read_json

        try:
            saved = read_json(target.path / "config.json", what="model config")  # (a hub snapshot links to blobs/)
        except (BadFile, OSError) as exc:
            raise EvalError(str(exc)) from None
        if "vision_backbone_id" in saved:  # OpenVLA's own hub layout
            saved_type = "openvla"
        else:
            saved_type = saved.get("model_type")
        want = cfg.actor.model.model_type
        from rlfleet.policies.families import FAMILIES

        family = FAMILIES.get(want)  # the layouts its loader takes (its entry's ``loads``; it checks the rest)
        ok = set(family.loads) if family is not None and family.loads else {want}
        if saved_type not in ok:
            raise EvalError(
                f"{target.path}: holds a model of type {saved_type} (its config.json), the config's "
                f"actor.model.model_type is {want} (give the config it was trained with: --config)"
            )
        return
    from rlfleet.errors import InvalidRequest
    from rlfleet.policies import footprint

    obs, action_dim = checkpoint_spaces(target.checkpoint)
    why_differ = ""
    run_cfg = target.run_dir / "config.yaml" if target.run_dir else None
    if run_cfg is not None and run_cfg.is_file():
        try:
            theirs, mine = _flat_model(load_config(run_cfg)), _flat_model(cfg)
            keys = sorted(set(theirs) | set(mine), key=lambda k: (k != "actor.model.model_type", k))
            diff = [
                f"{k} {theirs.get(k, '<missing>')!r} there, {mine.get(k, '<missing>')!r} here"
                for k in keys
                if theirs.get(k) != mine.get(k)
            ]
            was, now = theirs.get("actor.model.model_type"), mine.get("actor.model.model_type")
            if was != now:
                raise EvalError(
                    f"{target.checkpoint}: a checkpoint of a {was} policy (its run's config.yaml), and "
                    f"the config's actor.model.model_type is {now} (evaluate it with its run's config, "
                    f"or one with the same actor.model)"
                )
            if diff:
                why_differ = f" (the config differs from the run's {run_cfg}: {'; '.join(diff[:4])})"
        except ConfigError:
            pass
    try:
        planned = footprint.planned_state(
            cfg.actor.model,
            obs,
            action_dim,
            cfg.algorithm.normalize_obs,
            cfg.algorithm.logprob_type,
            "the checkpoint's observation space",
        )
    except InvalidRequest as exc:
        raise EvalError(
            f"{target.checkpoint}: the config's actor.model ({cfg.actor.model.model_type}) cannot take "
            f"the checkpoint's spaces: {exc}{why_differ}"
        ) from None
    if planned is None:  # built from model_path, or not plannable: the learner's load is the check
        return
    info = info if info is not None else verify(target)
    saved = {k: shape for k, (shape, _dtype) in info.tensors.items()}
    mine = {k: tuple(shape) for k, (shape, _dtype, _p) in planned.items()}
    problems = []
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing:
        problems.append(
            f"the config's model has tensors the checkpoint lacks ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''})"
        )
    if extra:
        problems.append(
            f"the checkpoint has tensors the config's model lacks ({', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''})"
        )
    shapes = [
        f"{k} {list(saved[k])} in the checkpoint, {list(mine[k])} in the config's model"
        for k in sorted(set(mine) & set(saved))
        if mine[k] != saved[k]
    ]
    problems += shapes[:3]
    if problems:
        raise EvalError(
            f"{target.checkpoint}: not a checkpoint of the config's actor.model "
            f"({cfg.actor.model.model_type}): {'; '.join(problems)}{why_differ}"
        )


def output_dir(target: Target, cfg, out: str | None, compare: Target | None = None) -> pathlib.Path:
    if out:
        return pathlib.Path(out)
    if compare is not None:
        base = pathlib.Path(cfg.runner.logger.log_path) / f"compare-{target.name}-vs-{compare.name}"
    elif target.kind == "model":
        base = pathlib.Path(cfg.runner.logger.log_path) / f"eval-{target.name}"
    else:
        base = (
            target.run_dir / "eval" / target.checkpoint.name
            if target.run_dir
            else pathlib.Path(cfg.runner.logger.log_path) / f"eval-{target.name}"
        )
    path, n = base, 1
    while path.exists() and any(path.iterdir()):
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


# --- one evaluation session ----------------------------------------------------------------------------------------
def run_session(cfg, target: Target, out: pathlib.Path, token: str, quiet: bool = False) -> dict:
    """Start the services, load the target's weights into the inference servers (through the learner), evaluate
    env.eval's episodes, write report.json / report.md into ``out``; -> the report."""
    from rlfleet.v1 import env_pb2, learner_pb2
    from rlfleet.wire import auth, tls
    from services.coordinator.coordinator import Coordinator, RunFailed, joint_env_spec
    from services.coordinator.server import serve
    from services.coordinator.service_registry import RunStopped

    auth.set_identity("coordinator", token)
    tls.configure_tls(cfg.cluster.tls)
    coord = Coordinator(cfg, out, quiet=quiet, token=token)
    server = serve(coord, cfg.cluster.coordinator_address)
    say, reg, calls = coord.say, coord.registry, coord.calls
    ev = cfg.env.eval
    try:
        t0 = time.monotonic()
        say(
            f"  starting {reg.counts['env']} env server(s), {reg.counts['inference']} inference server(s) and a "
            f"learner to load the weights (logs in {out / 'logs'})"
        )
        try:
            coord.start_services()
        except RunStopped as exc:
            raise RunFailed(str(exc)) from None
        timeout = cfg.cluster.rpc_timeout_s
        spec, joint = joint_env_spec(
            [
                calls.rollout_stub(i)[1].Describe(env_pb2.DescribeEnvRequest(), timeout=timeout)
                for i in range(reg.counts["env"])
            ]
        )
        if joint:
            say(joint)
            calls.policy_spec = spec
        if target.checkpoint is not None:
            _check_env_spaces(spec, target)
        pub = calls.learner().PublishWeights(
            learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=reg.policy_addresses()),
            timeout=max(120.0, timeout),
        )
        calls.weights_published()
        say(
            f"  services up in {time.monotonic() - t0:.1f}s; weights version {pub.weights_version} on "
            f"{reg.counts[reg.policy_role]} {reg.policy_role} server(s); evaluating {ev.num_episodes} episodes of "
            f"{spec.env_id} (seeds {ev.seed}..{ev.seed + ev.num_episodes - 1}"
            + (", fixed initial states" if ev.use_fixed_reset_state_ids else "")
            + ")"
        )
        last = [0.0]

        def progress(done, total):
            now = time.monotonic()
            if done == total or now - last[0] >= 1.0:
                last[0] = now
                say(f"  episodes {done}/{total}")

        metrics = coord.evaluator.evaluate(0, video_dir=str(out / "videos"), progress=progress)
        report = build_report(
            cfg,
            target,
            spec,
            coord.evaluator.episodes,
            coord.evaluator.episode_simulators,
            metrics,
            calls.lost_episodes,
            out,
        )
        write_report(out, report)
        return report
    finally:
        coord.shutdown()
        server.stop(grace=0.5)


def _check_env_spaces(spec, target: Target) -> None:
    from rlfleet.wire.spaces import TensorSpace, spaces_from_proto
    from services.coordinator.service_registry import RunFailed

    obs, action_dim = checkpoint_spaces(target.checkpoint)
    env_obs = spaces_from_proto(spec.observation_space)
    env_action = TensorSpace.from_proto(spec.action_space).shape[0]

    def show(o, a):
        return ", ".join(f"{k}{list(v.shape)}" for k, v in sorted(o.items())) + f"; action {a}-D"

    if {k: tuple(v.shape) for k, v in obs.items()} != {
        k: tuple(v.shape) for k, v in env_obs.items()
    } or action_dim != env_action:
        raise RunFailed(
            f"{target.checkpoint}: the policy was trained for spaces {show(obs, action_dim)}; the env "
            f"servers ({spec.simulator}:{spec.env_id}) have {show(env_obs, env_action)}"
        )


# --- reports -----------------------------------------------------------------------------------------------------
def rate(successes: int, n: int) -> dict:
    low, high = wilson(successes, n)
    return {"rate": successes / n if n else float("nan"), "successes": successes, "ci95": [low, high]}


def group_stats(eps: list[dict]) -> dict:
    n = len(eps)
    ret = np.array([e["return"] for e in eps], float)
    length = np.array([e["length"] for e in eps], float)
    return {
        "episodes": n,
        "success_once": rate(sum(e["success_once"] for e in eps), n),
        "success_at_end": rate(sum(e["success_at_end"] for e in eps), n),
        "return": {"mean": float(ret.mean()) if n else float("nan"), "std": float(ret.std()) if n else float("nan")},
        "episode_length": {
            "mean": float(length.mean()) if n else float("nan"),
            "min": int(length.min()) if n else 0,
            "max": int(length.max()) if n else 0,
        },
    }


def build_report(
    cfg, target: Target, spec, episodes, simulators: dict, metrics: dict, lost: int, out: pathlib.Path
) -> dict:
    from rlfleet.wire import codec

    ev = cfg.env.eval
    instructions = {e.instruction for e in episodes if e.instruction}

    def task(e):
        if simulators:
            return simulators.get(e.env_id, spec.simulator)
        if len(instructions) > 1:
            return e.instruction
        return spec.env_id

    rows = [
        {
            "episode": int(e.env_id),
            "seed": int(ev.seed + e.env_id),
            "reset_state_id": int(e.reset_state_id),
            "task": task(e),
            "instruction": e.instruction,
            "success_once": bool(e.success_once),
            "success_at_end": bool(e.success_at_end),
            "return": float(codec.episode_return(e)),
            "length": int(e.length),
        }
        for e in episodes
    ]
    tasks = {}
    for r in rows:
        tasks.setdefault(r["task"], []).append(r)
    videos = sorted(str(p) for p in (out / "videos").glob("*")) if (out / "videos").is_dir() else []
    return {
        "evaluated": {
            "kind": target.kind,
            "path": str(target.path),
            "checkpoint": str(target.checkpoint) if target.checkpoint else None,
            "model_type": cfg.actor.model.model_type,
        },
        "env": {
            "simulator": spec.simulator,
            "env_id": spec.env_id,
            "num_episodes": len(rows),
            "seed": int(ev.seed),
            "fixed_initial_states": bool(ev.use_fixed_reset_state_ids),
            "deterministic": bool(ev.deterministic),
            "max_episode_steps": int(ev.max_episode_steps),
        },
        "overall": group_stats(rows),
        "tasks": {k: group_stats(v) for k, v in tasks.items()},
        "lost_episodes": int(lost),
        "eval_time_s": round(float(metrics.get("time/eval", 0.0)), 2),
        "videos": videos,
        "interval": "95% Wilson score interval of each success rate",
        "episodes": rows,
    }


def _pct(stat: dict, n: int) -> str:
    return format_rate(stat["successes"], n)


def report_markdown(report: dict) -> str:
    what, env = report["evaluated"], report["env"]
    lines = [
        f"# Evaluation of {what['path']}",
        "",
        f"{what['kind']} ({what['model_type']}"
        + (f", checkpoint {what['checkpoint']}" if what["checkpoint"] and what["kind"] == "run" else "")
        + "); "
        f"{env['simulator']}:{env['env_id']}, {env['num_episodes']} episodes, seeds {env['seed']}.."
        f"{env['seed'] + env['num_episodes'] - 1}"
        + (", fixed initial states" if env["fixed_initial_states"] else "")
        + (", deterministic actions" if env["deterministic"] else ", sampled actions")
        + ".",
        "",
        "| task | episodes | success_once | success_at_end | return | episode length |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    groups = list(report["tasks"].items())
    if len(groups) > 1:
        groups.append(("**all**", report["overall"]))
    for name, g in groups:
        n = g["episodes"]
        lines.append(
            f"| {name} | {n} | {_pct(g['success_once'], n)} | {_pct(g['success_at_end'], n)} | "
            f"{g['return']['mean']:.2f} ± {g['return']['std']:.2f} | {g['episode_length']['mean']:.1f} |"
        )
    lines += [
        "",
        "Success rates with their 95% Wilson score intervals (one 100-episode evaluation moves about "
        "±5 points by chance alone).",
    ]
    if report["lost_episodes"]:
        lines.append(f"{report['lost_episodes']} episodes were lost to service restarts and run again.")
    if report["videos"]:
        lines.append(f"Videos: {len(report['videos'])} in {pathlib.Path(report['videos'][0]).parent}.")
    return "\n".join(lines) + "\n"


def write_report(out: pathlib.Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(report_markdown(report))


def compare_reports(a: dict, b: dict) -> dict:
    """A - B on the same episodes: every success rate's difference with its paired 95% interval."""
    ea = {r["episode"]: r for r in a["episodes"]}
    eb = {r["episode"]: r for r in b["episodes"]}
    if set(ea) != set(eb):
        raise EvalError(f"the two evaluations ran different episodes ({len(ea)} vs {len(eb)}): not comparable")
    keys = sorted(ea)

    def diff(eps):
        out = {"episodes": len(eps)}
        for m in ("success_once", "success_at_end"):
            xa, xb = [ea[i][m] for i in eps], [eb[i][m] for i in eps]
            d, low, high = paired_difference(xa, xb)
            out[m] = {
                "a": sum(xa) / len(eps),
                "b": sum(xb) / len(eps),
                "difference": d,
                "ci95": [low, high],
                "text": format_difference(xa, xb),
            }
        ra, rb = np.array([ea[i]["return"] for i in eps]), np.array([eb[i]["return"] for i in eps])
        out["return"] = {"a": float(ra.mean()), "b": float(rb.mean()), "difference": float((ra - rb).mean())}
        return out

    tasks = {}
    for i in keys:
        tasks.setdefault(ea[i]["task"], []).append(i)
    return {
        "a": a["evaluated"]["path"],
        "b": b["evaluated"]["path"],
        "env": a["env"],
        "overall": diff(keys),
        "tasks": {t: diff(v) for t, v in tasks.items()},
        "interval": "95% interval of the paired difference A - B (Newcombe's hybrid score interval for paired "
        "proportions): both evaluated on the same episodes",
    }


def compare_markdown(c: dict) -> str:
    lines = [
        f"# A - B: {c['a']} vs {c['b']}",
        "",
        f"Both on the same {c['overall']['episodes']} episodes of {c['env']['simulator']}:{c['env']['env_id']} "
        f"(seeds {c['env']['seed']}..{c['env']['seed'] + c['env']['num_episodes'] - 1}"
        + (", fixed initial states" if c["env"]["fixed_initial_states"] else "")
        + ").",
        "",
        "| task | episodes | success_once A | B | A - B | success_at_end A | B | A - B | return A - B |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    groups = list(c["tasks"].items())
    if len(groups) > 1:
        groups.append(("**all**", c["overall"]))
    for name, g in groups:
        so, se = g["success_once"], g["success_at_end"]
        lines.append(
            f"| {name} | {g['episodes']} | {so['a']:.1%} | {so['b']:.1%} | {so['text']} | {se['a']:.1%} | "
            f"{se['b']:.1%} | {se['text']} | {g['return']['difference']:+.2f} |"
        )
    lines += [
        "",
        "Differences in points with their paired 95% intervals: an interval that contains 0 does not tell "
        "the two apart.",
    ]
    return "\n".join(lines) + "\n"


def summary_line(report: dict) -> str:
    o = report["overall"]
    n = o["episodes"]
    return (
        f"success_once {_pct(o['success_once'], n)}, success_at_end {_pct(o['success_at_end'], n)}, return "
        f"{o['return']['mean']:.2f}, episode length {o['episode_length']['mean']:.1f} over {o['episodes']} "
        f"episodes (95% intervals)"
    )


# --- the command ---------------------------------------------------------------------------------------------------
def main(args) -> int:
    """`coordinatorctl eval` (args from cli.py): 0 done, 1 the evaluation failed, 2 bad input."""
    import sys

    import grpc

    from rlfleet.wire import auth, channels
    from services.coordinator.launcher import check_local
    from services.coordinator.preflight import preflight_local
    from services.coordinator.service_registry import RunFailed

    def say(text):
        if not args.quiet:
            print(text, flush=True)

    try:
        paths = list(args.compare) if args.compare else [args.target]
        if args.compare and args.target:  # `eval --compare A B k=v`: argparse took k=v as the target
            if "=" not in args.target:
                raise EvalError("--compare A B takes the two things to compare; no third target")
            args.overrides = [args.target, *args.overrides]
        if not paths or paths[0] is None:
            raise EvalError("name what to evaluate: a run folder, RUN/checkpoints/global_step_N or a model folder")
        targets = [resolve(p) for p in paths]
        infos = [verify(t) for t in targets]  # before anything else reads them
        cfgs = [eval_config(t, args.config, list(args.overrides)) for t in targets]
        for cfg, t, info in zip(cfgs, targets, infos):
            check_weights(cfg, t, info)
        check_local(cfgs[0])
        if not cfgs[0].cluster.external_env_addresses:  # external env servers are Described once up
            preflight_local(cfgs[0])
        if len(cfgs) == 2:
            ea, eb = cfgs[0].env.eval, cfgs[1].env.eval
            if (ea.env_id, ea.simulator_type, ea.seed, ea.num_episodes, ea.use_fixed_reset_state_ids) != (
                eb.env_id,
                eb.simulator_type,
                eb.seed,
                eb.num_episodes,
                eb.use_fixed_reset_state_ids,
            ):
                raise EvalError(
                    f"--compare: the two configs' env.eval differ ({ea.env_id} seed {ea.seed} x "
                    f"{ea.num_episodes} vs {eb.env_id} seed {eb.seed} x {eb.num_episodes}): give one "
                    f"--config for both"
                )
        out = output_dir(targets[0], cfgs[0], args.out, targets[1] if len(targets) == 2 else None)
    except (EvalError, ConfigError) as exc:
        print(f"coordinatorctl eval: {exc}", file=sys.stderr)
        return 2
    token = auth.token_from_env() or auth.new_token()
    reports = []
    try:
        for i, (cfg, t) in enumerate(zip(cfgs, targets)):
            where = out / "AB"[i] if len(targets) == 2 else out
            label = f"{'AB'[i]}: " if len(targets) == 2 else ""
            say(f"rlfleet eval: {label}{t.kind} {t.checkpoint or t.path} -> {where}")
            reports.append(run_session(cfg, t, where, token, quiet=args.quiet))
            say(f"{label}{summary_line(reports[-1])}")
            say(f"  report: {where / 'report.md'}, {where / 'report.json'}")
    except RunFailed as exc:
        print(f"\ncoordinatorctl eval: failed: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"\ncoordinatorctl eval: failed: {channels.describe_error(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncoordinatorctl eval: interrupted", file=sys.stderr)
        return 130
    if len(reports) == 2:
        c = compare_reports(*reports)
        (out / "compare.json").write_text(json.dumps(c, indent=1))
        (out / "compare.md").write_text(compare_markdown(c))
        o = c["overall"]
        say(
            f"A - B over the same {o['episodes']} episodes: success_once {o['success_once']['text']}, "
            f"success_at_end {o['success_at_end']['text']} (paired 95% intervals), return "
            f"{o['return']['difference']:+.2f}"
        )
        say(f"  comparison: {out / 'compare.md'}, {out / 'compare.json'}")
    return 0


__all__ = ["EvalError", "Target", "compare_reports", "main", "resolve"]

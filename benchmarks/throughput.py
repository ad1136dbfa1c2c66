"""Env steps/s of rollout collection, four ways, for each simulator:

raw simulator   the simulator backend's N slots stepped with random actions (no policy, no bookkeeping), in the
                simulator's own environment
in-process      RolloutWorker + InferenceEngine in one process (same envs, same policy, no gRPC); only for
                simulators of the main environment (the others' environments carry no model code)
pipeline S=1    env server (from the simulator's environment), inference server and learner as separate processes
pipeline S=2    over gRPC on loopback, with rollout.pipeline_stage_num = 1 and 2; timed = Collect RPCs, including
                the trajectories' trip to the learner. The services use shared memory on one host by default
                (cluster.shared_memory: auto); --shared-memory inline measures the plain gRPC path, both measures both

  python benchmarks/throughput.py [--epochs 5] [--only panda-state,metaworld-reach,...] [--shared-memory auto|inline|both]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("MUJOCO_GL", "egl")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402

import numpy as np  # noqa: E402

from rlfleet.config import load_config, to_yaml  # noqa: E402
from rlfleet.policies.families import get_family  # noqa: E402
from rlfleet.simulators import (
    environments,  # noqa: E402
    get_simulator,  # noqa: E402
)
from rlfleet.v1 import env_pb2, learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc  # noqa: E402
from rlfleet.wire import channels  # noqa: E402
from services.env.environment import python_for  # noqa: E402

CASES = {
    "panda-state": [
        "env.train.env_id=PandaPickCube-v0",
        "env.train.total_num_envs=64",
        "env.train.max_steps_per_rollout_epoch=32",
    ],
    "panda-vision": [
        "env.train.env_id=PandaPickCubeVision-v0",
        "env.train.total_num_envs=16",
        "env.train.max_steps_per_rollout_epoch=16",
        "actor.model.model_type=cnn",
        "env.train.init_params={image_size: 64}",
        "actor.global_batch_size=256",
        "actor.micro_batch_size=128",
    ],
    # the tiny OpenVLA-OFT (it resizes to its 64 px) on two 224 px cameras: the wire carries 301 KB per env step
    "panda-vision-oft-224": [
        "env.train.env_id=PandaPickCubeVision-v0",
        "env.train.total_num_envs=8",
        "env.train.max_steps_per_rollout_epoch=32",
        "actor.model.model_type=openvla_oft",
        "actor.model.num_action_chunks=4",
        "actor.model.image_key=third_person",
        "actor.model.extra_image_keys=[wrist]",
        "env.train.init_params={image_size: 224}",
        "actor.global_batch_size=64",
        "actor.micro_batch_size=32",
    ],
    "panda-vision-openvla": [
        "env.train.env_id=PandaPickCubeVision-v0",
        "env.train.total_num_envs=8",
        "env.train.max_steps_per_rollout_epoch=16",
        "actor.model.model_type=openvla",
        "actor.model.image_key=third_person",
        "env.train.init_params={image_size: 64}",
        "actor.global_batch_size=128",
        "actor.micro_batch_size=32",
    ],
    "metaworld-reach": [
        "env.train.simulator_type=metaworld",
        "env.train.env_id=reach-v3",
        "env.eval.simulator_type=metaworld",
        "env.eval.env_id=reach-v3",
        "env.train.total_num_envs=32",
        "env.train.max_steps_per_rollout_epoch=64",
        "env.train.max_episode_steps=100",
    ],
    "libero-spatial": [
        "env.train.simulator_type=libero",
        "env.train.env_id=libero_spatial",
        "env.eval.simulator_type=libero",
        "env.eval.env_id=libero_spatial",
        "env.train.total_num_envs=4",
        "env.train.max_steps_per_rollout_epoch=16",
        "env.train.max_episode_steps=240",
        "actor.model.model_type=cnn",
        "env.train.init_params={image_size: 64, max_idle_envs: 2}",
        "actor.global_batch_size=64",
        "actor.micro_batch_size=64",
    ],
    "maniskill-pushcube": [
        "env.train.simulator_type=maniskill",
        "env.train.env_id=PushCube-v1",
        "env.eval.simulator_type=maniskill",
        "env.eval.env_id=PushCube-v1",
        "env.train.total_num_envs=16",
        "env.train.max_steps_per_rollout_epoch=50",
        "env.train.max_episode_steps=50",
        "actor.global_batch_size=400",
        "actor.micro_batch_size=400",
    ],
}


RAW_ACTIONS = ("random", "expert")


def raw_sim(cfg, steps_per_env: int, actions: str = "random") -> float:
    """Backend slots stepped with ``actions`` ("random" or "expert", see _raw_here), in the simulator's environment
    (a subprocess if needed)."""
    python = python_for(cfg.env.train.simulator_type)
    if python != sys.executable:
        env = {**os.environ, "PYTHONPATH": str(environments.REPO_ROOT)}
        out = subprocess.run(
            [python, __file__, "--raw", to_yaml(cfg), "--steps", str(steps_per_env), "--raw-actions", actions],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        return float(json.loads(out.stdout.strip().splitlines()[-1])["rate"])
    return _raw_here(cfg, steps_per_env, actions)


def _raw_here(cfg, steps_per_env: int, actions: str = "random") -> float:
    """Env steps/s of backend.step alone. ``actions``: "random" (uniform over the action space) or "expert" (the
    backend's scripted expert, computed outside the timed calls: the contact-rich grasp-and-lift steps a solved task
    makes, which cost a physics engine more than random flailing does)."""
    from services.env.backends import make_sim_backend

    if actions not in RAW_ACTIONS:
        raise ValueError(f"raw actions: '{actions}' is not one of {list(RAW_ACTIONS)}")

    tr = cfg.env.train
    n = tr.total_num_envs
    backend = make_sim_backend(tr.simulator_type, tr.env_id, n, dict(tr.init_params))
    ids = np.arange(n)
    backend.reset(ids, list(range(n)), [None] * n)
    space = backend.action_space
    rng = np.random.default_rng(0)
    acts = rng.uniform(space.low, space.high, (steps_per_env, n, *space.shape)).astype(np.float32)
    stepping = 0.0
    for t in range(steps_per_env):
        act = backend.expert_actions(ids) if actions == "expert" else acts[t]
        t0 = time.perf_counter()
        backend.step(ids, act)
        stepping += time.perf_counter() - t0
        if (t + 1) % tr.max_episode_steps == 0:
            backend.reset(ids, [None] * n, [None] * n)
    rate = steps_per_env * n / stepping
    backend.close()
    return rate


def in_process(cfg, epochs: int) -> float | None:
    if get_simulator(cfg.env.train.simulator_type).environment is not None:
        return None
    import torch

    from rlfleet.wire.clients import LocalPolicyClient
    from rlfleet.wire.spaces import TensorSpace
    from services.env.server import build_worker
    from services.inference.server import build_engine

    cfg.rollout.pipeline_stage_num = 1
    env, worker = build_worker(cfg, 0)
    engine = build_engine(cfg)
    from rlfleet.policies import build_policy

    torch.set_num_threads(1)
    specs = {k: TensorSpace(sp.shape, sp.dtype.name) for k, sp in env.observation_space.items()}
    adim = env.action_space.size
    model = build_policy(cfg.actor.model, specs, adim, True)
    engine.set_weights(0, model.state_dict(), obs_specs=specs, action_dim=adim)
    policy = LocalPolicyClient(engine, 1, adim)
    T = cfg.env.train.max_steps_per_rollout_epoch
    worker.collect(0, T, policy)  # warm-up
    t0 = time.perf_counter()
    steps = 0
    for e in range(epochs):  # env steps as the pipeline counts them (a sample of a chunked policy is chunk env steps)
        steps += worker.collect(e, T, policy)[1].env_steps
    rate = steps / (time.perf_counter() - t0)
    worker.close()
    return rate


def _spawn(module: str, config: str, extra=(), python: str = sys.executable) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(environments.REPO_ROOT)}
    proc = subprocess.Popen(
        [python, "-m", module, "--config", config, "--address", "127.0.0.1:0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    for line in proc.stdout:
        m = re.search(r"serving on (\S+)", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError(f"{module} did not start")


def pipeline(cfg, stages: int, epochs: int, shared_memory: str | None = None, collocated: bool = False) -> float:
    """``collocated``: cluster.component_placement.rollout: env (issue 37): the env server acts with the policy in
    its own process and takes the weights from the learner; two processes, no inference server."""
    cfg.rollout.pipeline_stage_num = stages
    if shared_memory is not None:
        cfg.cluster.shared_memory = shared_memory
    if collocated:
        cfg.cluster.component_placement = {"env,actor": "all", "rollout": "env"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.yaml")
        with open(path, "w") as f:
            f.write(to_yaml(cfg))
        procs = []
        try:
            if not collocated:
                p, inf = _spawn("services.inference.server", path)
                procs.append(p)
            p, learner = _spawn("services.learner.server", path, ["--run-dir", os.path.join(tmp, "run")])
            procs.append(p)
            p, env = _spawn("services.env.server", path, python=python_for(cfg.env.train.simulator_type))
            procs.append(p)
            rstub = rollout_pb2_grpc.RolloutServiceStub(channels.channel(env))
            spec = rstub.Describe(env_pb2.DescribeEnvRequest())
            lstub = learner_pb2_grpc.LearnerServiceStub(channels.channel(learner))
            targets = [env] if collocated else [inf]  # where the weights go
            lstub.PublishWeights(learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=targets))
            req = rollout_pb2.CollectRequest(
                epoch=0,
                num_steps=cfg.env.train.max_steps_per_rollout_epoch,
                inference_addresses=[] if collocated else [inf],
                learner_address=learner,
            )
            rstub.Collect(req)  # warm-up
            t0 = time.perf_counter()
            steps = sum(rstub.Collect(req).env_steps for _ in range(epochs))
            return steps / (time.perf_counter() - t0)
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=5, help="timed rollout epochs per measurement")
    ap.add_argument("--only", default=None, help=f"comma-separated cases of {', '.join(CASES)}")
    ap.add_argument(
        "--shared-memory",
        default="auto",
        choices=("auto", "inline", "both"),
        help="cluster.shared_memory for the pipeline (both: auto, then inline in columns of their own)",
    )
    ap.add_argument(
        "--collocated",
        action="store_true",
        help="also the collocated placement (cluster.component_placement.rollout: env, S=1: env server and learner, "
        "no inference server), for the cases whose policy may act collocated",
    )
    ap.add_argument("--raw", default=None, help=argparse.SUPPRESS)  # internal: raw_sim in a simulator environment
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--raw-actions", default="random", choices=RAW_ACTIONS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw:
        from rlfleet.config import config_from_yaml

        print(json.dumps({"rate": _raw_here(config_from_yaml(args.raw), args.steps, args.raw_actions)}))
        return
    rows, collocated = [], []
    for name, overrides in CASES.items():
        if args.only and name not in args.only.split(","):
            continue
        cfg = load_config(None, overrides)
        n, T = cfg.env.train.total_num_envs, cfg.env.train.max_steps_per_rollout_epoch
        print(
            f"[{name}] {cfg.env.train.simulator_type}:{cfg.env.train.env_id}: {n} envs x {T} steps per epoch, "
            f"{args.epochs} epochs ...",
            flush=True,
        )
        raw = raw_sim(cfg, T * args.epochs)
        local = in_process(load_config(None, overrides), args.epochs)
        first = "auto" if args.shared_memory == "both" else args.shared_memory
        s1 = pipeline(load_config(None, overrides), 1, args.epochs, first)
        s2 = pipeline(load_config(None, overrides), 2, args.epochs, first)
        off = None
        if args.shared_memory == "both":
            off = (
                pipeline(load_config(None, overrides), 1, args.epochs, "inline"),
                pipeline(load_config(None, overrides), 2, args.epochs, "inline"),
            )
        rows.append((name, cfg.env.train.simulator_type, cfg.env.train.env_id, n, raw, local, s1, s2, off))
        if args.collocated and get_family(cfg.actor.model.model_type).collocated:
            col = pipeline(load_config(None, overrides), 1, args.epochs, first, collocated=True)
            collocated.append(f"| {name} | {col:,.0f} | {s1:,.0f} | {s2:,.0f} | {col / s2:.2f} |")
    both = args.shared_memory == "both"
    print()
    extra = " S=1, gRPC only | S=2, gRPC only | S=1 / in-process, gRPC only |" if both else ""
    print(
        "| case | simulator | env | envs | raw simulator | in-process loop | pipeline S=1 | pipeline S=2 "
        f"| S=1 / in-process | S=2 / in-process | S=2 / raw |{extra}"
    )
    print("|---" * (11 + 3 * both) + "|")
    for name, sim, env_id, n, raw, local, s1, s2, off in rows:
        loc = f"{local:,.0f}" if local else "-"
        ratio = lambda x: f"{x / local:.2f}" if local else "-"  # noqa: E731
        more = f" {off[0]:,.0f} | {off[1]:,.0f} | {ratio(off[0])} |" if off else ""
        print(
            f"| {name} | {sim} | {env_id} | {n} | {raw:,.0f} | {loc} | {s1:,.0f} | {s2:,.0f} | {ratio(s1)} "
            f"| {ratio(s2)} | {s2 / raw:.2f} |{more}"
        )
    print(
        f"\n(env steps/s; pipeline = 3 processes over gRPC on loopback, cluster.shared_memory: {args.shared_memory}; "
        "in-process needs torch, so only for simulators of the main environment)"
    )
    if collocated:
        print("\n| case | collocated (rollout: env, S=1) | pipeline S=1 | pipeline S=2 | collocated / S=2 |")
        print("|---" * 5 + "|")
        print("\n".join(collocated))


if __name__ == "__main__":
    main()

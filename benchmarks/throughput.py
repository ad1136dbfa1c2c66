"""Env steps/s of rollout collection, four ways, for the state and the vision env:

  raw simulator   N gymnasium envs stepped with random actions (no policy, no bookkeeping)
  in-process      RolloutWorker + InferenceEngine in one process (same envs, same policy, no gRPC)
  pipeline S=1    env server, inference server and learner as separate processes over gRPC on loopback,
  pipeline S=2    with rollout.pipeline_stage_num = 1 and 2; timed = Collect RPCs, including the
                  trajectories' trip to the learner

    python benchmarks/throughput.py [--epochs 5] [--only state|vision]
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlfleet import rpc  # noqa: E402
from rlfleet.config import load_config, to_yaml  # noqa: E402
from rlfleet.v1 import env_pb2, learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc  # noqa: E402

CASES = {
    "state": ["env.train.env_id=PandaPickCube-v0", "env.train.total_num_envs=64",
              "env.train.max_steps_per_rollout_epoch=32"],
    "vision": ["env.train.env_id=PandaPickCubeVision-v0", "env.train.total_num_envs=16",
               "env.train.max_steps_per_rollout_epoch=16", "actor.model.model_type=cnn",
               "env.train.init_params={image_size: 64}", "actor.global_batch_size=256",
               "actor.micro_batch_size=128"],
}


def raw_sim(cfg, steps_per_env: int) -> float:
    from services.env.vec_env import make_env

    n = cfg.env.train.total_num_envs
    envs = [make_env(cfg.env.train.env_id, dict(cfg.env.train.init_params)) for _ in range(n)]
    for i, e in enumerate(envs):
        e.reset(seed=i)
    rng = np.random.default_rng(0)
    acts = rng.uniform(-1, 1, (steps_per_env, n, 4)).astype(np.float32)
    t0 = time.perf_counter()
    for t in range(steps_per_env):
        for i, e in enumerate(envs):
            e.step(acts[t, i])
            if (t + 1) % cfg.env.train.max_episode_steps == 0:
                e.reset()
    rate = steps_per_env * n / (time.perf_counter() - t0)
    for e in envs:
        e.close()
    return rate


def in_process(cfg, epochs: int) -> float:
    from rlfleet.models.actor_critic import ObsSpec
    from services.env.server import build_worker
    from rlfleet.clients.policy import LocalPolicyClient
    from services.inference.server import build_engine

    cfg.rollout.pipeline_stage_num = 1
    env, worker = build_worker(cfg, 0)
    info = env.space_info()
    engine = build_engine(cfg)
    from rlfleet.models import build_policy

    specs = {k: ObsSpec(shape, dt.name) for k, (shape, dt, _, _) in info.obs_shapes.items()}
    model = build_policy(cfg.actor.model, specs, 4, True)
    engine.set_weights(0, model.state_dict(), obs_specs=specs, action_dim=4)
    policy = LocalPolicyClient(engine, 1, 4)
    T = cfg.env.train.max_steps_per_rollout_epoch
    worker.collect(0, T, policy)  # warm-up
    t0 = time.perf_counter()
    for e in range(epochs):
        worker.collect(e, T, policy)
    rate = epochs * T * env.num_envs / (time.perf_counter() - t0)
    worker.close()
    return rate


def _spawn(module: str, config: str, extra=()) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", module, "--config", config, "--address", "127.0.0.1:0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.search(r"serving on (\S+)", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError(f"{module} did not start")


def pipeline(cfg, stages: int, epochs: int) -> float:
    cfg.rollout.pipeline_stage_num = stages
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.yaml")
        with open(path, "w") as f:
            f.write(to_yaml(cfg))
        procs = []
        try:
            p, inf = _spawn("services.inference.server", path)
            procs.append(p)
            p, learner = _spawn("services.learner.server", path, ["--run-dir", os.path.join(tmp, "run")])
            procs.append(p)
            p, env = _spawn("services.env.server", path)
            procs.append(p)
            rstub = rollout_pb2_grpc.RolloutServiceStub(rpc.channel(env))
            spec = rstub.Describe(env_pb2.DescribeEnvRequest())
            lstub = learner_pb2_grpc.LearnerServiceStub(rpc.channel(learner))
            lstub.PublishWeights(learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=[inf]))
            req = rollout_pb2.CollectRequest(epoch=0, num_steps=cfg.env.train.max_steps_per_rollout_epoch,
                                             inference_addresses=[inf], learner_address=learner)
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
    ap.add_argument("--only", choices=sorted(CASES), default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, overrides in CASES.items():
        if args.only and name != args.only:
            continue
        cfg = load_config(None, overrides)
        n, T = cfg.env.train.total_num_envs, cfg.env.train.max_steps_per_rollout_epoch
        print(f"[{name}] {cfg.env.train.env_id}: {n} envs x {T} steps per epoch, {args.epochs} epochs ...", flush=True)
        raw = raw_sim(cfg, T * args.epochs)
        local = in_process(load_config(None, overrides), args.epochs)
        s1 = pipeline(load_config(None, overrides), 1, args.epochs)
        s2 = pipeline(load_config(None, overrides), 2, args.epochs)
        rows.append((name, cfg.env.train.env_id, n, raw, local, s1, s2))
    print()
    print("| env | envs | raw simulator | in-process loop | pipeline S=1 | pipeline S=2 | S=1 / in-process | S=2 / in-process |")
    print("|---|---|---|---|---|---|---|---|")
    for name, env_id, n, raw, local, s1, s2 in rows:
        print(f"| {env_id} | {n} | {raw:,.0f} | {local:,.0f} | {s1:,.0f} | {s2:,.0f} | {s1 / local:.2f} | {s2 / local:.2f} |")
    print("\n(env steps/s; 2-core machine; pipeline = 3 processes over gRPC on loopback)")


if __name__ == "__main__":
    main()

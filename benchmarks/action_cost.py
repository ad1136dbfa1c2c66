"""What the policy's actions cost the simulator: PandaPickCube-v0 stepped with random actions and with the scripted
expert's (a solved task's grasp-and-lift steps), and, given a run's checkpoint, one env server's share of a default
epoch collected in this process with that policy and with the initial one.

    python benchmarks/action_cost.py [--steps 3000] [--checkpoint runs/<run>/checkpoints/global_step_N] [--epochs 30]

The first table is the env alone (one process, one env per kind, their 50-step episodes in turns, resets outside
the timing): env steps/s and
MuJoCo contacts per step. The second is the collocated rollout loop of one env server (services.env.rollout's
RolloutWorker over 32 envs, acting with rlfleet.policies.local.LocalPolicy, no gRPC), medians per epoch of 16 steps, the two policies' epochs in turns:
the whole-loop ratio to the random-action raw rate (benchmarks/time_to_success.py) is bounded by how much dearer the
learned policy's steps are than random ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ENV_ID = "PandaPickCube-v0"
ENVS = 32  # one env server's envs in the default run (64 over two servers)
STEPS = 16  # env.train.max_steps_per_rollout_epoch


def env_alone(steps: int) -> dict[str, tuple[float, float]]:
    """-> {"random"|"expert": (env steps/s, contacts per step)} of one env each, their 50-step episodes taken in
    turns so that a drift of the host's speed weighs on both alike."""
    from services.env.envs.panda_pick_cube import PandaPickCubeEnv, scripted_expert_action

    rng = np.random.default_rng(0)
    envs = {kind: PandaPickCubeEnv() for kind in ("random", "expert")}
    spent, contacts = dict.fromkeys(envs, 0.0), dict.fromkeys(envs, 0)
    for episode in range(steps // 50):
        for kind, env in envs.items():
            obs, _ = env.reset(seed=episode)
            for _ in range(50):
                a = scripted_expert_action(obs) if kind == "expert" else rng.uniform(-1, 1, 4).astype(np.float32)
                t0 = time.perf_counter()
                obs, *_ = env.step(a)
                spent[kind] += time.perf_counter() - t0
                contacts[kind] += env.data.ncon
    n = steps // 50 * 50
    for env in envs.values():
        env.close()
    return {kind: (n / spent[kind], contacts[kind] / n) for kind in envs}


def _worker(checkpoint: str | None):
    """One env server's rollout worker acting with the policy of ``checkpoint`` (None: the initial policy of the
    run's seed) -> (worker, policy client)."""
    from rlfleet.config import load_config
    from rlfleet.policies import build_policy
    from rlfleet.policies.local import LocalPolicy
    from rlfleet.wire.clients import make_policy_client
    from services.env.rollout import RolloutWorker
    from services.env.vec_env import VecEnv
    from services.learner.checkpoint import load_policy_state

    cfg = load_config(None, [])
    torch.manual_seed(cfg.runner.seed)
    env = VecEnv(ENV_ID, ENVS, max_episode_steps=cfg.env.train.max_episode_steps, seed=0)
    model = build_policy(cfg.actor.model, env.observation_space, env.action_space.size, cfg.algorithm.normalize_obs)
    if checkpoint:
        load_policy_state(checkpoint, model)
    policy = LocalPolicy(cfg.actor.model, batch_invariant_rows=ENVS)
    policy.set_weights(0, model.state_dict(), obs_specs=env.observation_space, action_dim=env.action_space.size)
    return RolloutWorker(env, 1, seed=0), make_policy_client(policy, 1, env.action_space.size)


def rollouts(checkpoints: dict[str, str | None], epochs: int) -> dict[str, tuple[float, float, float]]:
    """-> per policy, medians (ms) of one epoch's rollout, its env stepping and its acting; the policies' epochs
    taken in turns (the first 5 of each not counted: warm-up)."""
    workers = {name: _worker(ckpt) for name, ckpt in checkpoints.items()}
    times: dict[str, list] = {name: [] for name in workers}
    for epoch in range(epochs):
        for name, (worker, client) in workers.items():
            _, s = worker.collect(epoch, STEPS, client)
            if epoch >= 5:
                times[name].append((s.rollout_time_s, s.env_time_s, s.inference_wait_s))
    for worker, _ in workers.values():
        worker.close()
    return {name: tuple(statistics.median(x) * 1e3 for x in zip(*rows)) for name, rows in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000, help="env steps per action kind (the env-alone table)")
    ap.add_argument("--checkpoint", default=None, help="a run's checkpoint folder: its policy's rollout cost")
    ap.add_argument("--epochs", type=int, default=30, help="rollout epochs per policy (the first 5 not counted)")
    args = ap.parse_args()
    if args.steps < 50 or args.epochs < 6:
        ap.error("--steps must be >= 50 and --epochs >= 6")
    if args.checkpoint and not os.path.isdir(args.checkpoint):
        ap.error(f"--checkpoint: no folder {args.checkpoint}")
    torch.set_num_threads(1)
    print(f"{ENV_ID}, one env, one process, {args.steps} steps each\n")
    print("| actions | env steps/s | contacts per step |\n|---|---|---|")
    alone = env_alone(args.steps)
    for kind, (rate, contacts) in alone.items():
        print(f"| {kind} | {rate:,.0f} | {contacts:.1f} |")
    print(f"\nexpert steps cost {alone['random'][0] / alone['expert'][0]:.2f}x random ones")
    if not args.checkpoint:
        return
    print(f"\none env server's epoch ({ENVS} envs x {STEPS} steps, collocated acting), medians of {args.epochs - 5}:\n")
    print("| policy | rollout (ms) | env stepping (ms) | acting (ms) |\n|---|---|---|---|")
    costs = rollouts({"initial (seed 1)": None, args.checkpoint: args.checkpoint}, args.epochs)
    for name, (whole, stepping, acting) in costs.items():
        print(f"| {name} | {whole:.1f} | {stepping:.1f} | {acting:.1f} |")
    first, trained = (c[1] for c in costs.values())
    print(f"\nthe checkpoint's steps cost {trained / first:.2f}x the initial policy's")


if __name__ == "__main__":
    main()

"""Env steps/s of the built-in MuJoCo pick-cube envs, one process, random actions (plus a replay of
scripted-expert episodes for the state env, which spends most of its time in contact with the cube).

    python benchmarks/sim_speed.py [--state-steps 5000] [--vision-steps 300] [--image-size 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("MUJOCO_GL", "egl")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from services.env.envs import PandaPickCubeEnv, PandaPickCubeVisionEnv, scripted_expert_action  # noqa: E402

EPISODE = 50


def _run(env, actions: np.ndarray) -> float:
    env.reset(seed=0)
    t0 = time.perf_counter()
    for i, a in enumerate(actions):
        if i and i % EPISODE == 0:
            env.reset(seed=i // EPISODE)
        env.step(a)
    return len(actions) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-steps", type=int, default=5000)
    p.add_argument("--vision-steps", type=int, default=300)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--n-substeps", type=int, default=None, help="physics substeps per 0.1 s control step")
    args = p.parse_args()
    kw = {} if args.n_substeps is None else {"n_substeps": args.n_substeps}
    rng = np.random.default_rng(0)

    env = PandaPickCubeEnv(**kw)
    print(f"state env: {env.n_substeps} x {env.model.opt.timestep * 1e3:.1f} ms substeps per control step")
    acts = rng.uniform(-1, 1, (args.state_steps, 4)).astype(np.float32)
    _run(env, acts[:200])  # warm-up
    print(f"PandaPickCube-v0        random actions : {_run(env, acts):8.0f} steps/s ({args.state_steps} steps)")

    # record scripted-expert episodes, then time their replay (grasping/lifting = contact-heavy)
    expert = []
    n_eps = max(1, args.state_steps // EPISODE)
    for ep in range(n_eps):
        obs, _ = env.reset(seed=ep)
        for _ in range(EPISODE):
            a = scripted_expert_action(obs)
            expert.append(a)
            obs, *_ = env.step(a)
    print(
        f"PandaPickCube-v0        expert replay  : {_run(env, np.asarray(expert)):8.0f} steps/s ({len(expert)} steps)"
    )
    env.close()

    venv = PandaPickCubeVisionEnv(image_size=args.image_size, **kw)
    vacts = rng.uniform(-1, 1, (args.vision_steps, 4)).astype(np.float32)
    _run(venv, vacts[:20])  # warm-up (GL context, shaders)
    print(
        f"PandaPickCubeVision-v0  {args.image_size}px random   : {_run(venv, vacts):8.0f} steps/s "
        f"({args.vision_steps} steps, 2 cameras)"
    )
    venv.close()


if __name__ == "__main__":
    main()

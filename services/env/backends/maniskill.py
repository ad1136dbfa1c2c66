"""ManiSkill3 placeholder (being written)."""

from __future__ import annotations


def check_install() -> None:
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    import sapien  # noqa: F401

    env = gym.make("PushCube-v1", obs_mode="state", sim_backend="physx_cpu", render_mode=None)
    env.reset(seed=0)
    env.step(env.action_space.sample())
    env.close()
    print("maniskill: PushCube-v1 created, reset and stepped")

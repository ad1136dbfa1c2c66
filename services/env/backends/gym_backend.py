"""The built-in ``gym`` backend, ``GymBackend``: any gymnasium-registered env id (one Python env per slot), including
rlfleet's own PandaPickCube-v0 / PandaPickCubeVision-v0 (registered by importing services.env.envs). Box action
spaces only; Box or Dict-of-Box observations (a bare Box is named 'state'). The instruction is the env's
``task_description`` attribute when it has one; success is ``info['success']`` (or ``info['is_success']``).

The module is not named ``gym`` so that it can never be taken for the gym package (a script run from this folder
puts it first on sys.path); the simulator's name in the registry is ``gym``.
"""

from __future__ import annotations

import numpy as np

from rlfleet.errors import InvalidRequest
from rlfleet.wire.spaces import TensorSpace, spaces_from_gym
from services.env.backends.base import SimBackend, StepResult
from services.env.gym_envs import make_gym_env


def _obs_dict(obs) -> dict[str, np.ndarray]:
    return dict(obs) if isinstance(obs, dict) else {"state": obs}


class GymBackend(SimBackend):
    name = "gym"

    def __init__(self, env_id: str, num_envs: int, **params):
        import gymnasium as gym

        super().__init__(env_id, num_envs)
        self.envs = [make_gym_env(env_id, params) for _ in range(num_envs)]
        env0 = self.envs[0]
        if not isinstance(env0.action_space, gym.spaces.Box):
            raise InvalidRequest(f"env '{env_id}': only Box action spaces are supported, got {env0.action_space}")
        spec = gym.spec(env_id)
        self.observation_space = spaces_from_gym(env0.observation_space)
        self.action_space = TensorSpace.from_gym(env0.action_space)
        self.max_episode_steps = int(spec.max_episode_steps or 1000)
        # only envs that say so (rlfleet's state-only MuJoCo envs): any other gymnasium env may hold a renderer
        self.any_thread = all(getattr(env.unwrapped, "steps_on_any_thread", False) for env in self.envs)

    def _instruction(self, i: int) -> str:
        return str(getattr(self.envs[i], "task_description", "") or "")

    def reset(self, env_ids, seeds, state_ids):
        rows = []
        for i, seed in zip(env_ids, seeds):
            obs, _ = self.envs[i].reset(seed=seed)
            rows.append(_obs_dict(obs))
        return stack_obs(rows, self.observation_space), [self._instruction(i) for i in env_ids]

    def step(self, env_ids, actions) -> StepResult:
        n = len(env_ids)
        rows, rewards = [], np.zeros(n, np.float32)
        terminated, truncated, success = np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
        for j, i in enumerate(env_ids):
            obs, reward, term, trunc, info = self.envs[i].step(actions[j])
            rows.append(_obs_dict(obs))
            rewards[j], terminated[j], truncated[j] = reward, term, trunc
            success[j] = bool(info.get("success", info.get("is_success", False)))
        return StepResult(stack_obs(rows, self.observation_space), rewards, terminated, truncated, success)

    def expert_actions(self, env_ids) -> np.ndarray:
        """The env's own ``expert_action()`` (rlfleet's PandaPickCube envs have one)."""
        if not hasattr(self.envs[0], "expert_action"):
            return super().expert_actions(env_ids)
        return np.stack([np.asarray(self.envs[i].expert_action(), np.float32) for i in env_ids])

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs = []


def stack_obs(rows: list[dict[str, np.ndarray]], space: dict[str, TensorSpace]) -> dict[str, np.ndarray]:
    """Per-slot observation dicts -> batched arrays in the declared dtypes."""
    return {k: np.stack([np.asarray(r[k]) for r in rows]).astype(s.dtype, copy=False) for k, s in space.items()}

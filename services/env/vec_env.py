"""VecEnv: the env server's core. N gymnasium envs stepped in one process, with auto-reset, seeding,
episode bookkeeping (return, length, success_once) and validation of every action it is given.

The same interface is offered for an external simulator by ``services.env.remote.RemoteVecEnv`` so the rollout
worker runs unchanged in front of either.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np

from rlfleet.rpc import InvalidRequest


@dataclass
class EpisodeStat:
    env_id: int
    episode_return: float
    length: int
    success_once: bool
    success_at_end: bool


@dataclass
class StepResult:
    """Batch result for the stepped envs (rows follow the requested env_ids)."""

    obs: dict[str, np.ndarray]
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    success: np.ndarray
    final_obs: dict[str, np.ndarray]
    episodes: list[EpisodeStat] = field(default_factory=list)


@dataclass
class SpaceInfo:
    env_id: str
    num_envs: int
    obs_shapes: dict[str, tuple[tuple[int, ...], np.dtype, float, float]]  # key -> (shape, dtype, low, high)
    action_shape: tuple[int, ...]
    action_low: float
    action_high: float
    max_episode_steps: int
    auto_reset: bool
    task_descriptions: list[str]


def make_env(env_id: str, init_params: dict | None = None) -> gym.Env:
    """gym.make for a registered id, without gymnasium's wrappers (the VecEnv enforces the time limit)."""
    import services.env.envs  # noqa: F401  (registers the built-in envs)

    if env_id not in gym.registry:
        known = sorted(k for k in gym.registry if not k.startswith(("ALE/", "phys2d/", "tabular/")))
        close = difflib.get_close_matches(env_id, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise InvalidRequest(f"unknown env id '{env_id}'{hint} (import services.env.envs registers "
                             f"PandaPickCube-v0 and PandaPickCubeVision-v0)")
    try:
        return gym.make(env_id, disable_env_checker=True, **(init_params or {})).unwrapped
    except TypeError as exc:
        raise InvalidRequest(f"env '{env_id}' rejected init_params {dict(init_params or {})}: {exc}") from exc


def _obs_dict(obs) -> dict[str, np.ndarray]:
    return dict(obs) if isinstance(obs, dict) else {"state": obs}


class VecEnv:
    """``num_envs`` copies of one gymnasium env, stepped sequentially in this process.

    Every call into the simulators runs on one dedicated thread: renderers (EGL/OpenGL contexts) and many
    simulators are bound to the thread that created them, while gRPC serves each call on a pool thread.
    """

    def __init__(self, env_id: str, num_envs: int, *, max_episode_steps: int, auto_reset: bool = True,
                 ignore_terminations: bool = False, init_params: dict | None = None, seed: int = 0):
        if num_envs < 1:
            raise InvalidRequest(f"num_envs must be >= 1, got {num_envs}")
        self.env_id = env_id
        self._sim_thread = ThreadPoolExecutor(1, thread_name_prefix="sim")
        self.envs = self._on_sim_thread(lambda: [make_env(env_id, init_params) for _ in range(num_envs)])
        self.num_envs = num_envs
        self.max_episode_steps = max_episode_steps
        self.auto_reset = auto_reset
        self.ignore_terminations = ignore_terminations
        self.base_seed = seed
        self._lock = threading.Lock()
        env0 = self.envs[0]
        act_space = env0.action_space
        if not isinstance(act_space, gym.spaces.Box):
            raise InvalidRequest(f"env '{env_id}': only Box action spaces are supported, got {act_space}")
        self.action_low = act_space.low.astype(np.float32)
        self.action_high = act_space.high.astype(np.float32)
        obs_space = env0.observation_space
        subspaces = obs_space.spaces if isinstance(obs_space, gym.spaces.Dict) else {"state": obs_space}
        self.obs_info = {k: (tuple(s.shape), np.dtype(s.dtype), float(np.min(s.low)), float(np.max(s.high)))
                         for k, s in subspaces.items()}
        self._obs = {k: np.zeros((num_envs, *shape), dtype=dt) for k, (shape, dt, _, _) in self.obs_info.items()}
        self._ep_return = np.zeros(num_envs, np.float64)
        self._ep_len = np.zeros(num_envs, np.int64)
        self._ep_success = np.zeros(num_envs, bool)
        self._done = np.zeros(num_envs, bool)  # finished and not reset (auto_reset off)
        self._has_reset = np.zeros(num_envs, bool)
        self.task_descriptions = [str(getattr(e, "task_description", "")) for e in self.envs]

    # --- description ------------------------------------------------------------------------------------------
    def space_info(self) -> SpaceInfo:
        return SpaceInfo(self.env_id, self.num_envs, dict(self.obs_info), tuple(self.action_low.shape),
                         float(self.action_low.min()), float(self.action_high.max()), self.max_episode_steps,
                         self.auto_reset, list(self.task_descriptions))

    # --- validation -------------------------------------------------------------------------------------------
    def _ids(self, env_ids: Sequence[int] | None) -> np.ndarray:
        if env_ids is None or len(env_ids) == 0:
            return np.arange(self.num_envs)
        ids = np.asarray(env_ids, dtype=np.int64)
        bad = ids[(ids < 0) | (ids >= self.num_envs)]
        if bad.size:
            raise InvalidRequest(f"env_ids: unknown env id {int(bad[0])} (this server hosts 0..{self.num_envs - 1})")
        if np.unique(ids).size != ids.size:
            raise InvalidRequest(f"env_ids: duplicate ids in {ids.tolist()}")
        return ids

    def _check_actions(self, actions: np.ndarray, n: int) -> np.ndarray:
        want = (n, *self.action_low.shape)
        if actions.shape != want:
            raise InvalidRequest(f"actions: shape {list(actions.shape)} where {list(want)} was expected")
        if not np.isfinite(actions).all():
            row, col = np.argwhere(~np.isfinite(actions))[0]
            raise InvalidRequest(f"actions: non-finite value {actions[row, col]} for env row {row}, dim {col}")
        return np.clip(actions.astype(np.float32, copy=False), self.action_low, self.action_high)

    def _write_obs(self, i: int, obs) -> None:
        for k, v in _obs_dict(obs).items():
            self._obs[k][i] = v

    def _gather(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[ids] for k, v in self._obs.items()}

    def _on_sim_thread(self, fn, *args):
        return self._sim_thread.submit(fn, *args).result()

    # --- API --------------------------------------------------------------------------------------------------
    def reset(self, env_ids: Sequence[int] | None = None, seeds: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        with self._lock:
            return self._on_sim_thread(self._reset, env_ids, seeds)

    def step(self, env_ids: Sequence[int] | None, actions: np.ndarray) -> StepResult:
        with self._lock:
            return self._on_sim_thread(self._step, env_ids, actions)

    def close(self) -> None:
        with self._lock:
            if self.envs:
                self._on_sim_thread(lambda: [env.close() for env in self.envs])
            self.envs = []
            self._sim_thread.shutdown(wait=False)

    def _reset(self, env_ids, seeds) -> dict[str, np.ndarray]:
        ids = self._ids(env_ids)
        if seeds is not None and len(seeds) and len(seeds) != len(ids):
            raise InvalidRequest(f"seeds: {len(seeds)} seeds for {len(ids)} envs")
        for j, i in enumerate(ids):
            seed = int(seeds[j]) if seeds is not None and len(seeds) else None
            if seed is None and not self._has_reset[i]:
                seed = self.base_seed + int(i)
            obs, _ = self.envs[i].reset(seed=seed)
            self._write_obs(i, obs)
            self._has_reset[i] = True
            self._ep_return[i] = 0.0
            self._ep_len[i] = 0
            self._ep_success[i] = False
            self._done[i] = False
        return self._gather(ids)

    def _step(self, env_ids, actions) -> StepResult:
        ids = self._ids(env_ids)
        actions = self._check_actions(np.asarray(actions), len(ids))
        if not self._has_reset[ids].all():
            raise InvalidRequest(f"env_ids: env {int(ids[~self._has_reset[ids]][0])} was never reset")
        n = len(ids)
        rewards = np.zeros(n, np.float32)
        terminated = np.zeros(n, bool)
        truncated = np.zeros(n, bool)
        success = np.zeros(n, bool)
        final_obs = None
        episodes: list[EpisodeStat] = []
        for j, i in enumerate(ids):
            if self._done[i]:  # finished, waiting for a reset (auto_reset off): frozen, no reward
                terminated[j] = True
                continue
            obs, reward, term, trunc, info = self.envs[i].step(actions[j])
            self._ep_len[i] += 1
            self._ep_return[i] += reward
            succ = bool(info.get("success", False))
            self._ep_success[i] |= succ
            if self.ignore_terminations:
                term = False
            trunc = bool(trunc) or self._ep_len[i] >= self.max_episode_steps
            rewards[j], terminated[j], truncated[j], success[j] = reward, term, trunc and not term, succ
            self._write_obs(i, obs)
            if term or trunc:
                if final_obs is None:
                    final_obs = {k: v[ids].copy() for k, v in self._obs.items()}
                else:
                    for k, v in _obs_dict(obs).items():
                        final_obs[k][j] = v
                episodes.append(EpisodeStat(int(i), float(self._ep_return[i]), int(self._ep_len[i]),
                                            bool(self._ep_success[i]), succ))
                if self.auto_reset:
                    new_obs, _ = self.envs[i].reset()
                    self._write_obs(i, new_obs)
                    self._ep_return[i] = 0.0
                    self._ep_len[i] = 0
                    self._ep_success[i] = False
                else:
                    self._done[i] = True
        obs = self._gather(ids)
        if final_obs is None:
            final_obs = obs
        else:
            running = ~(terminated | truncated)
            for k, v in final_obs.items():
                v[running] = obs[k][running]
        return StepResult(obs, rewards, terminated, truncated, success, final_obs, episodes)

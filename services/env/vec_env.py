"""The env server's core: ``VecEnv``, ``num_envs`` slots of one simulator backend
(services.env.backends.base.SimBackend, built by services.env.backends.make_sim_backend), with what every simulator
shares done once here: validation and clipping of actions, action chunks executed as sub-steps, seeded and
fixed-initial-state resets, the time limit, auto-reset, final observations of ended rows, instructions, and episode
bookkeeping (return, length, success_once). It implements the vec-env interface (services.env.vec_env_interface).

The simulators' backends, the built-in ``gym`` one included, live in services.env.backends, each in its own module,
named in that package's table (SIM_BACKENDS).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rlfleet.errors import FailedPrecondition, InvalidRequest
from rlfleet.wire import env_contract
from rlfleet.wire.codec import EpisodeStat
from services.env.backends import make_sim_backend
from services.env.backends.base import StepResult


class VecEnv:
    """``num_envs`` slots of one backend, stepped in this process.

    Every call into the simulator runs on one dedicated thread: renderers (EGL/OpenGL contexts) and many
    simulators are bound to the thread that created them, while gRPC serves each call on a pool thread. A backend
    that is bound to no thread (``any_thread``: e.g. PandaPickCube-v0's state env) has its resets, steps and
    expert actions run on the caller's thread instead, one at a time under this vec env's lock: a hand-off to
    the simulator's thread and back cost ~0.2 ms per step call (docs/benchmarks.md).
    """

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        *,
        max_episode_steps: int,
        auto_reset: bool = True,
        ignore_terminations: bool = False,
        init_params: dict | None = None,
        seed: int = 0,
        simulator: str = "gym",
        max_action_chunk: int = 64,
    ):
        if num_envs < 1:
            raise InvalidRequest(f"num_envs must be >= 1, got {num_envs}")
        self.env_id = env_id
        self.simulator = simulator
        self._sim_thread = ThreadPoolExecutor(1, thread_name_prefix="sim")
        self.backend = self._on_sim_thread(make_sim_backend, simulator, env_id, num_envs, init_params)
        self.any_thread = bool(getattr(self.backend, "any_thread", False))  # step on the caller's thread
        self.observation_space = dict(self.backend.observation_space)
        self.action_space = self.backend.action_space
        self.num_reset_states = int(self.backend.num_reset_states)
        self.num_envs = num_envs
        self.max_episode_steps = max_episode_steps
        self.auto_reset = auto_reset
        self.ignore_terminations = ignore_terminations
        self.max_action_chunk = max_action_chunk
        self.contract_version = env_contract.CURRENT  # the env contract version this class implements
        self.base_seed = seed
        self.closed = False
        self._lock = threading.Lock()
        self._act_low = self.action_space.low.astype(np.float32)
        self._act_high = self.action_space.high.astype(np.float32)
        self._obs = {k: np.zeros((num_envs, *s.shape), dtype=s.dtype) for k, s in self.observation_space.items()}
        self._ep_return = np.zeros(num_envs, np.float64)
        self._ep_len = np.zeros(num_envs, np.int64)
        self._ep_success = np.zeros(num_envs, bool)
        self._ep_state = np.full(num_envs, -1, np.int64)
        self._done = np.zeros(num_envs, bool)  # finished and not reset (auto_reset off)
        self._has_reset = np.zeros(num_envs, bool)
        self.instructions = [""] * num_envs

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

    def _check_actions(self, actions: np.ndarray, n: int) -> tuple[np.ndarray, bool]:
        """-> (actions [n, chunk, *A] clipped to the bounds, whether the request carried a chunk)."""
        shape = self.action_space.shape
        chunked = actions.ndim == len(shape) + 2
        if (
            actions.ndim not in (len(shape) + 1, len(shape) + 2)
            or actions.shape[0] != n
            or tuple(actions.shape[(2 if chunked else 1) :]) != shape
        ):
            raise InvalidRequest(
                f"actions: shape {list(actions.shape)} where [{n}, {', '.join(map(str, shape))}] "
                f"or [{n}, chunk, {', '.join(map(str, shape))}] was expected"
            )
        if chunked and not 1 <= actions.shape[1] <= self.max_action_chunk:
            raise InvalidRequest(
                f"actions: chunk of {actions.shape[1]} sub-steps; this server accepts 1..{self.max_action_chunk}"
            )
        if not np.isfinite(actions).all():
            bad = np.argwhere(~np.isfinite(actions))[0]
            where = f"env row {bad[0]}" + (f", sub-step {bad[1]}" if chunked else "") + f", dim {bad[-1]}"
            raise InvalidRequest(f"actions: non-finite value {actions[tuple(bad)]} for {where}")
        a = actions.astype(np.float32, copy=False)
        a = a if chunked else a[:, None]
        return np.clip(a, self._act_low, self._act_high), chunked

    def _check_open(self) -> None:
        if self.closed:
            raise FailedPrecondition("the envs were closed (Close); this server serves no more steps")

    def _gather(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[ids] for k, v in self._obs.items()}

    def _on_sim_thread(self, fn, *args):
        return self._sim_thread.submit(fn, *args).result()

    def _on_stepping_thread(self, fn, *args):
        """A reset, step or expert-action call: on the caller's thread where the backend allows it, else on the
        simulator's (the caller holds ``_lock``: one call at a time either way)."""
        return fn(*args) if self.any_thread else self._on_sim_thread(fn, *args)

    # --- API --------------------------------------------------------------------------------------------------
    def reset(
        self,
        env_ids: Sequence[int] | None = None,
        seeds: Sequence[int] | None = None,
        reset_state_ids: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        with self._lock:
            self._check_open()
            return self._on_stepping_thread(self._reset, env_ids, seeds, reset_state_ids)

    def step(self, env_ids: Sequence[int] | None, actions: np.ndarray) -> StepResult:
        with self._lock:
            self._check_open()
            return self._on_stepping_thread(self._step, env_ids, actions)

    def expert_actions(self, env_ids: Sequence[int] | None = None) -> np.ndarray:
        """The backend's scripted expert actions for the current states of ``env_ids`` (demonstrations)."""
        with self._lock:
            self._check_open()
            ids = self._ids(env_ids)
            return self._on_stepping_thread(self.backend.expert_actions, ids)

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._on_sim_thread(self.backend.close)
                self._sim_thread.shutdown(wait=False)

    def _reset_rows(self, ids: np.ndarray, seeds: list, states: list) -> dict[str, np.ndarray]:
        obs, instructions = self.backend.reset(ids, seeds, states)
        # a fixed state the backend picked itself (seed, own stream); a backend without fixed states picked none
        drawn = self.backend.drawn_state_ids(ids) if self.num_reset_states else [None] * len(ids)
        for j, i in enumerate(ids):
            for k, v in obs.items():
                self._obs[k][i] = v[j]
            self.instructions[i] = instructions[j]
            state = states[j] if states[j] is not None else drawn[j]
            self._ep_state[i] = -1 if state is None else int(state)
        self._has_reset[ids] = True
        self._ep_return[ids] = 0.0
        self._ep_len[ids] = 0
        self._ep_success[ids] = False
        self._done[ids] = False
        return obs

    def _reset(self, env_ids, seeds, reset_state_ids) -> dict[str, np.ndarray]:
        ids = self._ids(env_ids)
        seeds = list(seeds) if seeds is not None else []
        states = list(reset_state_ids) if reset_state_ids is not None else []
        if seeds and len(seeds) != len(ids):
            raise InvalidRequest(f"seeds: {len(seeds)} seeds for {len(ids)} envs")
        bad = [int(s) for s in seeds if not 0 <= int(s) < 2**32 - 1]
        if bad:  # simulators seed numpy generators, which take [0, 2**32)
            raise InvalidRequest(f"seeds: {bad[0]} is not in [0, 2**32 - 1)")
        if states and len(states) != len(ids):
            raise InvalidRequest(f"reset_state_ids: {len(states)} ids for {len(ids)} envs")
        seed_list: list[int | None] = []
        for j, i in enumerate(ids):
            seed = int(seeds[j]) if seeds else None
            if seed is None and not self._has_reset[i]:
                seed = self.base_seed + int(i)
            seed_list.append(seed)
        state_list: list[int | None] = []
        for s in states or [-1] * len(ids):
            s = int(s)
            if s != -1 and not 0 <= s < self.num_reset_states:
                raise InvalidRequest(
                    f"reset_state_ids: state id {s} is not in [0, {self.num_reset_states}) "
                    f"({self.env_id} has {self.num_reset_states} fixed initial states)"
                )
            state_list.append(None if s == -1 else s)
        self._reset_rows(ids, seed_list, state_list)
        return self._gather(ids)

    def _step(self, env_ids, actions) -> StepResult:
        ids = self._ids(env_ids)
        if not self._has_reset[ids].all():
            raise InvalidRequest(f"env_ids: env {int(ids[~self._has_reset[ids]][0])} was never reset")
        chunk_actions, chunked = self._check_actions(np.asarray(actions), len(ids))
        n, chunk = chunk_actions.shape[:2]
        rewards = np.zeros((n, chunk), np.float32)
        terminated = np.zeros((n, chunk), bool)
        truncated = np.zeros((n, chunk), bool)
        success = np.zeros((n, chunk), bool)
        ended = np.zeros(n, bool)
        final_rows: list[int] = []
        final_obs: dict[str, list] = {k: [] for k in self._obs}
        episodes: list[EpisodeStat] = []
        terminated[self._done[ids], 0] = True  # finished, waiting for a reset (auto_reset off): frozen, no reward
        for c in range(chunk):
            live = np.flatnonzero(~ended & ~self._done[ids])
            if live.size == 0:
                break
            rows = ids[live]
            out = self.backend.step(rows, chunk_actions[live, c])
            for k, v in out.obs.items():
                self._obs[k][rows] = v
            self._ep_len[rows] += 1
            self._ep_return[rows] += out.rewards
            self._ep_success[rows] |= out.success
            term = np.zeros(len(rows), bool) if self.ignore_terminations else np.asarray(out.terminated, bool)
            trunc = (np.asarray(out.truncated, bool) | (self._ep_len[rows] >= self.max_episode_steps)) & ~term
            rewards[live, c], terminated[live, c], truncated[live, c], success[live, c] = (
                out.rewards,
                term,
                trunc,
                out.success,
            )
            for j in np.flatnonzero(term | trunc):
                row, i = int(live[j]), int(rows[j])
                ended[row] = True
                final_rows.append(row)
                for k in final_obs:
                    final_obs[k].append(self._obs[k][i].copy())
                episodes.append(
                    EpisodeStat(
                        i,
                        float(self._ep_return[i]),
                        int(self._ep_len[i]),
                        bool(self._ep_success[i]),
                        bool(out.success[j]),
                        int(self._ep_state[i]),
                        self.instructions[i],
                    )
                )
        if final_rows:
            order = np.argsort(final_rows, kind="stable")
            final_rows_arr = np.asarray(final_rows, np.int64)[order]
            final = {k: np.stack(v)[order] for k, v in final_obs.items()}
            ended_ids = ids[final_rows_arr]
            if self.auto_reset:
                self._reset_rows(ended_ids, [None] * len(ended_ids), [None] * len(ended_ids))
            else:
                self._done[ended_ids] = True
        else:
            final_rows_arr = np.zeros(0, np.int64)
            final = {k: np.zeros((0, *v.shape[1:]), v.dtype) for k, v in self._obs.items()}
        if not chunked:
            rewards, terminated, truncated, success = rewards[:, 0], terminated[:, 0], truncated[:, 0], success[:, 0]
        return StepResult(
            self._gather(ids),
            rewards,
            terminated,
            truncated,
            success,
            final,
            final_rows_arr,
            episodes,
            [self.instructions[i] for i in ids],
        )

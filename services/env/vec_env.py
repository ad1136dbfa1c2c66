"""The env server's core: the vec-env interface, ``VecEnv`` and the built-in gymnasium backend. In sections:

- the interface (what the rollout worker and the EnvService use, whoever hosts the envs): ``StepResult``,
  ``VecEnvInterface`` and ``step_chunk``. ``VecEnv`` implements it, as ``services.env.remote.RemoteVecEnv`` does for
  an external simulator, so the rollout worker runs unchanged in front of either. docs/env-contract.md states these
  semantics for implementers.
- ``VecEnv``: ``num_envs`` slots of one simulator backend (services.env.backends.base.SimBackend), with what every
  simulator shares done once here: validation and clipping of actions, action chunks executed as sub-steps, seeded
  and fixed-initial-state resets, the time limit, auto-reset, final observations of ended rows, instructions, and
  episode bookkeeping (return, length, success_once).
- the built-in ``gym`` backend, ``GymBackend``: any gymnasium-registered env id (one Python env per slot), including
  rlfleet's own PandaPickCube-v0 / PandaPickCubeVision-v0 (registered by importing services.env.envs). Box action
  spaces only; Box or Dict-of-Box observations (a bare Box is named 'state'). The instruction is the env's
  ``task_description`` attribute when it has one; success is ``info['success']`` (or ``info['is_success']``).

The optional simulators' backends (Meta-World, LIBERO, ManiSkill3, Behavior) live in services.env.backends, each in
its own module, named in that package's table (SIM_BACKENDS), as ``gym`` is.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
import threading
from typing import Protocol, runtime_checkable

import numpy as np

from rlfleet.v1 import env_pb2
from rlfleet.wire import codec, env_contract
from rlfleet.wire.codec import EpisodeStat
from rlfleet.wire.rpc import FailedPrecondition, InvalidRequest
from rlfleet.wire.spaces import TensorSpace, spaces_from_gym
from services.env.backends.base import SimBackend
from services.env.gym_envs import make_gym_env


# --- the interface (what the rollout worker and the EnvService use, whoever hosts the envs) ---------------------
def _no_rows() -> np.ndarray:
    return np.zeros(0, np.int64)


@dataclass
class StepResult:
    """The result of stepping some envs; rows follow the requested env ids.

    A backend's control step (``SimBackend.step``) fills the first five fields, each ``[n]``; a vec env's step
    fills all of them: per-step arrays are ``[n]``, or ``[n, chunk]`` when the actions carried a chunk of
    sub-steps, ``final_obs`` holds only the rows in ``final_rows`` (positions in the request whose episode
    ended), ``episodes`` one entry per ended episode and ``instructions`` each row's current instruction."""

    obs: dict[str, np.ndarray]
    rewards: np.ndarray     # float32  a backend's: [n]
    terminated: np.ndarray  # bool     the task ended (success or failure) by the simulator's own rule
    truncated: np.ndarray   # bool     a time limit (a backend: its own; VecEnv adds max_episode_steps)
    success: np.ndarray     # bool     the task's own success signal at this step
    final_obs: dict[str, np.ndarray] = field(default_factory=dict)
    final_rows: np.ndarray = field(default_factory=_no_rows)
    episodes: list[EpisodeStat] = field(default_factory=list)
    instructions: list[str] = field(default_factory=list)

    def to_proto(self) -> env_pb2.StepResponse:
        """The StepResponse an EnvService answers with."""
        return env_pb2.StepResponse(
            observations=codec.encode_map(self.obs), rewards=codec.encode(self.rewards),
            terminated=codec.encode(self.terminated), truncated=codec.encode(self.truncated),
            success=codec.encode(self.success), final_observations=codec.encode_map(self.final_obs),
            final_rows=[int(r) for r in self.final_rows], instructions=self.instructions,
            episodes=[codec.episode_to_proto(e) for e in self.episodes])

    @classmethod
    def from_proto(cls, resp: env_pb2.StepResponse, per: list[int], obs_specs, view: env_contract.View, *,
                   instruction_of, record_instructions) -> StepResult:
        """A StepResponse of a server of any contract version (``view``) for ``per`` = [n] or [n, chunk] stepped
        rows. An ended episode without its own instruction takes its env's (``instruction_of(env_id)``) before
        ``record_instructions(texts)`` records the response's and returns each row's current one.
        Raises codec.CodecError naming the field that breaks the contract."""
        n = per[0]
        term = codec.decode(resp.terminated, "terminated", shape=per, dtype=bool)
        trunc = codec.decode(resp.truncated, "truncated", shape=per, dtype=bool)
        rows = env_contract.ended_rows(resp.final_rows, term, trunc, view)
        if any(not 0 <= r < n for r in rows):
            raise codec.CodecError(f"final_rows: {rows.tolist()} names rows outside 0..{n - 1}")
        final = env_contract.decode_final_observations(resp.final_observations, rows, n, obs_specs, writable=True)
        version0 = view.version == "0"  # EpisodeStats had no reset_state_id (its 0 is not state 0)
        return cls(
            codec.decode_map(resp.observations, "observations", specs=obs_specs, batch=n, writable=True),
            codec.decode(resp.rewards, "rewards", shape=per, dtype=np.float32, finite=True),
            term, trunc, codec.decode(resp.success, "success", shape=per, dtype=bool), final, rows,
            [EpisodeStat(e.env_id, codec.episode_return(e), e.length, e.success_once, e.success_at_end,
                         -1 if version0 else e.reset_state_id, e.instruction or instruction_of(e.env_id))
             for e in resp.episodes],  # (before this response's instructions replace the ended episodes')
            record_instructions(resp.instructions))

    def per_row(self) -> StepResult:
        """Chunked per-step arrays ``[n, chunk]`` reduced to one value per row (``chunk_level``): rewards summed,
        success/terminated/truncated if any sub-step had it (a vec env stops a row's chunk at its episode's end).
        Unchunked results are returned as they are."""
        if np.ndim(self.rewards) < 2:
            return self
        self.rewards, self.success = self.rewards.sum(1), self.success.any(1)
        self.terminated, self.truncated = self.terminated.any(1), self.truncated.any(1)
        return self


def step_chunk(env: VecEnvInterface, env_ids: Sequence[int], actions: np.ndarray) -> StepResult:
    """How the rollout worker steps: ``actions`` ``[m, chunk, *A]`` (what the policy answers) -> one result per
    row. A chunk of 1 is sent as a plain step ``[m, *A]`` (every server accepts it, also a version-0 one); a longer
    chunk is sent whole, executed by the env as sub-steps (``VecEnv`` stops a row's chunk at its episode's end), and
    its per-sub-step results reduced to one per row (:meth:`StepResult.per_row`)."""
    m, chunk = actions.shape[:2]
    shape = env.action_space.shape
    if chunk == 1:
        return env.step(env_ids, actions[:, 0].reshape(m, *shape))
    return env.step(env_ids, actions.reshape(m, chunk, *shape)).per_row()


@runtime_checkable
class VecEnvInterface(Protocol):
    """``num_envs`` envs of one simulator, stepped in batches of rows (``env_ids``; empty or None = all)."""

    env_id: str
    simulator: str                          # the registry name ("external" for an external server of version 0)
    num_envs: int
    observation_space: dict[str, TensorSpace]  # per env (no batch dimension)
    action_space: TensorSpace               # per env and control step (no batch, no chunk dimension)
    max_episode_steps: int
    auto_reset: bool
    num_reset_states: int                   # fixed initial states selectable by reset_state_ids (0 = none)
    max_action_chunk: int                   # sub-steps one step may carry
    contract_version: str                   # the env contract version the envs implement
    instructions: list[str]                 # each env's current instruction ('' = none)

    def reset(self, env_ids: Sequence[int] | None = None, seeds: Sequence[int] | None = None,
              reset_state_ids: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """Start new episodes on ``env_ids``; -> their observations."""

    def step(self, env_ids: Sequence[int] | None, actions: np.ndarray) -> StepResult:
        """One step of ``env_ids`` with ``actions`` ``[n, *A]`` or a chunk ``[n, chunk, *A]``."""

    def close(self) -> None:
        """Release the envs (a remote one: this client's stream only)."""


# --- VecEnv: the local implementation -----------------------------------------------------------------------------
def make_backend(simulator: str, env_id: str, num_envs: int, params: dict | None = None):
    """The registered backend (services.env.backends) for ``simulator``, with ``num_envs`` slots."""
    from services.env.backends import backend_class

    try:
        cls = backend_class(simulator)
    except KeyError as exc:
        raise InvalidRequest(str(exc.args[0])) from None
    return cls(env_id, num_envs, **dict(params or {}))


class VecEnv:
    """``num_envs`` slots of one backend, stepped in this process.

    Every call into the simulator runs on one dedicated thread: renderers (EGL/OpenGL contexts) and many
    simulators are bound to the thread that created them, while gRPC serves each call on a pool thread.
    """

    def __init__(self, env_id: str, num_envs: int, *, max_episode_steps: int, auto_reset: bool = True,
                 ignore_terminations: bool = False, init_params: dict | None = None, seed: int = 0,
                 simulator: str = "gym", max_action_chunk: int = 64):
        if num_envs < 1:
            raise InvalidRequest(f"num_envs must be >= 1, got {num_envs}")
        self.env_id = env_id
        self.simulator = simulator
        self._sim_thread = ThreadPoolExecutor(1, thread_name_prefix="sim")
        self.backend = self._on_sim_thread(make_backend, simulator, env_id, num_envs, init_params)
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
        if actions.ndim not in (len(shape) + 1, len(shape) + 2) or actions.shape[0] != n \
                or tuple(actions.shape[(2 if chunked else 1):]) != shape:
            raise InvalidRequest(f"actions: shape {list(actions.shape)} where [{n}, {', '.join(map(str, shape))}] "
                                 f"or [{n}, chunk, {', '.join(map(str, shape))}] was expected")
        if chunked and not 1 <= actions.shape[1] <= self.max_action_chunk:
            raise InvalidRequest(f"actions: chunk of {actions.shape[1]} sub-steps; this server accepts 1.."
                                 f"{self.max_action_chunk}")
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

    # --- API --------------------------------------------------------------------------------------------------
    def reset(self, env_ids: Sequence[int] | None = None, seeds: Sequence[int] | None = None,
              reset_state_ids: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        with self._lock:
            self._check_open()
            return self._on_sim_thread(self._reset, env_ids, seeds, reset_state_ids)

    def step(self, env_ids: Sequence[int] | None, actions: np.ndarray) -> StepResult:
        with self._lock:
            self._check_open()
            return self._on_sim_thread(self._step, env_ids, actions)

    def expert_actions(self, env_ids: Sequence[int] | None = None) -> np.ndarray:
        """The backend's scripted expert actions for the current states of ``env_ids`` (demonstrations)."""
        with self._lock:
            self._check_open()
            ids = self._ids(env_ids)
            return self._on_sim_thread(self.backend.expert_actions, ids)

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
        bad = [int(s) for s in seeds if not 0 <= int(s) < 2 ** 32 - 1]
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
                raise InvalidRequest(f"reset_state_ids: state id {s} is not in [0, {self.num_reset_states}) "
                                     f"({self.env_id} has {self.num_reset_states} fixed initial states)")
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
            rewards[live, c], terminated[live, c], truncated[live, c], success[live, c] = \
                out.rewards, term, trunc, out.success
            for j in np.flatnonzero(term | trunc):
                row, i = int(live[j]), int(rows[j])
                ended[row] = True
                final_rows.append(row)
                for k in final_obs:
                    final_obs[k].append(self._obs[k][i].copy())
                episodes.append(EpisodeStat(i, float(self._ep_return[i]), int(self._ep_len[i]),
                                            bool(self._ep_success[i]), bool(out.success[j]), int(self._ep_state[i]),
                                            self.instructions[i]))
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
        return StepResult(self._gather(ids), rewards, terminated, truncated, success, final, final_rows_arr,
                          episodes, [self.instructions[i] for i in ids])


# --- the built-in backend: gym (any gymnasium id, rlfleet's PandaPickCube included) -----------------------------------
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

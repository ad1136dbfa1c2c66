"""The simulator backend interface: what every simulator (gymnasium ids, Meta-World, ManiSkill3, LIBERO,
Behavior) implements so the env server's ``VecEnv`` can host it.

A backend owns ``num_envs`` simulator instances (one Python env per slot, or one batched GPU simulation) and
knows nothing of episodes' bookkeeping, time limits, auto-reset, action chunks or validation: ``VecEnv`` does
those once for every backend. A backend only

- resets some slots, each by a seed and/or a fixed initial-state id, and returns their observations and
  instruction texts;
- steps some slots by ONE control step with actions that are already validated, finite and clipped to the
  declared bounds, and returns observations, rewards, terminated/truncated flags and the task's own success
  (a :class:`StepResult` with its first five fields).

Its spaces are TensorSpace dicts, set by the backend's constructor as attributes (below).

This module owns the types of the interface: ``StepResult`` is also what a vec env's step answers (with all its
fields), so the vec-env interface (services.env.vec_env_interface), ``VecEnv`` and ``RemoteVecEnv`` import it from
here.

Backends are registered by name in :mod:`rlfleet.simulators` (which also declares the Python environment each
one needs), so adding a simulator touches two files: the backend module and one registry entry.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rlfleet.v1 import env_pb2
from rlfleet.wire import codec, env_contract
from rlfleet.wire.codec import EpisodeStat
from rlfleet.wire.spaces import TensorSpace


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
    rewards: np.ndarray  # float32  a backend's: [n]
    terminated: np.ndarray  # bool     the task ended (success or failure) by the simulator's own rule
    truncated: np.ndarray  # bool     a time limit (a backend: its own; VecEnv adds max_episode_steps)
    success: np.ndarray  # bool     the task's own success signal at this step
    final_obs: dict[str, np.ndarray] = field(default_factory=dict)
    final_rows: np.ndarray = field(default_factory=_no_rows)
    episodes: list[EpisodeStat] = field(default_factory=list)
    instructions: list[str] = field(default_factory=list)

    def to_proto(self) -> env_pb2.StepResponse:
        """The StepResponse an EnvService answers with."""
        return env_pb2.StepResponse(
            observations=codec.encode_map(self.obs),
            rewards=codec.encode(self.rewards),
            terminated=codec.encode(self.terminated),
            truncated=codec.encode(self.truncated),
            success=codec.encode(self.success),
            final_observations=codec.encode_map(self.final_obs),
            final_rows=[int(r) for r in self.final_rows],
            instructions=self.instructions,
            episodes=[codec.episode_to_proto(e) for e in self.episodes],
        )

    @classmethod
    def from_proto(
        cls,
        resp: env_pb2.StepResponse,
        per: list[int],
        obs_specs,
        view: env_contract.View,
        *,
        instruction_of,
        record_instructions,
    ) -> StepResult:
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
            term,
            trunc,
            codec.decode(resp.success, "success", shape=per, dtype=bool),
            final,
            rows,
            [
                EpisodeStat(
                    e.env_id,
                    codec.episode_return(e),
                    e.length,
                    e.success_once,
                    e.success_at_end,
                    -1 if version0 else e.reset_state_id,
                    e.instruction or instruction_of(e.env_id),
                )
                for e in resp.episodes
            ],  # (before this response's instructions replace the ended episodes')
            record_instructions(resp.instructions),
        )

    def per_row(self) -> StepResult:
        """Chunked per-step arrays ``[n, chunk]`` reduced to one value per row (``chunk_level``): rewards summed,
        success/terminated/truncated if any sub-step had it (a vec env stops a row's chunk at its episode's end).
        Unchunked results are returned as they are."""
        if np.ndim(self.rewards) < 2:
            return self
        self.rewards, self.success = self.rewards.sum(1), self.success.any(1)
        self.terminated, self.truncated = self.terminated.any(1), self.truncated.any(1)
        return self


class BackendUnavailable(RuntimeError):
    """The simulator cannot run here (missing package, GPU, Vulkan driver, assets...); the message says what
    is missing and how to get it."""


class SimBackend(abc.ABC):
    """``num_envs`` simulator slots. Calls come one at a time, from one thread (VecEnv's sim thread), or, for a
    backend whose ``any_thread`` is true, its resets, steps and expert actions from whichever thread calls VecEnv.

    The constructor sets ``observation_space`` (per-env entries, no batch dimension), ``action_space`` (per env, no
    batch or chunk dimension), ``max_episode_steps`` (the simulator's or benchmark's episode limit) and
    ``num_reset_states`` (fixed initial states selectable by state id; 0 = none)."""

    #: registry name (see rlfleet.simulators)
    name: str = ""
    observation_space: dict[str, TensorSpace]
    action_space: TensorSpace
    max_episode_steps: int
    num_reset_states: int = 0
    #: resets, steps and expert actions may run on any thread, one call at a time: the slots hold no renderer,
    #: GL/Vulkan context or simulator state bound to the thread that made them (VecEnv then runs those calls on
    #: its caller's thread, without handing each one to its simulator thread and waiting; default: bound)
    any_thread: bool = False

    def __init__(self, env_id: str, num_envs: int, **params):
        self.env_id = env_id
        self.num_envs = num_envs

    @abc.abstractmethod
    def reset(
        self, env_ids: np.ndarray, seeds: Sequence[int | None], state_ids: Sequence[int | None]
    ) -> tuple[dict[str, np.ndarray], list[str]]:
        """Reset the slots ``env_ids``; ``seeds[j]``/``state_ids[j]`` (None = not given) belong to slot
        ``env_ids[j]``. A state id is in [0, num_reset_states). Returns (observations with one row per
        slot in order, the instruction text of each slot's new episode ('' when the task has none))."""

    @abc.abstractmethod
    def step(self, env_ids: np.ndarray, actions: np.ndarray) -> StepResult:
        """One control step of the slots ``env_ids`` with ``actions[j]`` (validated, clipped, float32); -> a
        StepResult of obs, rewards (float32 [n]), terminated, truncated (the simulator's own time limit) and
        success (bool [n]), every array with the requested rows in request order."""

    def drawn_state_ids(self, env_ids: np.ndarray) -> list[int | None]:
        """For each slot, the fixed initial state (in [0, num_reset_states)) its current episode started from
        when the backend drew it itself (a reset without a state id: from the seed or the slot's generator); None
        when the episode did not start from one of them. VecEnv reports it as the episode's reset_state_id."""
        return [None] * len(env_ids)

    def expert_actions(self, env_ids: np.ndarray) -> np.ndarray:
        """A scripted expert's action for each slot's current state ``[n, *action_shape]`` (privileged: it may
        read simulator state the observations do not show). Used to collect demonstrations; a backend without
        an expert says so."""
        raise BackendUnavailable(
            f"{self.name}: '{self.env_id}' has no scripted expert to collect demonstrations "
            f"from (built-in experts: PandaPickCube*, Meta-World tasks)"
        )

    def close(self) -> None:
        """Release the simulators."""

"""The simulator backend interface: what every simulator (gymnasium ids, Meta-World, ManiSkill3, LIBERO,
Behavior) implements so the env server's ``VecEnv`` can host it.

A backend owns ``num_envs`` simulator instances (one Python env per slot, or one batched GPU simulation) and
knows nothing of episodes' bookkeeping, time limits, auto-reset, action chunks or validation: ``VecEnv`` does
those once for every backend. A backend only

- resets some slots, each by a seed and/or a fixed initial-state id, and returns their observations and
  instruction texts;
- steps some slots by ONE control step with actions that are already validated, finite and clipped to the
  declared bounds, and returns observations, rewards, terminated/truncated flags and the task's own success
  (a :class:`services.env.vec_env.StepResult` with its first five fields).

Its spaces are TensorSpace dicts, set by the backend's constructor as attributes (below).

Backends are registered by name in :mod:`rlfleet.simulators` (which also declares the Python environment each
one needs), so adding a simulator touches two files: the backend module and one registry entry.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rlfleet.wire.spaces import TensorSpace

if TYPE_CHECKING:  # services.env.vec_env imports this module (its built-in gym backend is a SimBackend)
    from services.env.vec_env import StepResult


class BackendUnavailable(RuntimeError):
    """The simulator cannot run here (missing package, GPU, Vulkan driver, assets...); the message says what
    is missing and how to get it."""


class SimBackend(abc.ABC):
    """``num_envs`` simulator slots. All calls come from one thread (VecEnv's sim thread).

    The constructor sets ``observation_space`` (per-env entries, no batch dimension), ``action_space`` (per env, no
    batch or chunk dimension), ``max_episode_steps`` (the simulator's or benchmark's episode limit) and
    ``num_reset_states`` (fixed initial states selectable by state id; 0 = none)."""

    #: registry name (see rlfleet.simulators)
    name: str = ""
    observation_space: dict[str, TensorSpace]
    action_space: TensorSpace
    max_episode_steps: int
    num_reset_states: int = 0

    def __init__(self, env_id: str, num_envs: int, **params):
        self.env_id = env_id
        self.num_envs = num_envs

    @abc.abstractmethod
    def reset(self, env_ids: np.ndarray, seeds: Sequence[int | None],
              state_ids: Sequence[int | None]) -> tuple[dict[str, np.ndarray], list[str]]:
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
        raise BackendUnavailable(f"{self.name}: '{self.env_id}' has no scripted expert to collect demonstrations "
                                 f"from (built-in experts: PandaPickCube*, Meta-World tasks)")

    def close(self) -> None:
        """Release the simulators."""

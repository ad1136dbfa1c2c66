"""The simulator backend interface: what every simulator (gymnasium ids, Meta-World, ManiSkill3, LIBERO,
Behavior) implements so the env server's ``VecEnv`` can host it.

A backend owns ``num_envs`` simulator instances (one Python env per slot, or one batched GPU simulation) and
knows nothing of episodes' bookkeeping, time limits, auto-reset, action chunks or validation: ``VecEnv`` does
those once for every backend. A backend only

- resets some slots, each by a seed and/or a fixed initial-state id, and returns their observations and
  instruction texts;
- steps some slots by ONE control step with actions that are already validated, finite and clipped to the
  declared bounds, and returns observations, rewards, terminated/truncated flags and the task's own success.

Backends are registered by name in :mod:`rlfleet.simulators` (which also declares the Python environment each
one needs), so adding a simulator touches two files: the backend module and one registry entry.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlfleet.wire.spaces import TensorSpace


class BackendUnavailable(RuntimeError):
    """The simulator cannot run here (missing package, GPU, Vulkan driver, assets...); the message says what
    is missing and how to get it."""


@dataclass
class BackendSpec:
    observation_space: dict[str, TensorSpace]  # per-env observation entries (no batch dimension)
    action_space: TensorSpace                  # per-env action (no batch, no chunk dimension)
    max_episode_steps: int                     # the simulator's (or benchmark's) episode limit
    num_reset_states: int = 0                  # fixed initial states selectable by reset_state_id (0 = none)


@dataclass
class BackendStep:
    """One control step of the requested slots; every array has the requested rows in request order."""

    obs: dict[str, np.ndarray]
    rewards: np.ndarray     # float32 [n]
    terminated: np.ndarray  # bool [n]  the task ended (success or failure) by the simulator's own rule
    truncated: np.ndarray   # bool [n]  the simulator's own time limit (VecEnv adds max_episode_steps)
    success: np.ndarray     # bool [n]  the task's own success signal at this step


class SimBackend(abc.ABC):
    """``num_envs`` simulator slots. All calls come from one thread (VecEnv's sim thread)."""

    #: registry name (see rlfleet.simulators)
    name: str = ""

    def __init__(self, env_id: str, num_envs: int, **params):
        self.env_id = env_id
        self.num_envs = num_envs

    @property
    @abc.abstractmethod
    def spec(self) -> BackendSpec:
        """Spaces, episode limit and the number of fixed initial states."""

    @abc.abstractmethod
    def reset(self, env_ids: np.ndarray, seeds: Sequence[int | None],
              state_ids: Sequence[int | None]) -> tuple[dict[str, np.ndarray], list[str]]:
        """Reset the slots ``env_ids``; ``seeds[j]``/``state_ids[j]`` (None = not given) belong to slot
        ``env_ids[j]``. A state id is in [0, spec.num_reset_states). Returns (observations with one row per
        slot in order, the instruction text of each slot's new episode ('' when the task has none))."""

    @abc.abstractmethod
    def step(self, env_ids: np.ndarray, actions: np.ndarray) -> BackendStep:
        """One control step of the slots ``env_ids`` with ``actions[j]`` (validated, clipped, float32)."""

    def drawn_state_ids(self, env_ids: np.ndarray) -> list[int | None]:
        """For each slot, the fixed initial state (in [0, spec.num_reset_states)) its current episode started from
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


def stack_obs(rows: list[dict[str, np.ndarray]], space: dict[str, TensorSpace]) -> dict[str, np.ndarray]:
    """Per-slot observation dicts -> batched arrays in the declared dtypes."""
    return {k: np.stack([np.asarray(r[k]) for r in rows]).astype(s.dtype, copy=False) for k, s in space.items()}

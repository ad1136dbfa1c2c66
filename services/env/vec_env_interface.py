"""The vec-env interface: what the rollout worker and the EnvService use, whoever hosts the envs.
``VecEnvInterface`` (``num_envs`` envs of one simulator, stepped in batches of rows) and ``step_chunk`` (how the
rollout worker steps one action chunk). ``services.env.vec_env.VecEnv`` implements it over a simulator backend, as
``services.env.remote.RemoteVecEnv`` does over an external simulator, so the rollout worker runs unchanged in front
of either. A step answers a ``StepResult`` (services.env.backends.base, which owns the type: a backend's control
step answers its first five fields). docs/env-contract.md states these semantics for implementers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from rlfleet.wire.spaces import TensorSpace
from services.env.backends.base import StepResult


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
    simulator: str  # the registry name ("external" for an external server of version 0)
    num_envs: int
    observation_space: dict[str, TensorSpace]  # per env (no batch dimension)
    action_space: TensorSpace  # per env and control step (no batch, no chunk dimension)
    max_episode_steps: int
    auto_reset: bool
    num_reset_states: int  # fixed initial states selectable by reset_state_ids (0 = none)
    max_action_chunk: int  # sub-steps one step may carry
    contract_version: str  # the env contract version the envs implement
    instructions: list[str]  # each env's current instruction ('' = none)

    def reset(
        self,
        env_ids: Sequence[int] | None = None,
        seeds: Sequence[int] | None = None,
        reset_state_ids: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        """Start new episodes on ``env_ids``; -> their observations."""

    def step(self, env_ids: Sequence[int] | None, actions: np.ndarray) -> StepResult:
        """One step of ``env_ids`` with ``actions`` ``[n, *A]`` or a chunk ``[n, chunk, *A]``."""

    def close(self) -> None:
        """Release the envs (a remote one: this client's stream only)."""

"""An env seen in the spaces of the run's policy, for runs whose env servers host different simulators.

When one run's env servers host different simulators (``env.per_server``: e.g. Meta-World on one, LIBERO on
another), the coordinator gives every rollout worker the policy's spaces, the joint spaces of all servers
(:func:`rlfleet.wire.spaces.joint_spaces`). This wrapper makes the worker's env look like those spaces: observations
are zero-padded (1-D entries) or zero-filled (entries this simulator lacks), and actions are cut to this
simulator's own dimensions before they reach it (the policy's extra dimensions are ignored here, as π0 ignores
the padded dimensions of its ``max_action_dim``). Everything else (episodes, rewards, success, instructions,
reset states) passes through unchanged. docs/env-contract.md, "Runs over several simulators", says the same for
implementers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlfleet.errors import InvalidRequest
from rlfleet.wire.spaces import TensorSpace, fit_check, pad_observations
from services.env.backends.base import StepResult
from services.env.vec_env_interface import VecEnvInterface


class PolicySpaceEnv:
    """``env`` (a VecEnvInterface) seen in the policy's spaces; itself a VecEnvInterface. ``env`` keeps its own
    spaces (what Describe reports); everything but the spaces, observations and actions is ``env``'s."""

    def __init__(self, env: VecEnvInterface, observation_space: dict[str, TensorSpace], action_space: TensorSpace):
        fit_check(env.observation_space, env.action_space, observation_space, action_space)  # ValueError: why
        self.env = env
        self.observation_space, self.action_space = dict(observation_space), action_space
        self.own_action_dim = env.action_space.shape[0]

    # --- the wrapped env's description ---------------------------------------------------------------------------
    @property
    def env_id(self) -> str:
        return self.env.env_id

    @property
    def simulator(self) -> str:
        return self.env.simulator

    @property
    def num_envs(self) -> int:
        return self.env.num_envs

    @property
    def max_episode_steps(self) -> int:
        return self.env.max_episode_steps

    @property
    def auto_reset(self) -> bool:
        return self.env.auto_reset

    @property
    def num_reset_states(self) -> int:
        return self.env.num_reset_states

    @property
    def max_action_chunk(self) -> int:
        return self.env.max_action_chunk

    @property
    def contract_version(self) -> str:
        return self.env.contract_version

    @property
    def instructions(self) -> list[str]:
        return self.env.instructions

    # --- stepping in the policy's spaces -------------------------------------------------------------------------
    def pad(self, obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = len(next(iter(obs.values()))) if obs else 0
        return pad_observations(obs, self.observation_space, rows)

    def reset(
        self,
        env_ids: Sequence[int] | None = None,
        seeds: Sequence[int] | None = None,
        reset_state_ids: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        return self.pad(self.env.reset(env_ids, seeds, reset_state_ids))

    def step(self, env_ids: Sequence[int] | None, actions: np.ndarray) -> StepResult:
        actions = np.asarray(actions)
        if actions.shape[-1] != self.action_space.shape[0]:
            raise InvalidRequest(
                f"actions: last dimension {actions.shape[-1]}; the run's policy acts with {self.action_space.shape[0]}"
            )
        out = self.env.step(env_ids, actions[..., : self.own_action_dim])
        out.obs = self.pad(out.obs)
        out.final_obs = pad_observations(out.final_obs, self.observation_space, len(out.final_rows))
        return out

    def close(self) -> None:
        self.env.close()

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

import dataclasses

import numpy as np

from rlfleet.wire.rpc import InvalidRequest
from rlfleet.wire.spaces import TensorSpace, fit_check, pad_observations


class PolicySpaceEnv:
    def __init__(self, env, observation_space: dict[str, TensorSpace], action_space: TensorSpace):
        own = env.space_info()
        fit_check(own.observation_space, own.action_space, observation_space, action_space)  # ValueError: why
        self.env = env
        self.observation_space, self.action_space = dict(observation_space), action_space
        self.own_action_dim = own.action_space.shape[0]

    def __getattr__(self, name):  # num_envs, max_episode_steps, reconnect, expert_actions, ...
        return getattr(self.env, name)

    def space_info(self):
        return dataclasses.replace(self.env.space_info(), observation_space=dict(self.observation_space),
                                   action_space=self.action_space)

    def pad(self, obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = len(next(iter(obs.values()))) if obs else 0
        return pad_observations(obs, self.observation_space, rows)

    def reset(self, env_ids=None, seeds=None, reset_state_ids=None) -> dict[str, np.ndarray]:
        return self.pad(self.env.reset(env_ids, seeds, reset_state_ids))

    def step(self, env_ids, actions: np.ndarray):
        actions = np.asarray(actions)
        if actions.shape[-1] != self.action_space.shape[0]:
            raise InvalidRequest(f"actions: last dimension {actions.shape[-1]}; the run's policy acts with "
                                 f"{self.action_space.shape[0]}")
        out = self.env.step(env_ids, actions[..., :self.own_action_dim])
        out.obs = self.pad(out.obs)
        out.final_obs = pad_observations(out.final_obs, self.observation_space, len(out.final_rows))
        return out

    def close(self) -> None:
        self.env.close()

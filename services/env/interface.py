"""The vec-env interface: what the rollout worker and the env server's EnvService use, whoever hosts the envs.

Three classes implement :class:`VecEnvInterface`:

- ``services.env.vec_env.VecEnv``: ``num_envs`` slots of a simulator backend (services.env.backends) in this
  process;
- ``services.env.remote.RemoteVecEnv``: an external simulator's EnvService (gRPC), any contract version;
- ``services.env.policy_spaces.PolicySpaceEnv``: either of those seen in the spaces of a run's policy (runs whose
  env servers host different simulators).

One step of any of them, and one control step of a backend, is a :class:`StepResult` (``StepResponse`` on the wire:
:meth:`StepResult.to_proto` and :meth:`StepResult.from_proto`); an ended episode is a
:class:`rlfleet.wire.rollout_schema.EpisodeStat`. Spaces are :class:`rlfleet.wire.spaces.TensorSpace` dicts.
docs/env-contract.md states the semantics for implementers of an external simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from rlfleet.wire import codec, env_contract
from rlfleet.wire.rollout_schema import EpisodeStat
from rlfleet.wire.spaces import TensorSpace
from rlfleet.v1 import env_pb2



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

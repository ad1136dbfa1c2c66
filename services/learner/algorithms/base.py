"""The algorithm seam: what one RL algorithm owns in the learner, behind one interface.

An algorithm (``algorithm.name``, chosen by :func:`services.learner.algorithms.factory.make_algorithm`) owns its data
store, its batch assembly and its update; the learner owns everything around them (the policy and its sharding,
rollout intake and checks, weights publishing, checkpoints, logging, the rank group's commands). Per epoch:

1. rank 0, :meth:`Algorithm.prepare`: the epoch's checked rollouts (algorithm-neutral: observations, actions,
   rewards, terminations and truncations, next and final observations, the acting policy's outputs; see
   rlfleet/wire/codec.py) become what this algorithm trains on (PPO: one batch with advantages; an off-policy
   algorithm: transitions in its replay buffer), split into one set of tensors per rank;
2. every rank, :meth:`Algorithm.update`: the update on its tensors (collectives keep the ranks in step);
3. rank 0, :meth:`Algorithm.after_update` and :meth:`Algorithm.metrics`.

What an algorithm must save to resume exactly is :meth:`leader_state` on rank 0 (PPO: the reward normaliser) and
:meth:`save_rank_files` on every rank (SAC: each rank's share of the replay buffer). Host memory it allocates beside
the policy (a replay buffer) is :meth:`planned_bytes`, counted by the learner's start-up memory check.
docs/adding-an-algorithm.md walks through adding one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlfleet.config.views import LearnerView
from services.learner.group import RankGroup

Critic = Callable[[dict[str, torch.Tensor]], torch.Tensor]  # rows (obs.*, fi.*) -> the policy's values [R]


@dataclass
class Prepared:
    """One epoch's work, as rank 0 prepared it: ``meta`` goes to every rank (JSON), ``shards[r]`` to rank r."""

    meta: dict
    shards: list[dict[str, torch.Tensor]]
    env_steps: int  # env steps the epoch's rollouts hold (a sample of a chunked policy is several)
    data: object = None  # what rank 0 keeps for after_update and metrics (PPO: the Batch)
    stats: dict[str, float] = field(default_factory=dict)  # statistics of the preparation itself


class Algorithm(ABC):
    """One RL algorithm in the learner (one instance per rank)."""

    name: str = ""

    def __init__(self, view: LearnerView, group: RankGroup):
        self.view, self.alg, self.group = view, view.algorithm, group

    @abstractmethod
    def optimizer(self, model) -> torch.optim.Optimizer:
        """The optimizer of ``model``'s trainable parameters (every rank, once, after the policy is built)."""

    @abstractmethod
    def prepare(self, parts: list[dict], workers: list[int], epoch: int, critic: Critic | None) -> Prepared:
        """Rank 0: the committed rollouts of ``workers`` (sorted) -> the epoch's work. ``critic`` evaluates the
        policy's values on rows (a command on every rank; None: the policy has no critic)."""

    @abstractmethod
    def update(self, model, optimizer, meta: dict, rows: dict[str, torch.Tensor], *, version: int, ref_model=None):
        """Every rank: the update on this rank's ``rows`` -> statistics (the same on every rank)."""

    def planned_bytes(self, obs_specs: dict, action_dim: int) -> tuple[int, str]:
        """Host bytes this rank will allocate for the algorithm's own data (beside the policy and the optimizer) and
        the config key that sizes them: the learner's start-up memory check adds them. Default: none."""
        return 0, ""

    def setup(self, obs_specs: dict, action_dim: int) -> None:
        """Every rank, once the policy is built (before a checkpoint is loaded): allocate the algorithm's data."""

    def start(self, model) -> None:
        """Every rank, once the policy is built and restored: start what the update runs beside the learner (PPO:
        the critic's helper process). Default: nothing."""

    def close(self) -> None:
        """The learner is closing: stop what :meth:`start` started."""

    def save_rank_files(self, folder) -> None:
        """Every rank, inside a checkpoint: this rank's own files in ``folder`` (the checkpoint's folder)."""

    def load_rank_files(self, folder) -> None:
        """Every rank, on resume: read back what :meth:`save_rank_files` wrote (checked: a bad file is named)."""

    def after_update(self, model, prepared: Prepared) -> None:
        """Rank 0, after every rank updated (before buffers are broadcast): e.g. move the observation normaliser."""

    def metrics(self, prepared: Prepared, stats: dict[str, float]) -> dict[str, float]:
        """Rank 0: the epoch's metrics from its preparation and the update's statistics."""
        return {**stats, **prepared.stats}

    def leader_state(self) -> dict[str, torch.Tensor]:
        """Rank 0: the algorithm's own state a checkpoint keeps (finite tensors), beside the policy's."""
        return {}

    def load_leader_state(self, state: dict[str, torch.Tensor]) -> None:
        """Rank 0: restore :meth:`leader_state` from a checkpoint."""

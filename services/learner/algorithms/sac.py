"""SAC (``algorithm.name: sac``): off-policy, from a replay buffer of every rollout's transitions.

Per epoch: the epoch's rollouts become transitions (transitions.py: each row's next observation from the rollout
and its tail) offered to every rank's share of the replay buffer (replay.py); once it holds
``algorithm.learning_starts`` of them, the update takes ``algorithm.utd_ratio`` gradient steps per new transition,
each on ``actor.global_batch_size`` rows drawn over the ranks' shares (services/learner/sac.py: twin critics, Polyak
targets, the actor and the temperature every ``algorithm.actor_update_interval`` critic steps). The policy is the
``sac`` family (rlfleet/policies/models/sac.py): what the inference servers act with is its actor.
"""

from __future__ import annotations

import numpy as np
import torch

from rlfleet.errors import FailedPrecondition
from rlfleet.wire.spaces import TensorSpace
from services.learner.algorithms.base import Algorithm, Critic, Prepared
from services.learner.replay import ReplayBuffer
from services.learner.sac import SacUpdate, make_optimizer
from services.learner.transitions import transitions


class SacAlgorithm(Algorithm):
    name = "sac"

    def __init__(self, view, group):
        super().__init__(view, group)
        if view.model.model_type != "sac":
            raise FailedPrecondition(
                f"algorithm.name: sac trains the sac policy family; actor.model.model_type is '{view.model.model_type}'"
            )
        self.buffer: ReplayBuffer | None = None  # made with the first transitions (their spaces)
        self.updater: SacUpdate | None = None
        self.steps = 0  # gradient steps taken (every rank alike)

    def optimizer(self, model) -> torch.optim.Optimizer:
        return make_optimizer(model, self.view.lr)

    def prepare(self, parts, workers, epoch: int, critic: Critic | None) -> Prepared:
        rows = [transitions(p) for p in parts]
        joined = {k: torch.from_numpy(np.concatenate([r[k] for r in rows])) for k in rows[0]}
        new = len(joined["reward"])
        meta = {"epoch": epoch, "new": new}
        env_steps = sum(p["time"]["rewards"].size * p["time"]["actions"].shape[2] for p in parts)
        return Prepared(meta, [joined] * self.group.world, env_steps)

    def _buffer(self, rows: dict[str, torch.Tensor]) -> ReplayBuffer:
        if self.buffer is None:
            specs = {
                k[4:]: TensorSpace(tuple(v.shape[1:]), str(v.numpy().dtype))
                for k, v in rows.items()
                if k.startswith("obs.")
            }
            self.buffer = ReplayBuffer(
                self.alg.replay_capacity,
                specs,
                rows["action"].shape[1],
                seed=self.view.seed,
                rank=self.group.rank,
                world_size=self.group.world,
            )
        return self.buffer

    def update(self, model, optimizer, meta: dict, rows, *, version: int, ref_model=None) -> dict[str, float]:
        buffer = self._buffer(rows)
        buffer.add({k: v.numpy() for k, v in rows.items()})
        if self.updater is None:
            self.updater = SacUpdate(
                model, self.group.all_reduce, optimizer=optimizer, gamma=self.alg.gamma, tau=self.alg.tau
            )
        seen = buffer.seen
        out: dict[str, float] = {"replay/size": float(min(seen, self.alg.replay_capacity))}
        if seen < self.alg.learning_starts:
            return out
        world, batch = self.group.world, self.view.global_batch_size
        n_steps = max(1, int(round(self.alg.utd_ratio * meta["new"])))
        sums: dict[str, float] = {}
        for _ in range(n_steps):
            mine = batch // world + (1 if self.group.rank < batch % world else 0)
            sample = {k: torch.from_numpy(v) for k, v in buffer.sample(mine).items()}
            gen = torch.Generator().manual_seed(self.view.seed * 1_000_003 + self.steps * 1009 + self.group.rank)
            sample["noise"] = torch.randn(mine, buffer.action_dim, generator=gen)
            sample["next_noise"] = torch.randn(mine, buffer.action_dim, generator=gen)
            stats = self.updater.step(sample, batch, update_actor=self.steps % self.alg.actor_update_interval == 0)
            self.steps += 1
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
        out.update({k: v / n_steps for k, v in sums.items()})
        out["train/optimizer_steps"] = float(n_steps)
        stale = version - buffer.data["weights_version"][: len(buffer)].astype(np.int64)
        out["replay/staleness"] = float(stale.mean()) if len(stale) else 0.0
        return out

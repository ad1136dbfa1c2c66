"""SAC (``algorithm.name: sac``): off-policy, from a replay buffer of every rollout's transitions.

Per epoch: the epoch's rollouts become transitions (transitions.py: each row's next observation from the rollout
and its tail) offered to every rank's share of the replay buffer (replay.py); once it holds
``algorithm.learning_starts`` of them, the update takes ``algorithm.utd_ratio`` gradient steps per new transition,
each on ``actor.global_batch_size`` rows drawn over the ranks' shares (services/learner/sac.py: twin critics, Polyak
targets, the actor and the temperature every ``algorithm.actor_update_interval`` critic steps). The policy is the
``sac`` family (rlfleet/policies/models/sac.py): what the inference servers act with is its actor.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from rlfleet.errors import FailedPrecondition
from rlfleet.wire.spaces import TensorSpace
from services.learner.algorithms.base import Algorithm, Critic, Prepared
from services.learner.replay import ReplayBuffer, buffer_bytes
from services.learner.sac import SacUpdate, make_optimizer
from services.learner.transitions import transitions

log = logging.getLogger(__name__)


class SacAlgorithm(Algorithm):
    name = "sac"

    def __init__(self, view, group):
        super().__init__(view, group)
        if view.model.model_type != "sac":
            raise FailedPrecondition(
                f"algorithm.name: sac trains the sac policy family; actor.model.model_type is '{view.model.model_type}'"
            )
        self.buffer: ReplayBuffer | None = None  # allocated by setup (the env's spaces), every rank its share
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
        return Prepared(meta, [joined] * self.group.world, env_steps, data=joined)

    def after_update(self, model, prepared: Prepared) -> None:
        """The observation normaliser (algorithm.normalize_obs) moves over the epoch's new transitions after the
        update (rank 0; the learner then broadcasts the buffers), so the stored raw observations are normalised
        with the newest statistics when they are sampled."""
        obs = {k[4:]: v for k, v in prepared.data.items() if k.startswith("obs.")}
        if len(prepared.data["reward"]):
            model.update_obs_normalizer(obs)

    def _specs(self, obs_specs: dict) -> dict[str, TensorSpace]:
        return {k: TensorSpace(tuple(s.shape), str(np.dtype(s.dtype))) for k, s in obs_specs.items()}

    def planned_bytes(self, obs_specs: dict, action_dim: int) -> tuple[int, str]:
        cap = self.alg.replay_capacity
        need = buffer_bytes(cap, self._specs(obs_specs), action_dim, self.group.world)
        return need, f"algorithm.replay_capacity={cap:,} (the replay buffer)"

    def setup(self, obs_specs: dict, action_dim: int) -> None:
        self.buffer = ReplayBuffer(
            self.alg.replay_capacity,
            self._specs(obs_specs),
            action_dim,
            seed=self.view.seed,
            rank=self.group.rank,
            world_size=self.group.world,
        )

    def save_rank_files(self, folder) -> None:
        path = self.buffer.save(folder, extra={"gradient_steps": self.steps})
        log.info(
            "replay share saved to %s: %d transitions seen, %d kept, digest %s",
            path,
            self.buffer.seen,
            len(self.buffer),
            self.buffer.digest()[:16],
        )

    def load_rank_files(self, folder) -> None:
        from rlfleet.data.checkpoint_files import run_folder_of

        extra = self.buffer.load(folder, root=run_folder_of(folder))
        self.steps = int(extra.get("gradient_steps", 0))
        print(
            f"learner: rank {self.group.rank}'s replay share restored: {self.buffer.seen:,} transitions seen, "
            f"{len(self.buffer):,} kept, digest {self.buffer.digest()[:16]}, {self.steps:,} gradient steps taken",
            flush=True,
        )

    def sample(self, n: int) -> dict[str, np.ndarray]:
        """``n`` rows of this rank's part of a batch (SAC: all from its share of the replay buffer)."""
        return self.buffer.sample(n)

    def update(self, model, optimizer, meta: dict, rows, *, version: int, ref_model=None) -> dict[str, float]:
        buffer = self.buffer
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
            sample = {k: torch.from_numpy(v) for k, v in self.sample(mine).items()}
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

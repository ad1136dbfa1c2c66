"""PPO and GRPO (``algorithm.name: ppo | grpo``): PPO's clipped-ratio update on one epoch's on-policy batch.

The data store is the epoch itself: the rollouts become one batch (batch.py: rewards scaled by the running
normaliser, truncated episodes bootstrapped with the critic on their final observations, advantages by GAE or, with
``adv_type: grpo``, group-relative scores), split across the ranks by env columns; the update (trainer.py) walks
minibatches of it for ``algorithm.update_epoch`` passes; the batch is dropped after the epoch. The observation
normaliser moves after the update, over the whole batch. The reward normaliser is this algorithm's state in a
checkpoint.
"""

from __future__ import annotations

import torch

from rlfleet.errors import FailedPrecondition
from services.learner import ppo as losses
from services.learner.algorithms.base import Algorithm, Critic, Prepared
from services.learner.batch import RewardScaler, build_batch, split_rows
from services.learner.optim import adam
from services.learner.trainer import Trainer


class PpoAlgorithm(Algorithm):
    name = "ppo"

    def __init__(self, view, group):
        super().__init__(view, group)
        self.scaler = RewardScaler(self.alg.gamma)
        self.trainer = Trainer(view, group)

    def optimizer(self, model) -> torch.optim.Optimizer:
        return adam([p for p in model.parameters() if p.requires_grad], lr=self.view.lr, eps=self.view.adam_eps)

    def start(self, model) -> None:
        self.trainer.start(model)

    def close(self) -> None:
        self.trainer.close()

    def _lr(self, epoch: int) -> float:
        lr = self.view.lr
        if self.view.lr_schedule == "linear":
            lr *= max(0.0, 1.0 - (epoch + 1) / self.view.max_epochs)
        return lr

    def prepare(self, parts, workers, epoch: int, critic: Critic | None) -> Prepared:
        batch = build_batch(parts, workers, self.alg, self.scaler, critic, self.view.auto_reset)
        shards = split_rows(batch, self.group.world, self.alg.group_size if self.alg.adv_type == "grpo" else 1)
        meta = {
            "epoch": epoch,
            "total": batch.T * batch.N,
            "use_mask": batch.use_mask,
            "lr": self._lr(epoch),
            "critic_only": epoch < self.alg.critic_warmup_epochs,
            "trains": bool((batch.rows["mask"] > 0).any()),  # no sample trains (all masked): no step
        }
        chunk = parts[0]["time"]["actions"].shape[2]
        return Prepared(meta, shards, batch.T * batch.N * chunk, batch, dict(batch.stats))

    def update(self, model, optimizer, meta: dict, rows, *, version: int, ref_model=None) -> dict[str, float]:
        if not meta["trains"]:
            return {}
        self.trainer.version = version
        return self.trainer.update(
            model,
            optimizer,
            rows,
            total=meta["total"],
            epoch=meta["epoch"],
            lr=meta["lr"],
            use_mask=meta["use_mask"],
            critic_only=meta["critic_only"],
            ref_model=ref_model,
        )

    def after_update(self, model, prepared: Prepared) -> None:
        """The observation normaliser moves only after the update, so old log-probs stay consistent within it:
        rank 0 moves it over the whole batch (the learner then broadcasts the buffers)."""
        batch = prepared.data
        device = next(model.parameters()).device
        obs = {k[4:]: v.to(device) for k, v in batch.rows.items() if k.startswith("obs.")}
        keep = (batch.rows["mask"] > 0).to(device)
        if bool(keep.any()):  # no sample trains (all masked): statistics of no rows would be NaN
            model.update_obs_normalizer({k: v[keep] for k, v in obs.items()} if batch.use_mask else obs)

    def metrics(self, prepared: Prepared, stats: dict[str, float]) -> dict[str, float]:
        batch = prepared.data
        m = super().metrics(prepared, stats)
        m["rollout/rewards"] = float(batch.raw_rewards.mean())
        for name, x in (("advantages", batch.advantages), ("returns", batch.returns)):
            m[f"rollout/{name}_mean"] = float(x.mean())
            m[f"rollout/{name}_max"] = float(x.max())
            m[f"rollout/{name}_min"] = float(x.min())
        if self.alg.loss_type == "actor_critic":
            m["train/critic/explained_variance"] = losses.explained_variance(
                batch.values.flatten(), batch.returns.flatten()
            )
        return m

    def leader_state(self) -> dict[str, torch.Tensor]:
        return self.scaler.state_dict()

    def load_leader_state(self, state: dict[str, torch.Tensor]) -> None:
        if not {"mean", "var", "count"} <= set(state):
            raise FailedPrecondition(
                "runner.resume_dir: the checkpoint's reward_rms.safetensors holds no reward normaliser (saved by an "
                f"algorithm without one, not {self.alg.name}?)"
            )
        self.scaler.load_state_dict(state)

"""Learner: the learner service's core (no gRPC). Collects committed rollouts, trains PPO, publishes weights,
checkpoints (safetensors weights + optimizer state) and logs RLinf-named metrics.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlfleet import tracing
from rlfleet.codec import episode_return
from rlfleet.metrics import MetricsLogger
from rlfleet.models import ObsSpec, RunningMeanStd, build_policy
from rlfleet.rpc import FailedPrecondition, InvalidRequest
from services.learner import grpo, ppo

log = logging.getLogger("rlfleet.learner")

REQUIRED = ("actions", "log_probs", "values", "rewards", "terminated", "truncated", "bootstrap_values", "loss_mask")
ROLLOUT_DTYPES = {"actions": np.float32, "log_probs": np.float32, "values": np.float32, "rewards": np.float32,
                  "bootstrap_values": np.float32, "terminated": np.bool_, "truncated": np.bool_, "loss_mask": np.bool_,
                  "weights_version": np.int64}  # optional: the weights version each sample was acted with


def latest_checkpoint(run_dir: str | pathlib.Path) -> pathlib.Path | None:
    ckpts = sorted((pathlib.Path(run_dir) / "checkpoints").glob("global_step_*"),
                   key=lambda p: int(p.name.rsplit("_", 1)[1]))
    ckpts = [p for p in ckpts if (p / "learner_state.json").exists()]
    return ckpts[-1] if ckpts else None


def update_threads(cfg) -> int:
    """Torch threads of the update (cluster.learner_num_threads; null: in sync mode nothing else runs while the
    learner trains, so it takes every core this process may use; in async mode the envs are collecting beside it)."""
    if cfg.cluster.learner_num_threads is not None:
        return int(cfg.cluster.learner_num_threads)
    if cfg.algorithm.max_staleness > 0:
        return max(1, int(cfg.cluster.torch_num_threads))
    return max(1, len(os.sched_getaffinity(0)))


class Learner:
    def __init__(self, cfg, run_dir: str | pathlib.Path, device: str = "cpu"):
        self.cfg = cfg
        self.alg = cfg.algorithm
        self.run_dir = pathlib.Path(run_dir)
        self.device = torch.device(device)
        self.model: ActorCritic | None = None
        self.ref_model: ActorCritic | None = None  # algorithm.kl_beta > 0 without LoRA: a frozen copy of the start
        self.optimizer: torch.optim.Optimizer | None = None
        self.obs_specs: dict[str, ObsSpec] | None = None
        self.action_dim: int | None = None
        self.epoch = -1          # last trained epoch
        self.version = 0         # weights version (number of updates applied)
        self.env_steps = 0
        self.elapsed_s = 0.0     # training wall time, as measured by the coordinator (restored on resume)
        self.last_checkpoint = ""
        self.publish_error = ""
        self.last_sync_bytes = 0  # bytes of the last weight update per inference server
        self.reward_rms = RunningMeanStd(())
        self._returns: dict[int, np.ndarray] = {}   # per worker: running discounted return per env
        self.pending: dict[tuple[int, int], dict] = {}
        self.pending_lock = threading.Lock()  # async mode: rollouts of epoch k+1 arrive while epoch k trains
        self.logger = MetricsLogger(self.run_dir, tuple(cfg.runner.logger.logger_backends))
        self.update_threads = update_threads(cfg)

    # --- model ----------------------------------------------------------------------------------------------
    def setup(self, obs_specs: dict[str, ObsSpec], action_dim: int) -> None:
        """Build the policy for the env's spaces (once); restore the last checkpoint when resuming."""
        if self.model is not None:
            if obs_specs != self.obs_specs or action_dim != self.action_dim:
                raise InvalidRequest(f"env_spec: spaces {obs_specs}/{action_dim} differ from the policy's "
                                     f"{self.obs_specs}/{self.action_dim}")
            return
        torch.manual_seed(self.cfg.runner.seed)
        self.obs_specs, self.action_dim = dict(obs_specs), action_dim
        self.model = build_policy(self.cfg.actor.model, obs_specs, action_dim, self.alg.normalize_obs,
                                  self.alg.logprob_type).to(self.device)
        self.optimizer = torch.optim.Adam([p for p in self.model.parameters() if p.requires_grad],
                                          lr=self.cfg.actor.optim.lr,
                                          eps=self.cfg.actor.optim.adam_eps)
        # the KL reference is the model as built (model_path: the SFT base), also on resume: with LoRA the base
        # itself with the adapters off, else a frozen copy
        if self.alg.kl_beta > 0 and not self.model.trains_adapters_only:
            self.ref_model = copy.deepcopy(self.model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        if self.cfg.runner.resume_dir:
            ckpt = latest_checkpoint(self.cfg.runner.resume_dir)
            if ckpt is None:
                raise FailedPrecondition(f"runner.resume_dir: no checkpoint in {self.cfg.runner.resume_dir}/checkpoints")
            self.load_checkpoint(ckpt)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def sync_state_dict(self) -> dict[str, torch.Tensor]:
        """What changed since the first full set (the policy's trainable tensors and running statistics)."""
        return {k: v.detach().cpu() for k, v in self.model.sync_state_dict().items()}

    # --- rollouts -------------------------------------------------------------------------------------------
    def check_rollout_epoch(self, epoch: int) -> None:
        """Rollouts are accepted for the next epochs only (the one being trained and those the envs may collect
        ahead of it, algorithm.max_staleness): nothing piles up for far-off ones."""
        ahead = max(2, self.alg.max_staleness + 1)
        if not self.epoch < epoch <= self.epoch + ahead:
            raise InvalidRequest(f"epoch: a rollout for epoch {epoch}; this learner trained epoch {self.epoch} and "
                                 f"accepts epochs {self.epoch + 1}..{self.epoch + ahead}")

    def receive(self, epoch: int, worker: int, time_major: dict[str, np.ndarray], per_env: dict[str, np.ndarray],
                episodes: list) -> tuple[int, int]:
        """Validate and store one worker's complete rollout for ``epoch`` (replaces an earlier one)."""
        if self.model is None:
            raise FailedPrecondition("the learner has no policy yet (PublishWeights with the env spec first)")
        self.check_rollout_epoch(epoch)
        missing = [k for k in REQUIRED if k not in time_major]
        missing += [f"obs.{k}" for k in self.obs_specs if f"obs.{k}" not in time_major]
        if missing or "last_values" not in per_env:
            raise InvalidRequest(f"rollout: missing tensors {missing or ['last_values']}")
        if time_major["rewards"].ndim != 2:
            raise InvalidRequest(f"rollout['rewards']: shape {list(time_major['rewards'].shape)} where [T, N] was expected")
        T, N = time_major["rewards"].shape
        if T < 1 or N < 1:
            raise InvalidRequest(f"rollout: {T} time steps x {N} envs; a rollout needs at least one of each")
        for k, want in ROLLOUT_DTYPES.items():
            if k in time_major and time_major[k].dtype != want:
                raise InvalidRequest(f"rollout['{k}']: dtype {time_major[k].dtype.name} where {np.dtype(want).name} "
                                     f"was expected")
        for k, v in time_major.items():
            if v.shape[:2] != (T, N):
                raise InvalidRequest(f"rollout['{k}']: leading shape {list(v.shape[:2])} differs from rewards' {[T, N]}")
            if v.dtype.kind == "f" and not np.isfinite(v).all():
                raise InvalidRequest(f"rollout['{k}']: non-finite values")
        chunk = self.model.num_action_chunks
        if time_major["actions"].shape[2:] != (chunk, self.action_dim):
            raise InvalidRequest(f"rollout['actions']: shape {list(time_major['actions'].shape)} where "
                                 f"[{T}, {N}, {chunk}, {self.action_dim}] was expected")
        L = self.model.log_prob_width
        if time_major["log_probs"].shape[2:] != (L,):
            raise InvalidRequest(f"rollout['log_probs']: shape {list(time_major['log_probs'].shape)} where "
                                 f"[{T}, {N}, {L}] was expected ({self.alg.logprob_type})")
        if not any(k.startswith("fi.") for k in time_major):
            raise InvalidRequest("rollout: no forward inputs (fi.*): the learner cannot recompute log-probs")
        for k, spec in self.obs_specs.items():
            arr = time_major[f"obs.{k}"]
            if arr.shape[2:] != spec.shape or arr.dtype.name != spec.dtype:
                raise InvalidRequest(f"rollout['obs.{k}']: {arr.dtype.name} {list(arr.shape)} where {spec.dtype} "
                                     f"[{T}, {N}, *{list(spec.shape)}] was expected")
        if per_env["last_values"].dtype != np.float32 or not np.isfinite(per_env["last_values"]).all():
            raise InvalidRequest("rollout['last_values']: must be finite float32")
        if per_env["last_values"].shape != (N,):
            raise InvalidRequest(f"rollout['last_values']: shape {list(per_env['last_values'].shape)} where [{N}] was expected")
        with self.pending_lock:
            self.pending[(epoch, worker)] = {"time": time_major, "env": per_env, "episodes": episodes}
        return T, N

    # --- training -------------------------------------------------------------------------------------------
    def _normalized_rewards(self, worker: int, rewards: np.ndarray, dones: np.ndarray) -> np.ndarray:
        if not self.alg.normalize_rewards:
            return rewards
        ret = self._returns.setdefault(worker, np.zeros(rewards.shape[1]))
        if ret.shape[0] != rewards.shape[1]:
            ret = self._returns[worker] = np.zeros(rewards.shape[1])
        history = np.empty_like(rewards, dtype=np.float64)
        for t in range(rewards.shape[0]):
            ret[:] = ret * self.alg.gamma + rewards[t]
            history[t] = ret
            ret[dones[t]] = 0.0
        self.reward_rms.update(torch.from_numpy(history))
        return (rewards / np.sqrt(self.reward_rms.var.item() + 1e-8)).astype(np.float32)

    def train(self, epoch: int, workers: list[int], extra_metrics: dict[str, float] | None = None,
              publish: Callable[[int], None] | None = None) -> dict[str, float]:
        """One PPO update on the rollouts of ``epoch`` from ``workers``; then publish, checkpoint, log."""
        if self.model is None:
            raise FailedPrecondition("the learner has no policy yet")
        if epoch != self.epoch + 1:
            raise InvalidRequest(f"epoch: {epoch} is not the next epoch (last trained: {self.epoch})")
        with self.pending_lock:
            absent = [w for w in workers if (epoch, w) not in self.pending]
            if absent or not workers:
                raise FailedPrecondition(f"epoch {epoch}: no committed rollout from worker(s) {absent or workers}")
            parts = [self.pending.pop((epoch, w)) for w in sorted(workers)]
            self.pending = {k: v for k, v in self.pending.items() if k[0] > epoch}  # drop stale leftovers
        t0 = time.perf_counter()
        alg, cfg = self.alg, self.cfg
        episodes = [e for p in parts for e in p["episodes"]]

        def cat(key):
            return np.concatenate([p["time"][key] for p in parts], axis=1)

        raw_rewards = cat("rewards")
        dones = cat("terminated") | cat("truncated")
        tt = lambda a: torch.as_tensor(a, device=self.device)  # noqa: E731
        values = tt(cat("values"))
        loss_mask = tt(cat("loss_mask").astype(np.float32))
        adv_stats: dict[str, float] = {}
        if alg.adv_type == "grpo":  # group-relative scores of whole episodes; no critic, no reward normalisation
            fr = tuple(alg.filter_rewards) if alg.filter_rewards is not None else None
            advantages, loss_mask, adv_stats = grpo.grpo_advantages(
                tt(raw_rewards * alg.reward_coef), loss_mask, alg.group_size, filter_range=fr)
            returns = advantages
        else:
            rewards = np.concatenate([self._normalized_rewards(w, p["time"]["rewards"],
                                                               p["time"]["terminated"] | p["time"]["truncated"])
                                      for w, p in zip(sorted(workers), parts)], axis=1)
            if alg.bootstrap_truncated:
                rewards = rewards + alg.gamma * cat("bootstrap_values")
            last_values = tt(np.concatenate([p["env"]["last_values"] for p in parts]))
            advantages, returns = ppo.compute_gae(tt(rewards), values, tt(dones.astype(np.float32)), last_values,
                                                  alg.gamma, alg.gae_lambda)
        T, N = raw_rewards.shape
        flat = lambda x: x.reshape(T * N, *x.shape[2:])  # noqa: E731
        obs = {k: flat(tt(cat(f"obs.{k}"))) for k in self.obs_specs}
        forward_inputs = {k[3:]: flat(tt(cat(k))) for k in parts[0]["time"] if k.startswith("fi.")}
        batch = {"old_log_probs": flat(tt(cat("log_probs"))),
                 "old_values": flat(values), "advantages": flat(advantages), "returns": flat(returns),
                 "mask": flat(loss_mask)}
        use_mask = not bool(batch["mask"].all())
        if all("weights_version" in p["time"] for p in parts):
            # samples algorithm.decoupled_staleness or more versions old: PPO's ratio against the current
            # (proximal) policy, weighted by the truncated importance weight proximal / behaviour (decoupled PPO);
            # fresher samples keep the ratio against their behaviour log-probs
            stale = self.version - flat(tt(cat("weights_version")))
            adv_stats.update(self._decouple_stale(obs, forward_inputs, batch, stale >= alg.decoupled_staleness))
        if alg.kl_beta > 0:
            batch["ref_log_probs"] = self.reference_log_probs(obs, forward_inputs)  # algorithm.kl_beta
        threads = torch.get_num_threads()
        torch.set_num_threads(self.update_threads)
        try:
            warmup = epoch < alg.critic_warmup_epochs  # only the critic trains (algorithm.critic_warmup_epochs)
            with tracing.span("ppo_update", **{"rlfleet.epoch": epoch, "rlfleet.samples": int(T * N)}):
                stats = self._update(obs, forward_inputs, batch, use_mask, warmup) if batch["mask"].any() else {}
        finally:
            torch.set_num_threads(threads)
        stats.update(adv_stats)
        # the observation normaliser moves only after the update, so old log-probs stay consistent within it
        self.model.update_obs_normalizer({k: v[batch["mask"] > 0] for k, v in obs.items()} if use_mask else obs)
        self.epoch, self.version = epoch, self.version + 1
        self.env_steps += T * N * self.model.num_action_chunks  # a sample is one action chunk
        train_time = time.perf_counter() - t0
        tracing.record("rlfleet.learner.train_time", train_time, "s", "one PPO/GRPO update")
        t1 = time.perf_counter()
        self.publish_error = ""
        if publish is not None:
            try:
                with tracing.span("publish_weights", **{"rlfleet.weights_version": self.version}):
                    publish(self.version)
            except Exception as exc:  # noqa: BLE001 - the update stands; the coordinator republishes
                self.publish_error = str(exc)
                log.warning("publishing weights version %d failed: %s", self.version, exc)
        metrics = self._metrics(episodes, raw_rewards, advantages, returns, values, stats)
        metrics.update({"time/train": train_time, "time/weight_sync": time.perf_counter() - t1,
                        "train/weight_sync_bytes": float(self.last_sync_bytes),
                        "env/env_steps": float(self.env_steps), "train/weights_version": float(self.version),
                        })
        metrics.update(extra_metrics or {})
        self.elapsed_s = metrics.get("time/elapsed", self.elapsed_s)
        if (epoch + 1) % cfg.runner.save_interval == 0:
            self.save_checkpoint()
        self.logger.log(epoch + 1, metrics)
        return metrics

    @torch.no_grad()
    def _decouple_stale(self, obs: dict[str, torch.Tensor], forward_inputs: dict[str, torch.Tensor],
                        batch: dict[str, torch.Tensor], stale: torch.Tensor) -> dict[str, float]:
        """For the ``stale`` rows, replace the behaviour log-probs by the current policy's and put the truncated
        importance weight min(pi_current / pi_behaviour, algorithm.importance_weight_cap) in batch['is_weights']."""
        out = {"rollout/stale_fraction": float(stale.float().mean())}  # the fraction trained decoupled
        if not bool(stale.any()):
            return out
        rows = torch.nonzero(stale).squeeze(1)
        prox = self._log_probs(self.model, obs, forward_inputs, rows)
        behaviour = batch["old_log_probs"][rows]
        cap = self.alg.importance_weight_cap
        raw = (prox - behaviour).exp()
        weights = torch.ones_like(batch["old_log_probs"])
        weights[rows] = raw.clamp(max=cap)
        batch["old_log_probs"] = batch["old_log_probs"].index_put((rows,), prox)
        batch["is_weights"] = weights
        out.update({"train/actor/is_weight_mean": float(raw.mean()),
                    "train/actor/is_weight_truncated": float((raw > cap).float().mean())})
        return out

    @torch.no_grad()
    def _log_probs(self, model, obs: dict[str, torch.Tensor], forward_inputs: dict[str, torch.Tensor],
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """``model``'s log-probs of the sampled actions of ``rows`` (all rows: None), in micro-batches, no grad."""
        if rows is None:
            rows = torch.arange(next(iter(forward_inputs.values())).shape[0], device=self.device)
        with self.model.precision():
            return torch.cat([model.evaluate({k: v[idx] for k, v in obs.items()},
                                             {k: v[idx] for k, v in forward_inputs.items()}).log_probs.float()
                              for idx in rows.split(self.cfg.actor.micro_batch_size)])

    def reference_log_probs(self, obs: dict[str, torch.Tensor], forward_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The KL reference's log-probs of the sampled actions (algorithm.kl_beta): the frozen starting copy, or
        with LoRA the policy with its adapters off (the same model, without a second copy of the weights)."""
        if self.ref_model is not None:
            return self._log_probs(self.ref_model, obs, forward_inputs)
        with self.model.adapters_disabled():
            return self._log_probs(self.model, obs, forward_inputs)

    def _lr(self) -> float:
        lr = self.cfg.actor.optim.lr
        if self.cfg.actor.optim.lr_schedule == "linear":
            lr *= max(0.0, 1.0 - (self.epoch + 1) / self.cfg.runner.max_epochs)
        return lr

    def _update(self, obs: dict[str, torch.Tensor], forward_inputs: dict[str, torch.Tensor],
                batch: dict[str, torch.Tensor], use_mask: bool, critic_only: bool = False) -> dict:
        """Minibatch PPO/GRPO steps; ``critic_only`` (critic warm-up): the loss is the value loss alone and only
        the critic's own modules step (the actor, and any backbone it shares with the critic, hold still)."""
        alg, actor = self.alg, self.cfg.actor
        critic = {id(p) for p in self.model.critic_parameters()} if critic_only else set()
        if critic_only and not critic:
            raise FailedPrecondition("algorithm.critic_warmup_epochs: the policy has no critic modules to warm up")
        total = batch["old_log_probs"].shape[0]
        micro, global_bs = actor.micro_batch_size, actor.global_batch_size
        lr = self._lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        sums: dict[str, float] = {}
        count = 0
        stop = False
        for _ in range(alg.update_epoch):
            perm = torch.randperm(total, device=self.device)
            for start in range(0, total, global_bs):
                idx_global = perm[start:start + global_bs]
                self.optimizer.zero_grad(set_to_none=True)
                n_micro = max(1, len(idx_global) // micro)
                step_stats: dict[str, float] = {}
                for m in range(n_micro):
                    idx = idx_global[m * micro:(m + 1) * micro]
                    mask = batch["mask"][idx] if use_mask else None
                    adv = batch["advantages"][idx]
                    if alg.normalize_advantages:
                        mu = ppo.masked_mean(adv, mask)
                        sd = ppo.masked_mean((adv - mu) ** 2, mask).sqrt()
                        adv = (adv - mu) / (sd + 1e-8)
                    with self.model.precision():
                        ev = self.model.evaluate({k: v[idx] for k, v in obs.items()},
                                                 {k: v[idx] for k, v in forward_inputs.items()})
                    log_probs, entropy = ev.log_probs.float(), ev.entropy.float()
                    values = None if ev.values is None else ev.values.float()
                    if count == 0 and m == 0:  # before any step: recomputed vs the behaviour policy's log-probs
                        sums["train/actor/first_logprob_abs_diff"] = float(
                            (log_probs.detach() - batch["old_log_probs"][idx]).abs().max())
                    # one ratio per log-prob (token/action/chunk level); the row's advantage and mask apply to each
                    width = log_probs.shape[1]
                    pg_loss, pg_stats = ppo.policy_loss(
                        log_probs, batch["old_log_probs"][idx], adv[:, None].expand(-1, width),
                        clip_ratio_low=alg.clip_ratio_low, clip_ratio_high=alg.clip_ratio_high,
                        clip_ratio_c=alg.clip_ratio_c, mask=None if mask is None else mask[:, None].expand(-1, width),
                        weights=batch["is_weights"][idx] if "is_weights" in batch else None)
                    if values is not None and alg.loss_type == "actor_critic":
                        v_loss, v_clip_ratio = ppo.value_loss(
                            values, batch["old_values"][idx], batch["returns"][idx], value_clip=alg.value_clip,
                            huber_delta=alg.huber_delta, mask=mask)
                    else:  # no critic (GRPO)
                        v_loss = v_clip_ratio = torch.zeros((), device=log_probs.device)
                    ent = ppo.masked_mean(entropy, mask)
                    loss = pg_loss + alg.value_loss_coef * v_loss - alg.entropy_bonus * ent
                    if "ref_log_probs" in batch:  # KL penalty to the reference policy (algorithm.kl_beta)
                        kl = ppo.masked_mean(ppo.kl_penalty(log_probs, batch["ref_log_probs"][idx], alg.kl_penalty),
                                             None if mask is None else mask[:, None].expand(-1, width))
                        loss = loss + alg.kl_beta * kl
                        step_stats["train/actor/kl_loss"] = step_stats.get("train/actor/kl_loss", 0.0) + \
                            float(kl.detach()) / n_micro
                    ((alg.value_loss_coef * v_loss if critic_only else loss) / n_micro).backward()
                    for k, v in {"train/actor/policy_loss": pg_loss, "train/critic/value_loss": v_loss,
                                 "train/actor/entropy_loss": ent, "train/loss": loss,
                                 "train/critic/value_clip_ratio": v_clip_ratio,
                                 **{f"train/actor/{k2}": v2 for k2, v2 in pg_stats.items()}}.items():
                        step_stats[k] = step_stats.get(k, 0.0) + float(v.detach()) / n_micro
                if critic_only:  # no step for anything but the critic's own modules
                    for p in self.model.parameters():
                        if id(p) not in critic:
                            p.grad = None
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    [p for p in self.model.parameters() if p.grad is not None], alg.max_grad_norm)
                self.optimizer.step()
                step_stats["train/actor/grad_norm"] = float(grad_norm)
                for k, v in step_stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
                if alg.target_kl is not None and step_stats["train/actor/approx_kl"] > alg.target_kl:
                    stop = True
                    break
            if stop:
                break
        first_diff = sums.pop("train/actor/first_logprob_abs_diff", float("nan"))
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out["train/actor/first_logprob_abs_diff"] = first_diff
        out["train/actor/lr"] = lr
        out["train/optimizer_steps"] = float(count)
        out["train/critic_warmup"] = float(critic_only)
        if hasattr(self.model, "log_std"):
            out["train/actor/log_std"] = float(self.model.log_std.detach().mean())
        return out

    def _metrics(self, episodes, raw_rewards, advantages, returns, values, stats) -> dict[str, float]:
        m: dict[str, float] = dict(stats)
        m["env/reward"] = float(raw_rewards.mean())
        m["env/num_episodes"] = float(len(episodes))
        if episodes:
            m["env/success_once"] = float(np.mean([e.success_once for e in episodes]))
            m["env/success_at_end"] = float(np.mean([e.success_at_end for e in episodes]))
            m["env/return"] = float(np.mean([episode_return(e) for e in episodes]))
            m["env/episode_len"] = float(np.mean([e.length for e in episodes]))
        m["rollout/rewards"] = float(raw_rewards.mean())
        for name, x in (("advantages", advantages), ("returns", returns)):
            m[f"rollout/{name}_mean"] = float(x.mean())
            m[f"rollout/{name}_max"] = float(x.max())
            m[f"rollout/{name}_min"] = float(x.min())
        if self.alg.loss_type == "actor_critic":
            m["train/critic/explained_variance"] = ppo.explained_variance(values.flatten(), returns.flatten())
        return m

    def elapsed(self) -> float:
        return self.elapsed_s

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logger.log(step, metrics)

    # --- checkpoints ------------------------------------------------------------------------------------------
    def _non_finite_state(self) -> str | None:
        """The first non-finite tensor of what a checkpoint would hold, or None."""
        for name, t in {**self.state_dict(), **{f"reward_rms.{k}": v for k, v in self.reward_rms.state_dict().items()}}.items():
            if t.is_floating_point() and not torch.isfinite(t).all():
                return name
        return None

    def save_checkpoint(self) -> pathlib.Path:
        bad = self._non_finite_state()
        if bad is not None:  # never overwrite a good checkpoint with a broken state
            raise FailedPrecondition(f"not saving a checkpoint: '{bad}' holds non-finite values (last good "
                                     f"checkpoint: {self.last_checkpoint or 'none'})")
        path = self.run_dir / "checkpoints" / f"global_step_{self.epoch + 1}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path / "model.safetensors"))
        reward_state = {k: v.contiguous() for k, v in self.reward_rms.state_dict().items()}
        reward_state.update({f"returns.{w}": torch.from_numpy(r.copy()) for w, r in self._returns.items()})
        save_file(reward_state, str(path / "reward_rms.safetensors"))
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        state = {"epoch": self.epoch, "weights_version": self.version, "env_steps": self.env_steps,
                 "elapsed_s": self.elapsed(), "action_dim": self.action_dim,
                 "obs_specs": {k: [list(s.shape), s.dtype] for k, s in self.obs_specs.items()}}
        # written last: its presence marks the checkpoint complete
        (path / "learner_state.json").write_text(json.dumps(state, indent=1))
        self.last_checkpoint = str(path)
        log.info("checkpoint %s", path)
        return path

    def load_checkpoint(self, path: str | pathlib.Path) -> None:
        path = pathlib.Path(path)
        state = json.loads((path / "learner_state.json").read_text())
        self.model.load_state_dict(load_file(str(path / "model.safetensors")))
        reward_state = load_file(str(path / "reward_rms.safetensors"))
        self._returns = {int(k.split(".", 1)[1]): reward_state.pop(k).numpy().copy()
                         for k in list(reward_state) if k.startswith("returns.")}
        self.reward_rms.load_state_dict(reward_state)
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        self.epoch, self.version = state["epoch"], state["weights_version"]
        self.env_steps, self.elapsed_s = state["env_steps"], state["elapsed_s"]
        self.last_checkpoint = str(path)
        print(f"learner: resumed from {path} (epoch {self.epoch}, env steps {self.env_steps})", flush=True)

    def close(self) -> None:
        self.logger.close()

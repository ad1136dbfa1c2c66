"""The PPO / GRPO update, top to bottom, as every learner rank runs it on its shard of the batch.

All ranks walk one permutation of the whole batch (seeded by the run seed and the epoch), cut into minibatches of
``actor.global_batch_size`` samples; a rank trains the samples of each minibatch that it holds, in micro batches
of ``actor.micro_batch_size``. Each loss is a sum over samples divided by the minibatch's global count of samples
that train, and gradients are summed over the ranks, so N ranks take exactly the optimizer step one process takes
on the whole batch (up to summation order). Advantages are standardised per minibatch over every rank's samples.
Every forward pass is a collective under FSDP2, so ranks with fewer samples in a minibatch run padding micro
batches of weight zero: every rank runs the same number of passes. In a group of one, the collectives are no-ops.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from rlfleet.config.views import LearnerView
from rlfleet.errors import FailedPrecondition
from services.learner import ppo
from services.learner.critic_process import CriticProcess, unsupported, unsupported_here
from services.learner.group import RankGroup
from services.learner.rollouts import policy_inputs
from services.learner.sharding import full_tensor

log = logging.getLogger(__name__)

# the step statistics summed over micro batches and ranks (each already divided by its normaliser)
STAT_KEYS = (
    "train/actor/policy_loss",
    "train/critic/value_loss",
    "train/actor/entropy_loss",
    "train/loss",
    "train/critic/value_clip_ratio",
    "train/actor/approx_kl",
    "train/actor/clip_fraction",
    "train/actor/clipped_ratio",
    "train/actor/ratio",
    "train/actor/kl_loss",
)


class _StepPlan(NamedTuple):
    """What every step of one update needs and the update works out once."""

    apart: bool  # the critic's half on its own thread (Trainer.critic_apart)
    row_dtype: torch.dtype | None  # with ``apart``: the dtype of the critic's row weights (its parameters')
    params: list  # the optimizer's parameters (their gradients are cleared before each step)
    features: torch.Tensor | None  # with ``apart``: every row's features (the policy's ``features``), computed once
    helper: CriticProcess | None  # with ``apart``: the critic's helper process, when this update uses it


def _pin_thread(cores: set[int]) -> bool:
    """The calling thread on ``cores`` (-> True), or as it was where the system refuses (-> False)."""
    try:
        os.sched_setaffinity(0, cores)  # pid 0: this thread only
        return True
    except OSError as exc:
        log.debug("the update's thread stays unpinned: sched_setaffinity(%s) failed: %s", sorted(cores), exc)
        return False


def _clip_grad_norm(params: list, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)``: for plain gradients of one device and dtype (an MLP on
    one rank) its own operations in its order (the same bits) without its grouping and checks, which took half of
    its time in the default update; anything else (sharded gradients, mixed dtypes) through torch's."""
    grads = [p.grad for p in params]
    if not grads or any(type(g) is not torch.Tensor for g in grads) or len({(g.device, g.dtype) for g in grads}) > 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    with torch.no_grad():
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        torch._foreach_mul_(grads, torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
    return total


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16 outputs (autocast) in fp32; fp32 and fp64 (the exactness tests) as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class _HelperJob:
    """A micro batch's critic half in the helper process; where the helper fails, ``redo`` on this thread."""

    def __init__(self, helper: CriticProcess, redo):
        self.helper, self.redo = helper, redo

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.helper.result()
        return out if out is not None else self.redo()


class Trainer:
    """Runs the update on this rank's rows; the model (sharded or not) and its optimizer are the learner's."""

    def __init__(self, view: LearnerView, group: RankGroup):
        self.view, self.alg, self.group = view, view.algorithm, group
        self.device = group.device
        # the critic's half of each step on a thread of its own (see critic_apart); created on first use
        self._critic_thread: ThreadPoolExecutor | None = None
        self.cores = len(os.sched_getaffinity(0))
        # ... or in a helper process (cluster.learner_critic_process), started with the learner: it imports torch
        # (~1.6 s of CPU) while the services start, not while the first epochs train; start() gives it the critic
        self.critic_process: CriticProcess | None = None
        if (
            view.learner_critic_process
            and view.model.model_type == "mlp"  # the policies whose critic is apart (see critic_apart)
            and torch.device(self.device).type == "cpu"
            and self._apart_by_config()
            and unsupported_here() is None
        ):
            self.critic_process = CriticProcess()

    def start(self, model) -> None:
        """Once the policy is built (before any update): share its critic with the helper process where the
        critic's half of each step runs apart from the actor's; else stop the helper."""
        proc = self.critic_process
        if proc is None or proc.attached:
            return
        why = unsupported(model) if self.critic_apart(model) else "the critic is not apart from the actor"
        if why is not None:
            log.info("the critic's half of each step runs on a thread (no helper process: %s)", why)
            proc.close()
            self.critic_process = None
            return
        alg = self.alg
        proc.attach(
            model.critic,
            self.view.micro_batch_size,
            value_clip=alg.value_clip,
            huber_delta=alg.huber_delta,
            value_loss_coef=alg.value_loss_coef,
            core=sorted(os.sched_getaffinity(0))[-1],
        )

    def close(self) -> None:
        """Stop the critic's helper process, if any."""
        if self.critic_process is not None:
            self.critic_process.close()

    def critic_apart(self, model, critic_only: bool = False) -> bool:
        """Whether each step runs the critic's forward and backward beside the actor's (in the helper process where
        there is one, else on a second thread): a policy whose critic shares no parameter with its actor
        (``critic_apart``: the MLP), one rank (no collectives to order), a synchronous run (the envs wait for this
        update: their cores are free) on 2+ cores, cluster.learner_num_threads left null, and both halves of the
        loss in the step. The gradients,
        losses and statistics are the same bits as on one thread (the two halves meet only in the sum)."""
        return getattr(model, "critic_apart", False) and not critic_only and self._apart_by_config()

    def _apart_by_config(self) -> bool:
        """critic_apart's conditions that the config and this host decide."""
        return (
            self.alg.loss_type == "actor_critic"
            and self.group.world == 1
            and self.alg.max_staleness == 0
            and self.view.learner_num_threads is None
            and self.cores >= 2
        )

    def _critic_half(self, model, features, rows, idx, wr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The critic's half of a step (on the critic thread) on the rows' ``features``: its values, the clipped
        value loss and its backward -> (value loss, clipped share), each already weighted by ``wr``."""
        alg = self.alg
        with model.precision():  # autocast is per thread
            values = model.value(None, features=features)
        return ppo.value_half(
            _at_least_fp32(values),
            rows["old_values"][idx],
            rows["returns"][idx],
            wr,
            value_clip=alg.value_clip,
            huber_delta=alg.huber_delta,
            value_loss_coef=alg.value_loss_coef,
        )

    # --- micro batches in lockstep ----------------------------------------------------------------------------
    def lockstep(self, rows: torch.Tensor, size: int):
        """Micro batches of ``rows`` (local row ids), as many on every rank: -> (ids, real). A rank out of rows
        yields ``real=False`` batches of one padding row (its first) that must weigh nothing."""
        n = self.group.max_int(max(1, math.ceil(len(rows) / size)))
        for i in range(n):
            ids = rows[i * size : (i + 1) * size]
            yield (ids, True) if len(ids) else (rows.new_zeros(1), False)

    @torch.no_grad()
    def log_probs(self, model, rows: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """``model``'s log-probs of the sampled actions of local rows ``ids`` (no grad, micro batched)."""
        out = []
        for idx, real in self.lockstep(ids, self.view.micro_batch_size):
            with model.precision():
                lp = _at_least_fp32(model.evaluate(*self._inputs(rows, idx)).log_probs)
            if real:
                out.append(lp)
        width = model.log_prob_width
        return torch.cat(out) if out else torch.zeros(0, width, device=self.device)

    def reference_log_probs(self, model, ref_model, rows: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """The KL reference's log-probs (algorithm.kl_beta): the frozen starting copy ``ref_model``, or with LoRA
        (``ref_model`` None) the policy with its adapters off (the same model, without a second copy)."""
        if ref_model is not None:
            return self.log_probs(ref_model, rows, ids)
        with model.adapters_disabled():
            return self.log_probs(model, rows, ids)

    _inputs = staticmethod(policy_inputs)

    def _sum(self, values: list[torch.Tensor]) -> torch.Tensor:
        t = torch.stack([torch.as_tensor(v).detach().to(self.device, torch.float64) for v in values])
        return self.group.all_reduce(t)

    # --- one update -------------------------------------------------------------------------------------------
    def update(
        self,
        model,
        optimizer,
        rows: dict[str, torch.Tensor],
        *,
        total: int,
        epoch: int,
        lr: float,
        use_mask: bool,
        critic_only: bool = False,
        ref_model=None,
    ) -> dict[str, float]:
        """Minibatch PPO/GRPO steps over this rank's ``rows`` (with 'index': their ids among the ``total`` rows
        of the whole batch). ``critic_only`` (critic warm-up): the loss is the value loss alone and only the
        critic's own modules step. ``ref_model``: the KL reference (None with LoRA: the policy, adapters off)."""
        alg = self.alg
        rows = {k: v.to(self.device) for k, v in rows.items()}
        local = len(rows["index"])
        stats: dict[str, float] = {}
        if "weights_version" in rows:
            stats.update(self._decouple_stale(model, rows, rows.pop("weights_version")))
        if alg.kl_beta > 0:  # algorithm.kl_beta: the reference's log-probs of the sampled actions
            rows["ref_log_probs"] = self.reference_log_probs(
                model, ref_model, rows, torch.arange(local, device=self.device)
            )
        critic = {id(p) for p in model.critic_parameters()} if critic_only else set()
        if critic_only and not critic:
            raise FailedPrecondition("algorithm.critic_warmup_epochs: the policy has no critic modules to warm up")
        for g in optimizer.param_groups:
            g["lr"] = lr
        weight = rows["mask"] if use_mask else torch.ones_like(rows["mask"])
        gen = torch.Generator().manual_seed(self.view.seed * 1_000_003 + epoch)
        apart = self.critic_apart(model, critic_only)
        proc = self.critic_process
        helper = proc if apart and proc is not None and proc.usable(model.critic) and proc.begin() else None
        if helper is not None and not helper.steps:
            log.info(
                "the critic's helper process (pid %d) takes the critic's half of each step from epoch %d on (ready "
                "%.1f s after it started)",
                helper.pid,
                epoch,
                helper.ready_after_s,
            )
        plan = _StepPlan(
            apart=apart,
            # the row weights' dtype: the log-probs' (the parameters': fp32, fp64 in the exactness tests)
            row_dtype=_at_least_fp32(next(iter(model.critic_parameters()))).dtype if apart else None,
            params=[p for g in optimizer.param_groups for p in g["params"]],
            features=self._features(model, rows) if apart else None,
            helper=helper,
        )
        try:
            with self._cores_apart(apart):
                steps, first_diff, sums = self._passes(
                    model, optimizer, rows, total, weight, critic, critic_only, gen, plan
                )
        finally:
            if helper is not None:
                helper.end()
        out = {k: v / max(steps, 1) for k, v in sums.items()}
        if alg.kl_beta <= 0:
            out.pop("train/actor/kl_loss", None)
        out.update(stats)
        out["train/actor/first_logprob_abs_diff"] = first_diff
        out["train/actor/lr"] = lr
        out["train/optimizer_steps"] = float(steps)
        out["train/critic_warmup"] = float(critic_only)
        if hasattr(model, "log_std"):
            out["train/actor/log_std"] = float(full_tensor(model.log_std.detach()).mean())
        return out

    def _passes(self, model, optimizer, rows, total, weight, critic, critic_only, gen, plan: _StepPlan):
        """``algorithm.update_epoch`` passes over the batch, a step per minibatch (fewer when ``target_kl`` stops
        them) -> (steps, the first step's log-prob gap, the steps' summed statistics)."""
        alg, gbs = self.alg, self.view.global_batch_size
        sums: dict[str, float] = {}
        steps, first_diff, stop = 0, float("nan"), False
        for _ in range(alg.update_epoch):
            perm = torch.randperm(total, generator=gen)
            pos = torch.empty(total, dtype=torch.int64)
            pos[perm] = torch.arange(total)
            local_pos = pos[rows["index"].cpu()]
            order = torch.argsort(local_pos)  # this rank's rows in permutation order
            minibatch = (local_pos[order] // gbs).to(self.device)
            order = order.to(self.device)
            for j in range(math.ceil(total / gbs)):
                ids = order[minibatch == j]
                step = self._step(model, optimizer, rows, ids, weight, critic, critic_only, plan, first=steps == 0)
                if steps == 0:
                    first_diff = step.pop("first_diff")
                for k, v in step.items():
                    sums[k] = sums.get(k, 0.0) + v
                steps += 1
                if alg.target_kl is not None and step["train/actor/approx_kl"] > alg.target_kl:
                    stop = True  # every rank sees the same all-reduced value: all stop together
                    break
            if stop:
                break
        return steps, first_diff, sums

    @contextlib.contextmanager
    def _cores_apart(self, apart: bool):
        """With the critic on its own thread: this thread on the first of this process's cores and the critic's on
        the last one for the update (then this thread's cores as before). Left to itself, the scheduler wakes the
        critic's thread on the core of the thread that hands it each step's work, and the halves that should run
        side by side take turns: after the ~120 ms a rollout leaves the learner idle, the default epoch's update
        took 37-39 ms on two threads, against 30 on two pinned ones and 36-39 on one (benchmarks/update_cost.py
        --idle-ms). Where the cores cannot be set (no affinity on this platform, a refusal), the update runs
        unpinned as before."""
        cores = sorted(os.sched_getaffinity(0)) if apart and hasattr(os, "sched_setaffinity") else []
        if len(cores) < 2:
            yield
            return
        self._critic_pool(cores[-1])
        pinned = _pin_thread({cores[0]})
        try:
            yield
        finally:
            if pinned:
                _pin_thread(set(cores))

    @torch.no_grad()
    def _features(self, model, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """Every row's features, once for the update: both halves of each step start from them (the observation
        normaliser's operations, row by row: the same bits as per minibatch). Recomputed for each of a step's two
        halves they were ~14 of the step's operations, each a hand-off of the GIL between the two threads: the
        default update took 31.9 -> 30.0 ms (median of 300 in turns, one process)."""
        with model.precision():
            return model.features(self._inputs(rows, slice(None))[0])

    def _critic_job(self, model, features, rows, idx, wr, helper: CriticProcess | None, halves: list):
        """Start a micro batch's critic half: in the helper process when this update uses it (and it takes the
        batch), else on the critic's thread -> something whose ``result()`` is (value loss, clipped share)."""
        args = (model, features, rows, idx, wr)
        before = list(halves)  # once the helper fails it is never used again: these all went to it
        halves.append(args)
        if helper is not None and helper.failed is None:
            old, ret = rows["old_values"][idx], rows["returns"][idx]
            if helper.accepts(features, old, ret, wr):
                helper.submit(features, old, ret, wr, first=not before)
                return _HelperJob(helper, lambda: self._redo_critic(model, before, args))
            helper.fail(f"a micro batch of {len(idx)} rows that its shared memory was not laid out for")
            self._redo_critic(model, before)
        return self._critic_thread.submit(self._critic_half, *args)

    def _redo_critic(self, model, before: list[tuple], args: tuple | None = None):
        """The helper failed in a step: the step's critic gradients again from zero on this thread, the micro
        batches it had done, then ``args``' -> that one's (value loss, clipped share)."""
        for p in model.critic_parameters():
            p.grad = None
        for done in before:
            self._critic_half(*done)
        return self._critic_half(*args) if args is not None else None

    def _critic_pool(self, core: int | None = None) -> ThreadPoolExecutor:
        """The critic's thread (created on first use; on ``core`` when given)."""
        if self._critic_thread is None:
            pin = {"initializer": _pin_thread, "initargs": ({core},)} if core is not None else {}
            self._critic_thread = ThreadPoolExecutor(1, thread_name_prefix="critic", **pin)
        return self._critic_thread

    def _step(
        self, model, optimizer, rows, ids, weight, critic, critic_only, plan: _StepPlan, first: bool = False
    ) -> dict[str, float]:
        """One optimizer step on this rank's rows ``ids`` of a minibatch (every rank calls it together). ``first``:
        the update's first step, which also measures how far the policy's log-probs are from the rollout's
        (``first_diff``: 0 when the learner recomputes exactly what the actor sampled with)."""
        alg = self.alg
        w_all = weight[ids].double()
        adv_all = rows["advantages"][ids].double()  # sums in float64: the same value however the rows are split
        # the minibatch's global count of samples that train, and (advantage standardisation) their mean and std
        count, adv_sum = self._sum([w_all.sum(), (adv_all * w_all).sum()]).tolist()
        mu = adv_sum / max(count, 1e-12)
        sd = math.sqrt(self._sum([((adv_all - mu) ** 2 * w_all).sum()]).item() / max(count, 1e-12))
        count = max(count, 1.0)
        for p in plan.params:  # optimizer.zero_grad(set_to_none=True), without its wrappers
            p.grad = None
        apart, row_dtype = plan.apart, plan.row_dtype
        if apart:
            self._critic_pool()
        acc = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=self.device)  # STAT_KEYS' sums
        diff = torch.zeros((), dtype=torch.float64, device=self.device)
        halves: list[tuple] = []  # the critic halves of this step's micro batches so far (the helper's fallback)
        for idx, real in self.lockstep(ids, self.view.micro_batch_size):
            w = weight[idx] * (1.0 if real else 0.0)
            adv = rows["advantages"][idx]
            if alg.normalize_advantages:
                adv = (adv - mu) / (sd + 1e-8)
            inputs = self._inputs(rows, idx)
            # the critic's half starts first: its forward, loss and backward take as long as the actor's, which
            # run here meanwhile (started after the actor's forward, it ended ~0.6 ms after the actor's backward)
            wr = w.to(row_dtype) / count if apart else None  # per-row weight of the value and entropy terms
            features = plan.features[idx] if apart else None
            critic_job = self._critic_job(model, features, rows, idx, wr, plan.helper, halves) if apart else None
            with model.precision():
                ev = model.evaluate_actor(*inputs, features=features) if apart else model.evaluate(*inputs)
            log_probs, entropy = _at_least_fp32(ev.log_probs), _at_least_fp32(ev.entropy)
            if real and first:
                diff = torch.maximum(
                    diff, ((log_probs.detach() - rows["old_log_probs"][idx]).abs() * (w[:, None] > 0)).max().to(diff)
                )
            width = log_probs.shape[1]
            w = w.to(log_probs.dtype)
            we = w[:, None].expand(-1, width) / (count * width)  # per-element weight of the policy terms
            if wr is None or wr.dtype != w.dtype:
                wr = w / count
            pg, pg_stats = ppo.policy_loss_terms(
                log_probs,
                rows["old_log_probs"][idx],
                adv[:, None].expand(-1, width),
                clip_ratio_low=alg.clip_ratio_low,
                clip_ratio_high=alg.clip_ratio_high,
                clip_ratio_c=alg.clip_ratio_c,
                weights=rows["is_weights"][idx] if "is_weights" in rows else None,
            )
            pg_loss = (pg * we).sum()
            if apart:
                v_loss = v_clip = None  # the critic thread's
            elif ev.values is not None and alg.loss_type == "actor_critic":
                v, v_clipped = ppo.value_loss_terms(
                    _at_least_fp32(ev.values),
                    rows["old_values"][idx],
                    rows["returns"][idx],
                    value_clip=alg.value_clip,
                    huber_delta=alg.huber_delta,
                )
                v_loss, v_clip = (v * wr).sum(), (v_clipped * wr).sum()
            else:  # no critic (GRPO)
                v_loss = v_clip = torch.zeros((), device=log_probs.device)
            ent = (entropy * wr).sum()
            if apart:  # the actor's half of the loss here, the critic's on its thread: the whole loss's gradients
                try:
                    kl, actor_loss = self._kl(log_probs, rows, idx, we), pg_loss - alg.entropy_bonus * ent
                    if "ref_log_probs" in rows:
                        actor_loss = actor_loss + alg.kl_beta * kl
                    actor_loss.backward()
                finally:
                    v_loss, v_clip = critic_job.result()
                with torch.no_grad():  # the loss as one thread sums it
                    loss = pg_loss + alg.value_loss_coef * v_loss - alg.entropy_bonus * ent
                    if "ref_log_probs" in rows:
                        loss = loss + alg.kl_beta * kl
            else:
                loss = pg_loss + alg.value_loss_coef * v_loss - alg.entropy_bonus * ent
                kl = self._kl(log_probs, rows, idx, we)
                if "ref_log_probs" in rows:
                    loss = loss + alg.kl_beta * kl
                (alg.value_loss_coef * v_loss if critic_only else loss).backward()
            parts = {
                "train/actor/policy_loss": pg_loss,
                "train/critic/value_loss": v_loss,
                "train/actor/entropy_loss": ent,
                "train/loss": loss,
                "train/critic/value_clip_ratio": v_clip,
                "train/actor/kl_loss": kl,
                **{f"train/actor/{k}": (s * we).sum() for k, s in pg_stats.items()},
            }
            # one float64 vector for all of them: the same sums as one accumulator each, in three operations
            with torch.no_grad():
                acc += torch.stack([parts[k] for k in STAT_KEYS]).to(torch.float64)
        if critic_only:  # no step for anything but the critic's own modules
            for p in model.parameters():
                if id(p) not in critic:
                    p.grad = None
        grad_norm = _clip_grad_norm([p for p in model.parameters() if p.grad is not None], alg.max_grad_norm)
        optimizer.step()
        out = dict(zip(STAT_KEYS, self.group.all_reduce(acc).tolist()))
        out["train/actor/grad_norm"] = float(full_tensor(grad_norm)) if torch.is_tensor(grad_norm) else float(grad_norm)
        if first:
            out["first_diff"] = float(self.group.all_reduce(diff, "max"))
        return out

    def _kl(self, log_probs: torch.Tensor, rows, idx, we: torch.Tensor) -> torch.Tensor:
        """The KL penalty to the reference policy (algorithm.kl_beta), weighted; 0 without a reference."""
        if "ref_log_probs" not in rows:
            return torch.zeros((), device=log_probs.device)
        return (ppo.kl_penalty(log_probs, rows["ref_log_probs"][idx], self.alg.kl_penalty) * we).sum()

    @torch.no_grad()
    def _decouple_stale(self, model, rows: dict[str, torch.Tensor], versions: torch.Tensor) -> dict[str, float]:
        """Rows at least algorithm.decoupled_staleness versions old: replace their behaviour log-probs by the
        current (proximal) policy's and weight them by min(pi_current / pi_behaviour, importance_weight_cap)."""
        stale = (self.version - versions) >= self.alg.decoupled_staleness
        n_stale, n_all = self._sum([stale.sum(), len(stale)]).tolist()
        out = {"rollout/stale_fraction": n_stale / max(n_all, 1.0)}
        if n_stale == 0:
            return out
        ids = torch.nonzero(stale).squeeze(1)
        prox = self.log_probs(model, rows, ids)
        behaviour = rows["old_log_probs"][ids]
        cap = self.alg.importance_weight_cap
        raw = (prox - behaviour).exp()
        weights = torch.ones_like(rows["old_log_probs"])
        weights[ids] = raw.clamp(max=cap)
        rows["old_log_probs"] = rows["old_log_probs"].index_put((ids,), prox)
        rows["is_weights"] = weights
        s_raw, s_trunc, s_n = self._sum([raw.sum(), (raw > cap).float().sum(), raw.numel()]).tolist()
        out.update(
            {
                "train/actor/is_weight_mean": s_raw / max(s_n, 1.0),
                "train/actor/is_weight_truncated": s_trunc / max(s_n, 1.0),
            }
        )
        return out

    version = 0  # the learner's weights version (set by the learner before each update)

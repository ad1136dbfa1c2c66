"""PPO, top to bottom: GAE advantages, then clipped-ratio policy loss + clipped value loss + entropy bonus.

Pure functions on tensors; ``Learner`` (learner.py) feeds them rollouts and owns the optimizer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlfleet.config import KL_PENALTIES


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    last_values: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over time-major [T, N] tensors.

    dones[t] = 1 when the episode ended at step t (terminated or truncated); the truncation bootstrap is already
    folded into rewards. delta_t = r_t + gamma * V_{t+1} * (1 - done_t) - V_t.
    Returns (advantages, returns = advantages + values).
    """
    T = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(last_values)
    if T == 0:
        return advantages, advantages + values
    # every step's TD error and decay at once (elementwise: the same numbers as step by step), then the recursion
    not_done = 1.0 - dones
    next_values = torch.cat([values[1:], last_values[None]])
    delta = rewards + gamma * next_values * not_done - values
    decay = gamma * gae_lambda * not_done
    for t in reversed(range(T)):
        last_gae = delta[t] + decay[t] * last_gae
        advantages[t] = last_gae
    return advantages, advantages + values


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return x.mean()
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def policy_loss_terms(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective (as a loss) per element, with optional dual clip for negative advantages, and
    its statistics per element (no gradient). ``weights``: per-element importance weights (truncated, no gradient)
    that scale the loss of off-policy samples; their ``old_log_probs`` are then the proximal policy's, not the
    behaviour policy's (decoupled PPO). The learner reduces the elements by the global sample count."""
    log_ratio = log_probs - old_log_probs
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * clipped_ratio
    loss = torch.maximum(loss_unclipped, loss_clipped)
    if clip_ratio_c is not None:  # dual clip: bound the loss when the advantage is negative
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * clip_ratio_c), loss)
    if weights is not None:
        loss = loss * weights
    with torch.no_grad():
        stats = {
            "approx_kl": (ratio - 1.0) - log_ratio,
            "clip_fraction": (loss_clipped > loss_unclipped).float(),
            "clipped_ratio": clipped_ratio,
            "ratio": ratio,
        }
    return loss, stats


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
    mask: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`policy_loss_terms` averaged over the (masked) elements: (loss, {statistic: mean})."""
    loss, stats = policy_loss_terms(
        log_probs,
        old_log_probs,
        advantages,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        weights=weights,
    )
    return masked_mean(loss, mask), {k: masked_mean(v, mask) for k, v in stats.items()}


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-element estimate of KL(current || reference) from the log-probs of the sampled actions
    (algorithm.kl_penalty): ``kl`` log p - log p_ref; ``abs`` its absolute value; ``mse`` half its square;
    ``low_var_kl`` p_ref/p - log(p_ref/p) - 1 (non-negative, unbiased, low variance), clipped to 10."""
    diff = log_probs - ref_log_probs
    if kind == "kl":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "mse":
        return 0.5 * diff.square()
    if kind == "low_var_kl":
        d = (-diff).clamp(-20.0, 20.0)
        return (d.exp() - d - 1.0).clamp(max=10.0)
    raise ValueError(f"algorithm.kl_penalty: '{kind}' is not one of {', '.join(KL_PENALTIES)}")


def value_loss_terms(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    *,
    value_clip: float | None,
    huber_delta: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared-error (or Huber) value loss per element, optionally clipped around the rollout's values;
    -> (loss, whether the clipped branch was taken, as 0/1 floats)."""

    def err(v):
        if huber_delta is not None:
            return F.huber_loss(v, returns, delta=huber_delta, reduction="none")
        return 0.5 * (v - returns).pow(2)

    loss = err(values)
    clipped = torch.zeros_like(loss)
    if value_clip is not None:
        v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        loss_clipped = err(v_clipped)
        clipped = (loss_clipped > loss).float().detach()
        loss = torch.maximum(loss, loss_clipped)
    return loss, clipped


def value_half(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    row_weights: torch.Tensor,
    *,
    value_clip: float | None,
    huber_delta: float | None,
    value_loss_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's half of a PPO step on its rows, apart from the actor's (services/learner/trainer.py): the value
    loss (clipped as in :func:`value_loss_terms`) and its clipped share, each summed with the per-row weights
    ``row_weights``, and the backward of ``value_loss_coef`` x that loss -> (value loss, clipped share). The one
    implementation the learner's critic thread and its helper process (critic_process.py) both run."""
    v, v_clipped = value_loss_terms(values, old_values, returns, value_clip=value_clip, huber_delta=huber_delta)
    v_loss, v_clip = (v * row_weights).sum(), (v_clipped * row_weights).sum()
    (value_loss_coef * v_loss).backward()
    return v_loss.detach(), v_clip


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    *,
    value_clip: float | None,
    huber_delta: float | None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`value_loss_terms` averaged over the (masked) elements: (loss, fraction clipped)."""
    loss, clipped = value_loss_terms(values, old_values, returns, value_clip=value_clip, huber_delta=huber_delta)
    return masked_mean(loss, mask), masked_mean(clipped, mask)


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    var = returns.var()
    return float("nan") if var == 0 else float(1.0 - (returns - values).var() / var)

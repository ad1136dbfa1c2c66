"""GRPO advantages, top to bottom (pure functions; ``Learner`` feeds them rollouts).

Consecutive envs form groups of ``group_size`` that started from the same initial state (the rollout worker
resets them together through the env contract: one seed or fixed state id per group). Each env's score is its
return over the epoch's valid steps (``loss_mask``); its advantage is (score - group mean) / (group std + eps),
broadcast to every valid step. Groups whose mean score falls outside ``filter_range`` (all-fail and all-success
groups carry no signal) are dropped from the loss.
"""

from __future__ import annotations

import torch


def group_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[T, N] rewards and valid-step mask -> [N] episode scores."""
    return (rewards * mask).sum(0)


def grpo_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    *,
    eps: float = 1e-6,
    filter_range: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """-> (advantages [T, N], the loss mask with filtered groups removed [T, N], stats)."""
    T, N = rewards.shape
    if N % group_size:
        raise ValueError(f"{N} envs do not split into groups of {group_size}")
    scores = group_scores(rewards, mask).reshape(-1, group_size)  # [G, group_size]
    mean, std = scores.mean(1, keepdim=True), scores.std(1, unbiased=False, keepdim=True)
    adv_env = ((scores - mean) / (std + eps)).reshape(N)
    keep = torch.ones(scores.shape[0], dtype=torch.bool, device=rewards.device)
    if filter_range is not None:
        lo, hi = filter_range
        keep = (mean.squeeze(1) >= lo) & (mean.squeeze(1) <= hi)
    keep_env = keep.repeat_interleave(group_size)
    new_mask = mask * keep_env[None, :].to(mask.dtype)
    stats = {
        "rollout/grpo_groups": float(scores.shape[0]),
        "rollout/grpo_groups_kept": float(keep.sum()),
        "rollout/scores_mean": float(scores.mean()),
        "rollout/scores_std_in_group": float(std.mean()),
    }
    return adv_env[None, :].expand(T, N).clone(), new_mask, stats

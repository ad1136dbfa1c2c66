import numpy as np
import torch

from services.learner import ppo


def test_gae_matches_hand_computation():
    r = torch.tensor([[1.0], [0.0], [2.0]])
    v = torch.tensor([[0.5], [0.4], [0.3]])
    d = torch.tensor([[0.0], [1.0], [0.0]])
    last = torch.tensor([0.2])
    g, lam = 0.9, 0.8
    adv, ret = ppo.compute_gae(r, v, d, last, g, lam)
    d2 = 2.0 + g * 0.2 - 0.3
    d1 = 0.0 - 0.4  # episode ended at t=1: no bootstrap
    d0 = 1.0 + g * 0.4 - 0.5
    expected = [d0 + g * lam * d1, d1, d2]
    assert np.allclose(adv.squeeze(1).numpy(), expected, atol=1e-6)
    assert torch.allclose(ret, adv + v)


def test_gae_is_the_step_by_step_recursion_bit_for_bit():
    """The TD errors and decays are computed for all steps at once, then the recursion runs: the same float32
    numbers as computing each step's TD error inside the loop (the form runs before it were trained with), and no
    steps gives no advantages."""
    g = torch.Generator().manual_seed(0)
    T, N, gamma, lam = 16, 64, 0.95, 0.95
    r, v = torch.randn(T, N, generator=g), torch.randn(T, N, generator=g)
    d = (torch.rand(T, N, generator=g) < 0.1).float()
    last = torch.randn(N, generator=g)
    expected, gae = torch.zeros_like(r), torch.zeros_like(last)
    for t in reversed(range(T)):
        nxt = last if t == T - 1 else v[t + 1]
        delta = r[t] + gamma * nxt * (1.0 - d[t]) - v[t]
        gae = delta + gamma * lam * (1.0 - d[t]) * gae
        expected[t] = gae
    adv, ret = ppo.compute_gae(r, v, d, last, gamma, lam)
    assert torch.equal(adv, expected) and torch.equal(ret, expected + v)
    empty, _ = ppo.compute_gae(r[:0], v[:0], d[:0], last, gamma, lam)
    assert empty.shape == (0, N)


def test_policy_loss_clipping_and_dual_clip():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 0.5, 1.5, 3.0]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, stats = ppo.policy_loss(new, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None)
    # per-sample: max(-A r, -A clip(r)) -> [-1.2, -0.5, 1.5, 3.0]
    assert np.isclose(loss.item(), np.mean([-1.2, -0.5, 1.5, 3.0]))
    assert np.isclose(stats["clip_fraction"].item(), 0.25)
    loss_dc, _ = ppo.policy_loss(new, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=2.0)
    assert np.isclose(loss_dc.item(), np.mean([-1.2, -0.5, 1.5, 2.0]))


def test_policy_loss_importance_weights_scale_each_sample():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 0.5, 1.5, 3.0]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None)
    loss, _ = ppo.policy_loss(new, old, adv, weights=torch.tensor([2.0, 1.0, 0.5, 0.0]), **kw)
    assert np.isclose(loss.item(), np.mean([-2.4, -0.5, 0.75, 0.0]))
    assert torch.equal(
        ppo.policy_loss(new, old, adv, weights=torch.ones(4), **kw)[0], ppo.policy_loss(new, old, adv, **kw)[0]
    )


def test_value_loss_clip_and_huber():
    v = torch.tensor([2.0])
    old = torch.tensor([0.0])
    ret = torch.tensor([1.0])
    unclipped, _ = ppo.value_loss(v, old, ret, value_clip=None, huber_delta=None)
    assert np.isclose(unclipped.item(), 0.5)
    # pessimistic max of unclipped and clipped errors: here the clipped prediction (0.2) is worse
    clipped, ratio = ppo.value_loss(v, old, torch.tensor([3.0]), value_clip=0.2, huber_delta=None)
    assert np.isclose(clipped.item(), 0.5 * 2.8**2) and ratio.item() == 1.0
    same, ratio = ppo.value_loss(v, old, ret, value_clip=0.2, huber_delta=None)
    assert np.isclose(same.item(), 0.5) and ratio.item() == 0.0
    huber, _ = ppo.value_loss(torch.tensor([4.0]), old, ret, value_clip=None, huber_delta=1.0)
    assert np.isclose(huber.item(), 3.0 - 0.5)


def test_masked_mean():
    x = torch.tensor([1.0, 100.0, 3.0])
    assert ppo.masked_mean(x, torch.tensor([1.0, 0.0, 1.0])).item() == 2.0


def test_grpo_advantages_groups_and_filter():
    from services.learner.grpo import grpo_advantages

    T, N = 4, 6  # 3 groups of 2
    rewards = torch.zeros(T, N)
    rewards[0, 0] = 1.0  # group 0: one success, one failure
    rewards[:, 2:4] = 1.0  # group 1: both succeed (all-success)
    mask = torch.ones(T, N)
    mask[2:, 1] = 0.0  # env 1 ended after 2 steps
    adv, new_mask, stats = grpo_advantages(rewards, mask, 2)
    assert torch.allclose(adv[:, 0], torch.full((T,), 1.0), atol=1e-4)  # (1 - 0.5) / 0.5
    assert torch.allclose(adv[:, 1], torch.full((T,), -1.0), atol=1e-4)
    assert torch.allclose(adv[:, 2:], torch.zeros(T, 4))  # no spread: zero advantage
    assert torch.equal(new_mask, mask) and stats["rollout/grpo_groups"] == 3
    adv, new_mask, stats = grpo_advantages(rewards, mask, 2, filter_range=(0.1, 3.9))
    assert new_mask[:, 2:4].sum() == 0 and new_mask[:, 4:].sum() == 0 and new_mask[:, :2].sum() == mask[:, :2].sum()
    assert stats["rollout/grpo_groups_kept"] == 1


def test_kl_penalty_estimators():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.0, -1.5])
    d = lp - ref
    assert torch.allclose(ppo.kl_penalty(lp, ref, "kl"), d)
    assert torch.allclose(ppo.kl_penalty(lp, ref, "abs"), d.abs())
    assert torch.allclose(ppo.kl_penalty(lp, ref, "mse"), 0.5 * d**2)
    k3 = ppo.kl_penalty(lp, ref, "low_var_kl")
    assert torch.allclose(k3, torch.exp(-d) + d - 1.0)
    assert k3[0] == 0 and (k3 >= 0).all()
    assert ppo.kl_penalty(torch.tensor([-50.0]), torch.tensor([0.0]), "low_var_kl") == 10.0  # clipped
    try:
        ppo.kl_penalty(lp, ref, "k2")
    except ValueError as e:
        assert "algorithm.kl_penalty" in str(e) and "'k2'" in str(e)
    else:
        raise AssertionError("an unknown estimator must be refused")

"""π0 (transformers' PI0ForConditionalGeneration at a tiny size) as an RL policy: Flow-SDE log-probs recomputed
exactly, PPO steps that move them, deterministic evaluation, expert-only training."""

from __future__ import annotations

import pytest
import torch

from rlfleet.config import load_config
from rlfleet.models import ObsSpec
from rlfleet.policies import build_policy
from services.learner import ppo

SPECS = {"third_person": ObsSpec((32, 32, 3), "uint8"), "wrist": ObsSpec((32, 32, 3), "uint8"),
         "state": ObsSpec((7,), "float32")}
INSTR = ["pick up the red cube"] * 4 + ["open the drawer"] * 4


def _policy(logprob_type="chunk_level", *overrides):
    cfg = load_config(None, ["actor.model.model_type=openpi", "actor.model.num_action_chunks=4",
                             "env.train.max_steps_per_rollout_epoch=32", *overrides])
    torch.manual_seed(0)
    return build_policy(cfg.actor.model, SPECS, 4, True, logprob_type)


def _obs(n=8):
    g = torch.Generator().manual_seed(3)
    return {"third_person": torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g),
            "wrist": torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g),
            "state": torch.randn(n, 7, generator=g)}


@pytest.mark.parametrize("logprob_type", ["chunk_level", "action_level", "token_level"])
def test_flow_sde_log_prob_is_recomputed_exactly(logprob_type):
    p = _policy(logprob_type)
    obs = _obs()
    out = p.act(obs, False, INSTR)
    width = {"chunk_level": 1, "action_level": 4, "token_level": 16}[logprob_type]
    assert out.actions.shape == (8, 4, 4) and out.log_probs.shape == (8, width)
    steps = out.forward_inputs["denoise_step"]
    assert steps.min() >= 0 and steps.max() < 4
    ev = p.evaluate(obs, out.forward_inputs)
    assert (ev.log_probs - out.log_probs).abs().max() < 1e-5 and (ev.values - out.values).abs().max() < 1e-5
    a, b = p.act(obs, True, INSTR), p.act(obs, True, INSTR)
    assert torch.equal(a.actions, b.actions)  # evaluation: the ODE, one observation -> one action
    assert not torch.equal(p.act(obs, False, INSTR).actions, out.actions)


def test_ppo_steps_raise_the_log_prob_of_advantaged_chunks():
    p = _policy("chunk_level")
    obs = _obs()
    out = p.act(obs, False, INSTR)
    adv = torch.tensor([1.0, -1.0] * 4)
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=1e-3)
    losses = []
    for _ in range(5):
        ev = p.evaluate(obs, out.forward_inputs)
        loss, _ = ppo.policy_loss(ev.log_probs, out.log_probs, adv[:, None], clip_ratio_low=0.2,
                                  clip_ratio_high=0.2, clip_ratio_c=None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    moved = (p.evaluate(obs, out.forward_inputs).log_probs - out.log_probs).squeeze(1).detach()
    assert moved[adv > 0].mean() > 0 > moved[adv < 0].mean()  # on average (rows share one small model)


def test_train_expert_only_freezes_the_vlm_and_bad_sizes_are_named():
    p = _policy("chunk_level", "actor.model.openpi.train_expert_only=true")
    assert not any(q.requires_grad for q in p.pi0.model.vlm.parameters())
    assert all(q.requires_grad for q in p.pi0.model.dit.parameters())
    assert set(p.sync_state_dict()) and not any(k.startswith("pi0.model.vlm.") for k in p.sync_state_dict())
    with pytest.raises(ValueError, match="exceed max_state_dim 4"):
        _policy("chunk_level", "actor.model.openpi.max_state_dim=4")
    with pytest.raises(ValueError, match="expert_layers must equal vlm_layers"):
        _policy("chunk_level", "actor.model.openpi.expert_layers=3")

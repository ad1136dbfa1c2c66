"""services/learner/sac.py: the squashed Gaussian's log-prob, the SAC update learning a task, and N learner ranks
(torchrun, gloo) taking exactly the step one process takes (float64)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlfleet.wire.spaces import TensorSpace
from services.learner.sac import Actor, SacAgent, SacConfig, SacUpdate

SCENARIO = str(Path(__file__).with_name("sac_scenarios.py"))
ROOT = Path(__file__).resolve().parents[3]


def test_the_squashed_log_prob_is_the_density_of_the_action():
    """log pi(a|s) of the tanh-squashed Gaussian against the density torch's own distributions give for the same
    change of variables."""
    torch.manual_seed(0)
    actor = Actor(4, 3, (16,)).double()
    torch.nn.init.normal_(actor.net[-1].weight, std=0.3)  # a spread of means and stds, not the near-uniform start
    f = torch.randn(64, 4, dtype=torch.float64)
    noise = torch.randn(64, 3, dtype=torch.float64)
    a, logp, mean = actor(f, noise)
    inside = a.abs().amax(-1) < 0.999  # (where atanh of a float is exact enough)
    assert inside.sum() > 32 and torch.allclose(actor.log_prob(f, a)[inside], logp[inside], atol=1e-5)
    mu, log_std = actor.net(f).chunk(2, dim=-1)
    log_std = -5.0 + 3.5 * (torch.tanh(log_std) + 1)
    base = torch.distributions.Normal(mu, log_std.exp())
    squashed = torch.distributions.TransformedDistribution(base, [torch.distributions.TanhTransform()])
    u = mu + log_std.exp() * noise
    assert torch.allclose(a, torch.tanh(u)) and (a.abs() < 1).all() and torch.allclose(mean, torch.tanh(mu))
    expect = squashed.log_prob(torch.tanh(u).clamp(-1 + 1e-12, 1 - 1e-12)).sum(-1)
    assert torch.allclose(logp, expect, atol=1e-6), (logp - expect).abs().max()


def test_sac_learns_the_best_action_of_a_one_step_task():
    """Reward -(a - target)^2 per dimension, every episode one step long (terminated): the actor's mean action goes
    to the target, the critics' value to the reward there, and the temperature falls as the policy narrows."""
    torch.manual_seed(0)
    specs = {"s": TensorSpace((2,), "float32")}
    target = torch.tensor([0.5, -0.3])
    agent = SacAgent(specs, 2, SacConfig(hidden_dims=(64, 64), actor_lr=3e-3, critic_lr=3e-3, alpha_lr=3e-3))
    update = SacUpdate(agent)
    g = torch.Generator().manual_seed(1)
    first = None
    for step in range(400):
        obs = torch.randn(128, 2, generator=g)
        action = torch.rand(128, 2, generator=g) * 2 - 1
        batch = {
            "obs.s": obs,
            "next_obs.s": obs,
            "action": action,
            "reward": -((action - target) ** 2).sum(-1),
            "terminated": torch.ones(128, dtype=torch.bool),
            "noise": torch.randn(128, 2, generator=g),
            "next_noise": torch.randn(128, 2, generator=g),
        }
        m = update.step(batch, 128)
        first = first or m
    with torch.no_grad():
        _, _, mean = agent.actor(agent.encoder({"s": torch.randn(256, 2, generator=g)}))
    assert (mean.mean(0) - target).abs().max() < 0.1, mean.mean(0)
    assert m["train/critic/loss"] < 0.2 * first["train/critic/loss"], (first, m)
    assert m["train/alpha"] < 0.5 * first["train/alpha"], (first, m)
    assert {"train/critic/q_mean", "train/critic/td_error_abs", "train/actor/loss", "train/actor/entropy"} <= set(m)


def test_the_targets_follow_the_critics_by_polyak_steps():
    torch.manual_seed(0)
    specs = {"s": TensorSpace((2,), "float32"), "cam": TensorSpace((16, 16, 3), "uint8")}
    agent = SacAgent(specs, 1, SacConfig(hidden_dims=(8,), tau=0.25))
    targets = [*agent.targets.parameters(), *agent.target_encoder.parameters()]
    sources = [*agent.critics.parameters(), *agent.encoder.parameters()]
    assert len(targets) == len(sources) > 6  # the critics' layers and the camera's conv net
    before = [t.detach().clone() for t in targets]
    update = SacUpdate(agent)
    cams = torch.randint(0, 256, (16, 16, 16, 3), dtype=torch.uint8)
    batch = {
        "obs.s": torch.randn(8, 2),
        "obs.cam": cams[:8],
        "next_obs.cam": cams[8:],
        "next_obs.s": torch.randn(8, 2),
        "action": torch.rand(8, 1),
        "reward": torch.ones(8),
        "terminated": torch.zeros(8, dtype=torch.bool),
        "noise": torch.randn(8, 1),
        "next_noise": torch.randn(8, 1),
    }
    update.step(batch, 8, update_actor=False)
    for t0, t, c in zip(before, targets, sources):
        assert torch.allclose(t, 0.75 * t0 + 0.25 * c.detach())
    assert not any(p.requires_grad for p in targets)
    assert any(not torch.equal(t0, t) for t0, t in zip(before, agent.target_encoder.parameters()))


def _ranks(n: int, out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", SCENARIO, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
def test_two_ranks_take_the_step_one_process_takes(tmp_path):
    one, two = _ranks(1, tmp_path / "one"), _ranks(2, tmp_path / "two")
    assert (one["world"], two["world"]) == (1, 2)
    a, b = (
        load_file(str(tmp_path / "one" / "state.safetensors")),
        load_file(str(tmp_path / "two" / "state.safetensors")),
    )
    assert a.keys() == b.keys() and any(k.startswith("targets.") for k in a) and "log_alpha" in a
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff < 1e-9, diff
    for m1, m2 in zip(one["metrics"], two["metrics"]):
        assert m1.keys() == m2.keys()
        assert all(math.isclose(m1[k], m2[k], rel_tol=1e-9, abs_tol=1e-12) for k in m1), (m1, m2)
    # the steps really moved the weights (a test that cannot fail proves nothing)
    torch.manual_seed(0)
    fresh = SacAgent(
        {"state": TensorSpace((6,), "float32"), "cam": TensorSpace((16, 16, 3), "uint8")},
        3,
        SacConfig(hidden_dims=(32, 32), layer_norm=True, tau=0.1),
    ).double()
    moved = max(float((fresh.state_dict()[k] - a[k]).abs().max()) for k in a)
    assert moved > 5e-4, moved  # three Adam steps of 3e-4


def test_the_sac_policy_acts_by_row_noise_and_scores_its_own_actions():
    """The SAC family acts like any policy: actions in [-1, 1] from each row's noise key (the same row, the same
    action in any batch, up to the last bits the inference server's padding removes), and ``evaluate`` gives back
    the log-prob ``act`` reported."""
    from rlfleet.config import load_config
    from rlfleet.policies import build_policy
    from rlfleet.wire.codec import RowNoise, row_keys

    cfg = load_config("pandapickcube_sac", [])
    specs = {"state": TensorSpace((6,), "float32")}
    policy = build_policy(cfg.actor.model, specs, 3, False, "chunk_level")
    obs = {"state": torch.randn(5, 6)}
    keys = row_keys(np.arange(5), 0, 0)
    out = policy.act(obs, False, None, RowNoise(keys))
    assert out.actions.shape == (5, 1, 3) and out.actions.abs().max() <= 1 and out.values is None
    one = policy.act({"state": obs["state"][2:3]}, False, None, RowNoise(keys[2:3]))
    assert torch.allclose(one.actions[0], out.actions[2], atol=1e-6)  # bit for bit once padded to 32-row blocks
    ev = policy.evaluate(obs, out.forward_inputs)
    assert torch.allclose(ev.log_probs, out.log_probs, atol=1e-4)
    assert torch.equal(policy.act(obs, True).actions, policy.act(obs, True).actions)

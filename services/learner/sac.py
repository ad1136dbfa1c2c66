"""Soft Actor-Critic, top to bottom: one update on a batch of transitions (Haarnoja et al. 2018, with the tuned
temperature of the second paper), as every learner rank runs it on its part of the batch. The networks are the sac
policy family's (rlfleet/policies/models/sac.py).

- The actor is a squashed Gaussian: a = tanh(u), u ~ N(mu(s), sigma(s)); its log-prob carries tanh's change of
  variables, log pi(a|s) = log N(u) - sum log(1 - tanh(u)^2). Actions live in [-1, 1] (the env contract's action
  range for continuous control).
- ``num_critics`` Q networks (two: the clipped double-Q of TD3/SAC) and their target copies, Polyak-averaged with
  ``tau`` after each critic step. ``layer_norm`` puts LayerNorm after each hidden layer of the critics (RLPD).
- One encoder (a conv net per camera) feeds the actor and the critics; the critics' loss trains it, the actor's sees
  its features detached; the targets read a Polyak copy of it.
- The temperature alpha is learned towards a target entropy of -action_dim (``target_entropy``: null) or a given
  value; ``init_alpha`` starts it.

Losses are sums over the rows a rank holds divided by the batch's global row count, and gradients are summed over
the ranks before each optimizer step, so N ranks take exactly the step one process takes on the whole batch (the
parameters are replicated: SAC's networks are small next to a VLA's). The sampling noise of the actor comes in with
the batch (``noise``, ``next_noise``: standard normals per row), so a row's numbers do not depend on which rank
holds it.

Metric names follow RLinf's: ``train/critic/*``, ``train/actor/*``, ``train/alpha``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlfleet.policies.models.sac import Actor, Critic, Encoder, SacAgent, SacConfig

__all__ = ["Actor", "Critic", "Encoder", "SacAgent", "SacConfig", "SacUpdate", "make_optimizer"]


def make_optimizer(agent: SacAgent, lr: float | None = None) -> torch.optim.Optimizer:
    """One Adam over the actor, the critics with the shared encoder, and log(alpha), a parameter group each (their learning rates: the
    agent's config, or ``lr`` for all). Each SAC step clears every gradient and steps only what has one, so one
    optimizer (one state to checkpoint) serves the three losses."""
    cfg = agent.cfg
    return torch.optim.Adam(
        [
            {"params": list(agent.actor.parameters()), "lr": lr or cfg.actor_lr},
            {"params": [*agent.critics.parameters(), *agent.encoder.parameters()], "lr": lr or cfg.critic_lr},
            {"params": [agent.log_alpha], "lr": lr or cfg.alpha_lr},
        ]
    )


class SacUpdate:
    """One SAC step at a time on a batch of this rank's rows; ``all_reduce`` sums a tensor over the learner's ranks
    (in place; the identity in a group of one). ``optimizer``: :func:`make_optimizer`'s (made here when None);
    ``gamma``, ``tau``: the run's (else the agent's config)."""

    def __init__(self, agent: SacAgent, all_reduce=lambda t: t, optimizer=None, gamma=None, tau=None):
        cfg = agent.cfg
        self.agent, self.all_reduce = agent, all_reduce
        self.gamma = cfg.gamma if gamma is None else float(gamma)
        self.tau = cfg.tau if tau is None else float(tau)
        self.cfg = cfg
        self.optimizer = optimizer if optimizer is not None else make_optimizer(agent)

    def _sync(self, params) -> None:
        """Sum the gradients of ``params`` over the ranks (one flat all-reduce)."""
        params = [p for p in params if p.grad is not None]
        if not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def _sum(self, *values: torch.Tensor) -> list[float]:
        t = torch.stack([v.detach().to(torch.float64) for v in values])
        return self.all_reduce(t).tolist()

    def step(self, batch: Mapping[str, torch.Tensor], total_rows: int, update_actor: bool = True) -> dict[str, float]:
        """One critic step, then (``update_actor``) one actor and one temperature step, then the targets' Polyak
        step. ``batch``: obs.*, next_obs.*, action, reward, terminated, noise, next_noise (this rank's rows);
        ``total_rows``: the batch's rows over every rank (the losses' normaliser)."""
        agent = self.agent
        obs = agent.normalize({k[4:]: v for k, v in batch.items() if k.startswith("obs.")})
        next_obs = agent.normalize({k[9:]: v for k, v in batch.items() if k.startswith("next_obs.")})
        n = float(total_rows)
        alpha = agent.alpha.detach()

        # critics: soft TD targets from the target encoder and critics, the minimum over them
        with torch.no_grad():
            nf = agent.target_encoder(next_obs)
            next_a, next_logp, _ = agent.actor(nf, batch["next_noise"])
            q_next = agent.min_q(agent.targets, nf, next_a) - alpha * next_logp
            not_done = 1.0 - batch["terminated"].to(q_next.dtype)
            target = batch["reward"].to(q_next.dtype) + self.gamma * not_done * q_next
        f = agent.encoder(obs)  # the critics' loss trains the shared encoder
        qs = [c(f, batch["action"]) for c in agent.critics]
        critic_loss = sum(((q - target) ** 2).sum() for q in qs) * (0.5 / n)
        self.optimizer.zero_grad(set_to_none=True)
        critic_loss.backward()
        self._sync([*agent.critics.parameters(), *agent.encoder.parameters()])
        self.optimizer.step()
        q_sum, td_abs = self._sum(qs[0].sum(), (qs[0] - target).abs().sum())
        (loss_c,) = self._sum(critic_loss)
        out = {
            "train/critic/loss": loss_c,
            "train/critic/q_mean": q_sum / n,
            "train/critic/td_error_abs": td_abs / n,
        }

        if update_actor:
            fd = f.detach()  # the actor's loss does not move the encoder
            a, logp, _ = agent.actor(fd, batch["noise"])
            q = agent.min_q(agent.critics, fd, a)
            actor_loss = (alpha * logp - q).sum() / n
            self.optimizer.zero_grad(set_to_none=True)
            actor_loss.backward()
            for p in agent.critics.parameters():  # the actor's loss reached the critics too: not their gradient
                p.grad = None
            self._sync(agent.actor.parameters())
            self.optimizer.step()
            alpha_loss = -(agent.log_alpha * (logp.detach() + agent.target_entropy)).sum() / n
            self.optimizer.zero_grad(set_to_none=True)
            alpha_loss.backward()
            self._sync([agent.log_alpha])
            self.optimizer.step()
            loss_a, loss_t, ent = self._sum(actor_loss, alpha_loss, -logp.detach().sum())
            out.update({"train/actor/loss": loss_a, "train/actor/entropy": ent / n, "train/alpha_loss": loss_t})

        with torch.no_grad():  # the targets follow the critics and the encoder
            for target_module, source in agent.target_modules():
                for t, s in zip(target_module.parameters(), source.parameters()):
                    t.lerp_(s, self.tau)
        out["train/alpha"] = float(agent.alpha.detach())
        return out

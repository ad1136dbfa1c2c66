"""The SAC policy family (``actor.model.model_type: sac``): a squashed-Gaussian actor, twin Q critics with their
Polyak targets, and the learned temperature, in one module, so the learner checkpoints and publishes it like any
policy and the inference server (or a collocated env server) acts with it.

- The actor: a = tanh(u), u ~ N(mu(s), sigma(s)); its log-prob carries tanh's change of variables,
  log pi(a|s) = log N(u) - sum log(1 - tanh(u)^2). Actions live in [-1, 1] (the env contract's range for
  continuous control). Acting draws u's noise from each row's key (rlfleet.wire.codec.RowNoise), so a row's action
  does not depend on its batch; deterministic acting takes tanh(mu).
- ``num_critics`` Q networks (two: clipped double-Q) and their target copies; ``layer_norm`` puts LayerNorm after
  each hidden layer of the critics (RLPD). The temperature is ``exp(log_alpha)``.
- Observations: the flattened float entries, and a small strided conv net per camera (uint8 HxWx3, at least
  16x16), in one encoder the actor and the critics share (the critics' loss trains it), with a target copy for the targets.

The update (losses, optimizer steps, Polyak averaging) is the learner's: services/learner/sac.py.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rlfleet.policies.base import PolicyEval, PolicyMixin
from rlfleet.policies.models.actor_critic import RunningMeanStd
from rlfleet.wire.codec import PolicyOutput
from rlfleet.wire.spaces import TensorSpace

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


@dataclass
class SacConfig:
    """The update's settings (the algorithm.* keys of an off-policy run)."""

    gamma: float = 0.99  # discount
    tau: float = 0.005  # Polyak step of the target critics
    actor_lr: float = 3e-4  # Adam learning rate of the actor
    critic_lr: float = 3e-4  # Adam learning rate of the critics
    alpha_lr: float = 3e-4  # Adam learning rate of log(alpha)
    init_alpha: float = 1.0  # the temperature at the start
    target_entropy: float | None = None  # null: -action_dim
    num_critics: int = 2  # Q networks; the target takes the minimum over them
    layer_norm: bool = False  # LayerNorm in the critics' hidden layers (RLPD)
    hidden_dims: tuple[int, ...] = (256, 256)  # hidden layers of the actor and each critic
    normalize_obs: bool = False  # running mean/std normalisation of the float observations (algorithm.normalize_obs)


class Encoder(nn.Module):
    """Observations -> one feature vector: the flattened float observations, and a small conv net per camera
    (uint8 HxWx3, scaled to [0, 1])."""

    def __init__(self, obs_specs: Mapping[str, TensorSpace]):
        super().__init__()
        self.keys = sorted(obs_specs)
        self.cams = nn.ModuleDict()
        width = 0
        for k in self.keys:
            s = obs_specs[k]
            if np.dtype(s.dtype) == np.uint8:
                h, w = int(s.shape[0]), int(s.shape[1])
                if h < 16 or w < 16:
                    raise ValueError(
                        f"the sac family's camera encoder needs images of at least 16x16 pixels; "
                        f"observation {k!r} is {h}x{w} (raise the env's image size)"
                    )
                # non-overlapping strides (4, 2, 2): each image becomes a (h/16 x w/16) grid of 32 features that
                # keeps where things are; at 64 px and batch 128 a forward + backward + target forward costs 14 ms
                # per camera on one core here, against 89 ms for 5x5/3x3 convs at stride 2 with padding
                net = nn.Sequential(
                    nn.Conv2d(3, 16, 4, stride=4),
                    nn.ReLU(),
                    nn.Conv2d(16, 32, 2, stride=2),
                    nn.ReLU(),
                    nn.Conv2d(32, 32, 2, stride=2),
                    nn.ReLU(),
                    nn.Flatten(),
                )
                self.cams[k] = net
                width += 32 * (h // 16) * (w // 16)  # each stride floors
            else:
                width += int(math.prod(s.shape))
        self.width = width

    def forward(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        parts = []
        for k in self.keys:
            x = obs[k]
            if k in self.cams:
                p = next(self.cams[k].parameters())
                x = x.permute(0, 3, 1, 2).contiguous().to(p.dtype).mul_(1.0 / 255.0)
                parts.append(self.cams[k](x))
            else:
                parts.append(x.reshape(len(x), -1))
        dtype = next((p.dtype for p in self.parameters()), parts[0].dtype)
        return torch.cat([p.to(dtype) for p in parts], dim=1)


def _mlp(sizes: list[int], layer_norm: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            if layer_norm:
                layers.append(nn.LayerNorm(sizes[i + 1]))
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Actor(nn.Module):
    """The squashed-Gaussian policy head on the encoder's features."""

    def __init__(self, width: int, action_dim: int, hidden: tuple[int, ...]):
        super().__init__()
        self.net = _mlp([width, *hidden, 2 * action_dim], False)
        with torch.no_grad():  # start near tanh(N(0, 1)): the mean small, the std 1, so the first rollouts explore
            last = self.net[-1]
            last.weight.mul_(0.01)
            last.bias.zero_()
            last.bias[action_dim:] = math.atanh(2 * (0.0 - LOG_STD_MIN) / (LOG_STD_MAX - LOG_STD_MIN) - 1)

    def _dist(self, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_std = self.net(f).chunk(2, dim=-1)
        return mu, LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(log_std) + 1)

    def forward(self, f: torch.Tensor, noise: torch.Tensor | None = None):
        """Features -> (action in [-1, 1], its log-prob, the mean action). ``noise`` None: the mean action."""
        mu, log_std = self._dist(f)
        std = log_std.exp()
        u = mu if noise is None else mu + std * noise.to(mu.dtype)
        a = torch.tanh(u)
        z = (u - mu) / std
        logp = (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        logp = logp - (2 * (math.log(2) - u - nn.functional.softplus(-2 * u))).sum(-1)  # log(1 - tanh(u)^2), stably
        return a, logp, torch.tanh(mu)

    def log_prob(self, f: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """log pi(action | features) of actions in [-1, 1] (clamped inside, where atanh is finite)."""
        mu, log_std = self._dist(f)
        a = action.to(mu.dtype).clamp(-1 + 1e-6, 1 - 1e-6)
        u = torch.atanh(a)
        z = (u - mu) / log_std.exp()
        logp = (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        return logp - (2 * (math.log(2) - u - nn.functional.softplus(-2 * u))).sum(-1)


class Critic(nn.Module):
    """One Q head on the encoder's features and the action."""

    def __init__(self, width: int, action_dim: int, hidden: tuple[int, ...], layer_norm: bool):
        super().__init__()
        self.net = _mlp([width + action_dim, *hidden, 1], layer_norm)

    def forward(self, f: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([f, action.to(f.dtype)], dim=-1)).squeeze(-1)


class SacAgent(PolicyMixin, nn.Module):
    """The encoder, the actor, the critics, their targets and log(alpha): everything a checkpoint of SAC holds (the
    optimizer is the learner's), and the policy interface for acting (rlfleet.policies.base).

    One encoder, trained by the critics' loss, feeds the actor (its features detached in the actor's loss) and the
    critics; the targets have their own Polyak-averaged copy (as DrQ and RLPD share a camera encoder): a batch's
    images go through a conv net twice per step, not once per network."""

    has_critic = False  # no state value V(s): the learner's PPO-style bootstrap does not apply
    logprob_type = "chunk_level"  # one log-prob per row (one action per call)

    def __init__(self, obs_specs: Mapping[str, TensorSpace], action_dim: int, cfg: SacConfig):
        super().__init__()
        self.cfg, self.action_dim = cfg, int(action_dim)
        hidden = tuple(cfg.hidden_dims)
        self.encoder = Encoder(obs_specs)
        width = self.encoder.width
        self.actor = Actor(width, action_dim, hidden)
        self.critics = nn.ModuleList(Critic(width, action_dim, hidden, cfg.layer_norm) for _ in range(cfg.num_critics))
        self.target_encoder = copy.deepcopy(self.encoder)
        self.targets = copy.deepcopy(self.critics)
        for p in [*self.targets.parameters(), *self.target_encoder.parameters()]:
            p.requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor(math.log(cfg.init_alpha)))
        # running mean/std of each float observation (algorithm.normalize_obs), before both encoders; buffers, so
        # they ship with the weights; the learner moves them after each update from the epoch's new transitions
        self.obs_rms = nn.ModuleDict(
            {
                k: RunningMeanStd(tuple(s.shape))
                for k, s in obs_specs.items()
                if cfg.normalize_obs and np.dtype(s.dtype) != np.uint8
            }
        )

    def normalize(self, obs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The observations as the encoders see them (float entries normalised when algorithm.normalize_obs)."""
        return {k: self.obs_rms[k](v) if k in self.obs_rms else v for k, v in obs.items()}

    @torch.no_grad()
    def update_obs_normalizer(self, obs: Mapping[str, torch.Tensor]) -> None:
        for k, rms in self.obs_rms.items():
            rms.update(obs[k])

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.exp()

    @property
    def target_entropy(self) -> float:
        return -float(self.action_dim) if self.cfg.target_entropy is None else float(self.cfg.target_entropy)

    def min_q(self, critics: nn.ModuleList, f: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return torch.stack([c(f, action) for c in critics]).min(0).values

    def target_modules(self) -> list[tuple[nn.Module, nn.Module]]:
        """(target, source) pairs the Polyak step moves."""
        return [(self.targets, self.critics), (self.target_encoder, self.encoder)]

    # --- the policy interface -------------------------------------------------------------------------------------
    def act(self, obs, deterministic: bool = False, instructions=None, noise=None) -> PolicyOutput:
        """Actions in [-1, 1] ``[n, 1, action_dim]`` and their log-probs ``[n, 1]``; no values."""
        mu = next(iter(obs.values()))
        n = len(mu)
        if deterministic:
            z = None
        elif noise is not None:
            z = noise.torch_normal((self.action_dim,), mu.float())
        else:
            z = torch.randn(n, self.action_dim)
        a, logp, mean = self.actor(self.encoder(self.normalize(obs)), z)
        if deterministic:
            a = mean
        return PolicyOutput(a[:, None, :], logp[:, None], None, {"actions": a})

    def evaluate(self, obs, forward_inputs, instructions=None) -> PolicyEval:
        """The actor's log-prob of the acted actions (``fi.actions``, in [-1, 1]); the entropy as -log-prob."""
        logp = self.actor.log_prob(self.encoder(self.normalize(obs)), forward_inputs["actions"])
        return PolicyEval(logp[:, None], -logp, None)

    @classmethod
    def from_config(cls, model_cfg, obs_specs, action_dim: int, normalize_obs: bool, logprob_type: str = "chunk_level"):
        """The ``actor.model`` group -> the SAC policy (rlfleet.policies.build_policy): ``hidden_dims`` for the actor
        and each critic; ``critic_layer_norm`` (RLPD) and ``init_alpha`` when the group has them."""
        cfg = SacConfig(
            hidden_dims=tuple(model_cfg.hidden_dims),
            layer_norm=bool(model_cfg.get("critic_layer_norm", False)),
            init_alpha=float(model_cfg.get("init_alpha", 1.0)),
            normalize_obs=bool(normalize_obs),
        )
        return cls(obs_specs, action_dim, cfg)

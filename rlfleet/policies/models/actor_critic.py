"""Gaussian actor-critic policies (model types ``mlp`` and ``cnn``): an MLP for state observations, a small CNN
encoder for images + state. They implement the policy interface (rlfleet.policies.base): ``act`` (inference) and
``evaluate`` (learner) share ``distribution``, so the log-prob of an action is computed by one piece of code on
both sides. The forward input is the sampled (unclipped) action.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from rlfleet.policies.base import PolicyEval, PolicyMixin, PolicyOutput, reduce_log_probs
from rlfleet.policies.models.activations import ACTIVATIONS
from rlfleet.wire.spaces import TensorSpace

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


def gaussian_log_prob(mean: torch.Tensor, std: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``torch.distributions.Normal(mean, std).log_prob(x)``: the same operations in the same order (the same
    bits), without building the distribution, whose argument checks took a tenth of the default MLP's act."""
    return -((x - mean) ** 2) / (2 * std**2) - std.log() - _LOG_SQRT_2PI


def gaussian_entropy(std: torch.Tensor) -> torch.Tensor:
    """``torch.distributions.Normal(mean, std).entropy()``, elementwise."""
    return 0.5 + 0.5 * math.log(2 * math.pi) + torch.log(std)


class RunningMeanStd(nn.Module):
    """Running mean/variance (parallel Welford) kept as buffers, so it ships with the policy weights.

    ``keep_for_acting`` (set where a policy only acts: rlfleet.policies.local.for_acting): the mean and standard
    deviation in the observations' dtype are kept from call to call, the same numbers, until the buffers change
    (their version counters or storage: a new weights set). An act then runs 3 of the normalisation's 7 operations
    (they took 136-200 us of a collocated env server's ~500 us act, with the simulator's steps between acts)."""

    def __init__(self, shape: tuple[int, ...], clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))
        self.clip, self.eps = clip, eps
        self.keep_for_acting = False
        self._kept: tuple | None = None  # (key, mean, std) in one dtype, while keep_for_acting

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, *self.mean.shape).to(torch.float64)
        batch_mean, batch_var, n = x.mean(0), x.var(0, unbiased=False), x.shape[0]
        delta, total = batch_mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.var.copy_((self.var * self.count + batch_var * n + delta.pow(2) * self.count * n / total) / total)
        self.count.copy_(total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep_for_acting:
            mean, var = self.mean, self.var
            key = (x.dtype, mean._version, var._version, mean.data_ptr(), var.data_ptr())
            kept = self._kept
            if kept is None or kept[0] != key:
                kept = self._kept = (key, mean.to(x.dtype), torch.sqrt(var + self.eps).to(x.dtype))
            return torch.clamp((x - kept[1]) / kept[2], -self.clip, self.clip)
        std = torch.sqrt(self.var + self.eps).to(x.dtype)
        return torch.clamp((x - self.mean.to(x.dtype)) / std, -self.clip, self.clip)


def _mlp(sizes: list[int], activation: str, out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        linear = nn.Linear(sizes[i], sizes[i + 1])
        last = i == len(sizes) - 2
        nn.init.orthogonal_(linear.weight, out_gain if last else math.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


class ImageEncoder(nn.Module):
    """Small conv net: uint8 HxWx3 -> features. One per camera."""

    def __init__(self, image_shape: tuple[int, int, int], channels: list[int], out_dim: int):
        super().__init__()
        layers, c_in = [], image_shape[2]
        for i, c in enumerate(channels):
            stride = 2
            layers += [nn.Conv2d(c_in, c, kernel_size=3 if i else 5, stride=stride, padding=1), nn.ReLU()]
            c_in = c
        layers += [nn.AdaptiveAvgPool2d(4), nn.Flatten()]
        self.conv = nn.Sequential(*layers)
        self.proj = nn.Sequential(nn.Linear(c_in * 16, out_dim), nn.ReLU())

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = (
            image.permute(0, 3, 1, 2).to(self.proj[0].weight.dtype) / 255.0
        )  # the parameters' dtype (fp32; fp64 in tests)
        return self.proj(self.conv(x))


class ActorCritic(PolicyMixin, nn.Module):
    """Gaussian policy with a state-independent log std, and a value head.

    Observation entries: float vectors are concatenated (after running normalisation); uint8 HxWx3 images go
    through one ``ImageEncoder`` each (model_type 'cnn').
    """

    def __init__(
        self,
        obs_specs: Mapping[str, TensorSpace],
        action_dim: int,
        *,
        model_type: str = "mlp",
        hidden_dims=(256, 256),
        activation: str = "tanh",
        init_log_std: float = -0.5,
        cnn_channels=(16, 32, 32),
        image_feature_dim: int = 128,
        normalize_obs: bool = True,
        logprob_type: str = "action_level",
    ):
        super().__init__()
        self.logprob_type = logprob_type
        self.obs_specs = dict(obs_specs)
        self.action_dim = action_dim
        self.model_type = model_type
        self.image_keys = sorted(k for k, s in self.obs_specs.items() if s.is_image)
        self.vector_keys = sorted(k for k, s in self.obs_specs.items() if not s.is_image)
        if model_type == "mlp" and self.image_keys:
            raise ValueError(f"model_type 'mlp' cannot take image observations {self.image_keys}; use 'cnn'")
        if model_type == "cnn" and not self.image_keys:
            raise ValueError("model_type 'cnn' needs image observations; the env provides none")
        vec_dim = sum(int(np.prod(self.obs_specs[k].shape)) for k in self.vector_keys)
        self.obs_rms = RunningMeanStd((vec_dim,)) if (normalize_obs and vec_dim) else None
        self.encoders = nn.ModuleDict(
            {k: ImageEncoder(self.obs_specs[k].shape, list(cnn_channels), image_feature_dim) for k in self.image_keys}
        )
        in_dim = vec_dim + image_feature_dim * len(self.image_keys)
        hidden = list(hidden_dims)
        self.actor_mean = _mlp([in_dim, *hidden, action_dim], activation, out_gain=0.01)
        self.critic = _mlp([in_dim, *hidden, 1], activation, out_gain=1.0)
        self.log_std = nn.Parameter(torch.full((action_dim,), float(init_log_std)))

    # --- observation handling -------------------------------------------------------------------------------
    def vector_obs(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        if not self.vector_keys:
            return None
        dtype = self.log_std.dtype  # the parameters' dtype (fp32; fp64 in the exactness tests)
        parts = [obs[k].reshape(obs[k].shape[0], -1).to(dtype) for k in self.vector_keys]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def features(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        parts = []
        vec = self.vector_obs(obs)
        if vec is not None:
            parts.append(self.obs_rms(vec) if self.obs_rms is not None else vec)
        parts += [self.encoders[k](obs[k]) for k in self.image_keys]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    @torch.no_grad()
    def update_obs_normalizer(self, obs: Mapping[str, torch.Tensor]) -> None:
        if self.obs_rms is not None:
            self.obs_rms.update(self.vector_obs(obs))

    # --- the one log-prob implementation ---------------------------------------------------------------------
    def heads(self, obs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> the Gaussian's mean and standard deviation [n, action_dim], and the values [n]."""
        feats = self.features(obs)
        mean, std = self._gaussian(feats)
        return mean, std, self.critic(feats).squeeze(-1)

    def _gaussian(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.actor_mean(feats)
        return mean, self._std().expand_as(mean)

    def _std(self) -> torch.Tensor:
        """The Gaussian's standard deviation, one [action_dim] row (state-independent)."""
        return self.log_std.clamp(-5.0, 2.0).exp()

    @property
    def critic_apart(self) -> bool:
        """State observations only: the actor and the critic share no trainable parameter (the image encoders
        of model_type cnn feed both)."""
        return not self.image_keys

    def distribution(self, obs: Mapping[str, torch.Tensor]) -> tuple[torch.distributions.Normal, torch.Tensor]:
        mean, std, values = self.heads(obs)
        return torch.distributions.Normal(mean, std), values

    def _log_probs(self, mean: torch.Tensor, std: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """[n, action_dim] actions -> [n, L] log-probs at this policy's granularity (a chunk of one action)."""
        return reduce_log_probs(gaussian_log_prob(mean, std, actions)[:, None, :], self.logprob_type)

    @torch.no_grad()
    def act(
        self, obs: Mapping[str, torch.Tensor], deterministic: bool = False, instructions=None, noise=None
    ) -> PolicyOutput:
        """Raw (unclipped) Gaussian samples, or the means; the env clips to its bounds."""
        feats = self.features(obs)
        mean, values = self.actor_mean(feats), self.critic(feats).squeeze(-1)
        std = self._std()  # one row, broadcast: each element the same number as heads()' [n, action_dim] expansion
        if deterministic:
            actions = mean
        elif noise is not None:
            actions = mean + std * noise.torch_normal(mean.shape[1:], mean)
        else:
            actions = torch.normal(mean, std.expand_as(mean))  # what Normal(mean, std).sample() draws
        return PolicyOutput(actions[:, None, :], self._log_probs(mean, std, actions), values, {"actions": actions})

    def evaluate(
        self, obs: Mapping[str, torch.Tensor], forward_inputs: Mapping[str, torch.Tensor], instructions=None
    ) -> PolicyEval:
        mean, std, values = self.heads(obs)
        return PolicyEval(self._log_probs(mean, std, forward_inputs["actions"]), gaussian_entropy(std).sum(-1), values)

    def evaluate_actor(
        self,
        obs: Mapping[str, torch.Tensor],
        forward_inputs: Mapping[str, torch.Tensor],
        instructions=None,
        features: torch.Tensor | None = None,
    ) -> PolicyEval:
        mean, std = self._gaussian(self.features(obs) if features is None else features)
        return PolicyEval(self._log_probs(mean, std, forward_inputs["actions"]), gaussian_entropy(std).sum(-1), None)

    def value(self, obs: Mapping[str, torch.Tensor], features: torch.Tensor | None = None) -> torch.Tensor:
        return self.critic(self.features(obs) if features is None else features).squeeze(-1)

    @classmethod
    def from_config(
        cls,
        model_cfg,
        obs_specs: Mapping[str, TensorSpace],
        action_dim: int,
        normalize_obs: bool,
        logprob_type: str = "action_level",
    ) -> ActorCritic:
        """The ``actor.model`` group -> a policy for an env's spaces (rlfleet.policies.build_policy)."""
        return cls(
            obs_specs,
            action_dim,
            model_type=model_cfg.model_type,
            hidden_dims=list(model_cfg.hidden_dims),
            activation=model_cfg.activation,
            init_log_std=model_cfg.init_log_std,
            cnn_channels=list(model_cfg.cnn_channels),
            image_feature_dim=model_cfg.image_feature_dim,
            normalize_obs=normalize_obs,
            logprob_type=logprob_type,
        )


def to_torch_obs(obs: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """numpy observation batch -> torch tensors (no copy when the array is writable)."""
    out = {}
    for k, v in obs.items():
        if not v.flags.writeable:
            v = v.copy()
        out[k] = torch.from_numpy(v)
    return out

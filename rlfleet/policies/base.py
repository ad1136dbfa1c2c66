"""The policy interface: what every model (Gaussian MLP/CNN, OpenVLA, OpenVLA-OFT, π0) implements, used by both
the inference engine (``act``) and the learner (``evaluate``), so the log-prob of an action is computed by one
piece of code on both sides.

- ``act(obs, deterministic, instructions, noise)`` -> PolicyOutput (rlfleet.wire.codec, the one output type the
  inference server and the policy clients pass on too): an action chunk ``[n, chunk, action_dim]``, its log-probs
  at the configured granularity ``[n, L]``, values ``[n]`` when the model has a critic, and the ``forward_inputs``
  (per-row tensors) that ``evaluate`` needs to recompute exactly those log-probs later (sampled actions, tokens,
  noise, denoising chains). ``noise`` (rlfleet.wire.noise.RowNoise, or None) holds per-row noise
  streams: a policy draws its sampling noise from it when given, so a row's sample depends on its key, not on the
  batch it is in (reproducible runs); None means torch's global generator.
- ``evaluate(obs, forward_inputs, instructions)`` -> PolicyEval with gradients: log-probs ``[n, L]``, entropy
  ``[n]``, values ``[n]`` or None.

- ``bc_loss(obs, actions, instructions)`` -> the behaviour-cloning loss of demonstrated action chunks (supervised
  fine-tuning): by default the negative log-likelihood that ``evaluate`` gives the forward inputs
  ``expert_forward_inputs`` builds for those actions, so SFT and RL score actions with the same code.

Log-prob granularity (``algorithm.logprob_type``, RLinf's names): ``chunk_level`` one per chunk (L = 1),
``action_level`` one per action of the chunk (L = chunk), ``token_level`` one per action dimension or token
(L = chunk x action_dim).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlfleet.wire.codec import PolicyOutput  # the one policy-output type (wire layer: the clients receive it too)

if TYPE_CHECKING:  # torch-free at import: config validation runs in simulator environments too
    import torch

    from rlfleet.wire.codec import RowNoise

LOGPROB_TYPES = ("chunk_level", "action_level", "token_level")


@dataclass
class PolicyEval:
    log_probs: torch.Tensor  # [n, L]
    entropy: torch.Tensor  # [n]
    values: torch.Tensor | None  # [n]


def log_prob_width(logprob_type: str, chunk: int, action_dim: int) -> int:
    """L, the number of log-probs per row, for a granularity."""
    return {"chunk_level": 1, "action_level": chunk, "token_level": chunk * action_dim}[logprob_type]


def reduce_log_probs(per_dim: torch.Tensor, logprob_type: str) -> torch.Tensor:
    """Per-dimension log-probs [n, chunk, action_dim] -> [n, L] at the granularity."""
    n = per_dim.shape[0]
    if logprob_type == "token_level":
        return per_dim.reshape(n, -1)
    if logprob_type == "action_level":
        return per_dim.sum(-1)
    if logprob_type == "chunk_level":
        return per_dim.reshape(n, -1).sum(-1, keepdim=True)
    raise ValueError(f"logprob_type '{logprob_type}' is not one of {', '.join(LOGPROB_TYPES)}")


def sample_categorical(logits: torch.Tensor, noise: RowNoise | None) -> torch.Tensor:
    """Draw one index per distribution from logits [n, ..., K]: by inverse CDF on the rows' uniform draws when
    ``noise`` is given (one number per distribution), else with torch's generator."""
    import torch

    if noise is None:
        return torch.distributions.Categorical(logits=logits).sample()
    cdf = torch.softmax(logits.double(), -1).cumsum(-1)
    u = noise.torch_uniform(logits.shape[1:-1], logits)[..., None] * cdf[..., -1:]
    return torch.searchsorted(cdf, u).squeeze(-1).clamp_(max=logits.shape[-1] - 1)


class PolicyMixin:
    """Defaults shared by policies (they are torch modules that also define act/evaluate)."""

    has_critic: bool = True
    # the value estimate shares no trainable parameter with the action distribution, and ``evaluate_actor`` and
    # ``value`` compute its two halves (from ``features``, which both take): the learner may run them on two
    # threads and compute the features once per update (services/learner/trainer.py)
    critic_apart: bool = False
    num_action_chunks: int = 1
    logprob_type: str = "action_level"
    autocast_dtype: torch.dtype | None = None  # actor.model.precision: bf16 -> torch.bfloat16

    @contextlib.contextmanager
    def precision(self):
        """The configured precision around a forward pass (act, evaluate, bc_loss): bf16 autocast on the model's
        device, or nothing. Every caller of the policy wraps its calls in it."""
        if self.autocast_dtype is None:
            yield
            return
        import torch

        device = next(self.parameters()).device.type
        with torch.autocast(device_type=device, dtype=self.autocast_dtype):
            yield

    @property
    def log_prob_width(self) -> int:
        return log_prob_width(self.logprob_type, self.num_action_chunks, self.action_dim)

    CRITIC_MODULES = ("critic", "value_head")  # top-level modules that only the value estimate uses

    def critic_parameters(self) -> list:
        """The trainable parameters of the value estimate's own modules (what a critic warm-up trains)."""
        return [p for n, p in self.named_parameters() if p.requires_grad and n.split(".", 1)[0] in self.CRITIC_MODULES]

    def update_obs_normalizer(self, obs: Mapping[str, torch.Tensor]) -> None:
        """Move running observation statistics (learner side, after an update); default: none."""

    def sync_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors that change in training (trainable parameters and persistent buffers such as running
        statistics): what a weight update after the first full set carries to the inference servers. With LoRA
        these are the adapters and the value head only."""
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        buffers = {n for n, _ in self.named_buffers()}
        return {k: v for k, v in self.state_dict().items() if k in trainable or k in buffers}

    trains_adapters_only: bool = False  # True where training moves adapters on frozen base weights (LoRA)

    @contextlib.contextmanager
    def adapters_disabled(self):
        """The policy without its adapters (``trains_adapters_only``): the model it was before training, in
        place, so a KL reference (algorithm.kl_beta) needs no second copy of the weights."""
        raise NotImplementedError(f"{type(self).__name__}: no adapters to disable (trains_adapters_only is False)")
        yield  # pragma: no cover

    def act(
        self,
        obs: Mapping[str, torch.Tensor],
        deterministic: bool = False,
        instructions: Sequence[str] | None = None,
        noise: RowNoise | None = None,
    ) -> PolicyOutput:
        raise NotImplementedError

    def evaluate(
        self,
        obs: Mapping[str, torch.Tensor],
        forward_inputs: Mapping[str, torch.Tensor],
        instructions: Sequence[str] | None = None,
    ) -> PolicyEval:
        raise NotImplementedError

    def evaluate_actor(
        self,
        obs: Mapping[str, torch.Tensor],
        forward_inputs: Mapping[str, torch.Tensor],
        instructions: Sequence[str] | None = None,
        features: torch.Tensor | None = None,
    ) -> PolicyEval:
        """``evaluate`` without the value (``values`` None): policies with ``critic_apart``. ``features``: the
        observations' ``features`` computed already (then ``obs`` is not read)."""
        raise NotImplementedError(f"{type(self).__name__}: its critic is not apart from its actor")

    def value(self, obs: Mapping[str, torch.Tensor], features: torch.Tensor | None = None) -> torch.Tensor:
        """The value estimate alone [n] (policies with ``critic_apart``: the same numbers ``evaluate`` gives);
        ``features`` as in ``evaluate_actor``."""
        raise NotImplementedError(f"{type(self).__name__}: its critic is not apart from its actor")

    def features(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """What both halves of a policy with ``critic_apart`` compute first from the observations, by no trainable
        parameter (row by row: the rows of a batch's features are those of its rows alone)."""
        raise NotImplementedError(f"{type(self).__name__}: its critic is not apart from its actor")

    def expert_forward_inputs(
        self, obs: Mapping[str, torch.Tensor], actions: torch.Tensor, instructions: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Forward inputs under which ``evaluate`` scores the given action chunks ``[n, chunk, action_dim]``."""
        raise NotImplementedError(f"{type(self).__name__} cannot be trained on demonstrations")

    def bc_loss(
        self, obs: Mapping[str, torch.Tensor], actions: torch.Tensor, instructions: Sequence[str] | None = None
    ) -> torch.Tensor:
        """Mean negative log-likelihood of demonstrated action chunks ``[n, chunk, action_dim]``."""
        inputs = self.expert_forward_inputs(obs, actions, instructions)
        return -self.evaluate(obs, inputs, instructions).log_probs.sum(-1).mean()

"""Action tokens: bins <-> token ids, the head's logits over the action ids, bins <-> (un-normalised) actions."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.nn import functional as F

from rlfleet.policies.base import PolicyOutput, reduce_log_probs


class ActionHeadMixin:
    """The action-token side of ``OpenVLAPolicy``: each action dimension is one of ``n_action_bins`` bins over
    [-1, 1], token id ``action_end - 1 - bin``, decoded to the bin's centre and un-normalised with q01/q99."""

    def _init_action_head(self, action_dim: int, unnorm_stats: Mapping | None) -> None:
        """The bins' centres and the un-normalisation statistics (buffers, not saved with the weights)."""
        centres = torch.linspace(-1.0, 1.0, self.n_bins)
        self.register_buffer("bin_centres", (centres[:-1] + centres[1:]) / 2, persistent=False)
        q01, q99 = (unnorm_stats or {}).get("q01"), (unnorm_stats or {}).get("q99")
        self.register_buffer("q01", torch.tensor(q01 if q01 is not None else [-1.0] * action_dim), persistent=False)
        self.register_buffer("q99", torch.tensor(q99 if q99 is not None else [1.0] * action_dim), persistent=False)
        self.unnorm_stats = dict(unnorm_stats) if unnorm_stats else None  # written back by save_pretrained
        self.unnorm_name = "dataset"  # the dataset_statistics.json key save_pretrained writes them under
        mask = (unnorm_stats or {}).get("mask")  # OpenVLA keeps masked-out dimensions (the gripper) normalised
        self.register_buffer(
            "unnorm_mask",
            torch.tensor(mask if mask is not None else [True] * action_dim, dtype=torch.bool),
            persistent=False,
        )

    def _action_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., H] -> logits over the action ids only [..., n_bins], ordered by bin."""
        head = self._lm()[1]
        lo, hi = self.action_end - self.n_bins, self.action_end
        w = head.weight[lo:hi].flip(0)  # row b = token action_end - 1 - b
        bias = None if head.bias is None else head.bias[lo:hi].flip(0)
        return F.linear(hidden, w, bias) / self.temperature

    def _decode_actions(self, bins: torch.Tensor) -> torch.Tensor:
        """Bins [n, chunk*dim] -> actions [n, chunk, dim] (bin centres, un-normalised)."""
        centres = self.bin_centres[bins.clamp(0, self.n_bins - 2)]
        a = centres.view(-1, self.num_action_chunks, self.action_dim)
        return torch.where(self.unnorm_mask, 0.5 * (a + 1.0) * (self.q99 - self.q01) + self.q01, a)

    def _output(self, bins, logp, value, prompt_ids, prompt_mask) -> PolicyOutput:
        """Sampled bins [n, D] and their log-probs [n, D] -> the PolicyOutput (actions, log-probs at the
        granularity, forward inputs)."""
        per_dim = logp.view(bins.shape[0], self.num_action_chunks, self.action_dim)
        return PolicyOutput(
            self._decode_actions(bins),
            reduce_log_probs(per_dim, self.logprob_type),
            value,
            {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask.to(torch.uint8), "action_bins": bins},
        )

    def action_bins(self, actions: torch.Tensor) -> torch.Tensor:
        """Actions [n, chunk, dim] -> the bins [n, chunk*dim] whose centres decode nearest to them (OpenVLA's
        tokenizer: normalise with q01/q99 where the mask says so, clip to [-1, 1], discretise)."""
        a = actions.to(self.q01.dtype).view(-1, self.num_action_chunks, self.action_dim)
        span = (self.q99 - self.q01).clamp(min=1e-8)
        a = torch.where(self.unnorm_mask, 2.0 * (a - self.q01) / span - 1.0, a).clamp(-1.0, 1.0)
        bins = torch.bucketize(a.reshape(a.shape[0], -1), self.bin_centres)  # nearest centre below or above
        lo = (bins - 1).clamp(min=0)
        hi = bins.clamp(max=self.n_bins - 2)
        flat = a.reshape(a.shape[0], -1)
        closer_lo = (flat - self.bin_centres[lo]).abs() <= (self.bin_centres[hi] - flat).abs()
        return torch.where(closer_lo, lo, hi)

    def set_action_statistics(self, stats: Mapping, name: str = "dataset", proprio: Mapping | None = None) -> None:
        """Un-normalise with these per-dimension q01/q99 (a dataset's ``action_statistics``) from now on, and
        (``use_proprio``) normalise the state with ``proprio``'s; ``save_pretrained`` writes both to
        dataset_statistics.json under ``name``."""
        self.unnorm_name = name
        if proprio is not None and self.proprio_projector is not None:
            self.proprio_q01.copy_(torch.tensor(proprio["q01"], dtype=self.proprio_q01.dtype))
            self.proprio_q99.copy_(torch.tensor(proprio["q99"], dtype=self.proprio_q99.dtype))
            self.proprio_stats = {"q01": list(proprio["q01"]), "q99": list(proprio["q99"])}
        self.q01.copy_(torch.tensor(stats["q01"], dtype=self.q01.dtype))
        self.q99.copy_(torch.tensor(stats["q99"], dtype=self.q99.dtype))
        self.unnorm_stats = {"q01": list(stats["q01"]), "q99": list(stats["q99"]), "mask": self.unnorm_mask.tolist()}

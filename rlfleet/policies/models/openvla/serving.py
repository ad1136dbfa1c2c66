"""Serving hooks for an engine that decodes the action tokens itself (vLLM): act() in three steps, LM weight names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from rlfleet.policies.base import PolicyOutput


class ServingMixin:
    """``OpenVLAPolicy.act`` split in three, for an engine that decodes the action tokens itself from prompt
    embeddings: ``prompt_embeddings`` (vision + projector + token embeddings, and the value), the engine's decode
    restricted to ``action_token_ids``, then ``output_from_tokens``. The result equals act()'s up to the engine's
    arithmetic."""

    @property
    def action_token_ids(self) -> list[int]:
        """The vocabulary ids the action tokens are sampled from (ascending)."""
        return list(range(self.action_end - self.n_bins, self.action_end))

    @torch.no_grad()
    def prompt_embeddings(self, obs: Mapping[str, torch.Tensor], instructions: Sequence[str] | None = None):
        """-> (per-row prompt embeddings [S_i, H] without padding, values [n] or None, forward inputs so far)."""
        if self.parallel:
            raise ValueError("openvla_oft decodes in one bidirectional forward; it has no token-by-token prompt")
        images = obs[self.image_key]
        prompt_ids, prompt_mask = self.tokenize(instructions, images.shape[0], images.device)
        emb, mask = self._prefix(obs, prompt_ids, prompt_mask)
        value = None
        if self.value_head is not None:
            value = self._value(self._forward(emb, mask).last_hidden_state[:, -1])
        rows = [emb[i][mask[i].bool()] for i in range(emb.shape[0])]
        return rows, value, {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}

    def output_from_tokens(
        self, tokens: torch.Tensor, token_log_probs: torch.Tensor, values, prompt_inputs
    ) -> PolicyOutput:
        """Decoded action token ids [n, D] and their log-probs (over the action ids, at this temperature) [n, D]
        -> the PolicyOutput that act() would give for them."""
        bins = (self.action_end - 1 - tokens.long()).to(self.bin_centres.device)
        if bool(((bins < 0) | (bins >= self.n_bins)).any()):
            raise ValueError(
                f"decoded tokens outside the action ids {self.action_end - self.n_bins}.."
                f"{self.action_end - 1}: {tokens.tolist()}"
            )
        return self._output(
            bins, token_log_probs.float(), values, prompt_inputs["prompt_ids"], prompt_inputs["prompt_mask"]
        )


def lm_weight_name(name: str) -> str | None:
    """A checkpoint tensor name -> its name in a Llama causal LM (transformers' and vLLM's ``model.*`` /
    ``lm_head.*``), or None for the parts that are not the language model (vision backbone, projector, value head,
    OFT's action query). Knows rlfleet's layout (``llm.``), OpenVLA's hub layout (``language_model.``) and bare
    LM names; the vLLM backend loads checkpoints and weight updates through it."""
    for prefix in ("llm.", "language_model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name if name.startswith(("model.", "lm_head.")) else None

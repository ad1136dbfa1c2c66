"""OpenVLA's language model as a vLLM out-of-tree model class (imported only inside the vLLM environment).

vLLM serves the Llama part of an OpenVLA policy: rlfleet's policy code embeds ``[BOS][image patches][prompt]``
(vision backbone + projector + token embeddings) and hands vLLM those prompt embeddings; vLLM decodes the action
tokens. The class is vLLM's own Llama with one difference, its weight loader: it takes whole-policy checkpoints
(rlfleet's layout, ``llm.*``, and OpenVLA's hub layout, ``language_model.*``) and weight updates in the policy's
names, keeps the language model's tensors under vLLM's names and skips the rest (vision, projector, value head), so
no separate LM-only copy of a checkpoint is ever written.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM

from rlfleet.policies.models.openvla.serving import lm_weight_name

ARCHITECTURE = "RlfleetOpenVLALanguageModel"


class OpenVLALanguageModel(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((lm, w) for name, w in weights if (lm := lm_weight_name(name)) is not None)


def register() -> None:
    """Make ``ARCHITECTURE`` (written into the serving directory's config.json) resolve to this class."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, OpenVLALanguageModel)

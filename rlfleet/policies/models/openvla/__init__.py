"""OpenVLA and OpenVLA-OFT policies (model types ``openvla`` and ``openvla_oft``) on transformers' classes.

The Prismatic layout of OpenVLA: a vision backbone (SigLIP, optionally fused with DINOv2: patch features
concatenated) -> an MLP projector -> a Llama causal LM. The sequence is ``[BOS] [image patches] [prompt]
[action tokens]`` with OpenVLA's prompt ``In: What action should the robot take to {instruction}?\\nOut:``.
Each action dimension is one token: one of ``n_action_bins`` (256) bins over [-1, 1], whose token id is
``vocab_size - 1 - bin`` (the last 256 ids of the vocabulary, highest id = lowest bin, as OpenVLA), decoded to
the bin's centre (255 centres, as OpenVLA) and un-normalised with per-dataset q01/q99 statistics when
``unnorm_key`` names them.

- ``openvla``: ``action_dim`` tokens decoded one by one (KV cache); sampling restricted to the action ids with
  ``temperature``; deterministic = greedy.
- ``openvla_oft``: ``num_action_chunks x action_dim`` tokens decoded in ONE forward pass: placeholder embeddings
  at the action positions, bidirectional attention among them (causal over the prefix); one inference call returns
  a whole action chunk.

Log-probs (the one implementation for inference and learner): the LM head is applied only at the positions that
predict action tokens and only to the action ids (never full-vocabulary logits over the prefix), divided by the
temperature and log-softmaxed; per-token log-probs are reduced to the configured granularity. ``act`` returns the
prompt token ids, their mask and the sampled action tokens as forward inputs; ``evaluate`` re-runs one teacher-
forced forward over them (with the images from the stored observations). A value head (MLP on the LM's last hidden
state at the last prompt position) is the critic for PPO; GRPO runs without it.

LoRA (``is_lora``, peft): adapters on the LM's projections; the vision backbone, projector and LM base weights are
frozen, and only adapter tensors and the value head are trained (and sent to the inference servers).

A model is built from ``actor.model.vla`` sizes (tiny ones run on CPU in the tests), or from ``model_path``: a
directory in the rlfleet checkpoint layout (``config.json`` with the sizes, ``model.safetensors``, optional
``tokenizer/`` and ``dataset_statistics.json``), loaded with safetensors, never with pickle.

Modules, by role:

- ``architecture``: sizes (``TINY``), ``VisionBackbone``, ``Projector``, the Llama LM and the input layout
- ``action_head``: action bins <-> token ids, logits over the action ids, decoding and un-normalising actions
- ``serving``: the hooks an engine that decodes the action tokens itself (vLLM) calls, ``lm_weight_name``
- ``vllm_model``: the LM as a vLLM out-of-tree model class (imported only inside the vLLM environment)
- ``checkpoint``: building from config, rlfleet's checkpoint layout (save/load), LoRA
- ``hub_layout``: OpenVLA's released hub layout mapped key by key, both ways (loading and ``coordinatorctl export``)
- ``tokenizers``: the prompt and the text tokenizers
- ``policy``: ``OpenVLAPolicy``, the policy interface over the above
"""

from rlfleet.policies.models.openvla.action_head import ActionHeadMixin
from rlfleet.policies.models.openvla.architecture import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    SIGLIP_MEAN,
    SIGLIP_STD,
    TINY,
    OpenVLAArchitecture,
    Projector,
    VisionBackbone,
    count_parameters,
)
from rlfleet.policies.models.openvla.checkpoint import CheckpointMixin, load_checkpoint_dir
from rlfleet.policies.models.openvla.hub_layout import load_openvla_hub_dir
from rlfleet.policies.models.openvla.policy import OpenVLAPolicy
from rlfleet.policies.models.openvla.serving import ServingMixin, lm_weight_name
from rlfleet.policies.models.openvla.tokenizers import (
    PROMPT,
    ByteTokenizer,
    has_tokenizer_files,
    load_hf_tokenizer,
    save_tokenizer,
)

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "PROMPT",
    "SIGLIP_MEAN",
    "SIGLIP_STD",
    "TINY",
    "ActionHeadMixin",
    "ByteTokenizer",
    "CheckpointMixin",
    "OpenVLAArchitecture",
    "OpenVLAPolicy",
    "Projector",
    "ServingMixin",
    "VisionBackbone",
    "count_parameters",
    "has_tokenizer_files",
    "lm_weight_name",
    "load_checkpoint_dir",
    "load_hf_tokenizer",
    "load_openvla_hub_dir",
    "save_tokenizer",
]

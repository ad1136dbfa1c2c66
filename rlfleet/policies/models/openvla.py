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
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from rlfleet.policies.base import PolicyEval, PolicyMixin, PolicyOutput, reduce_log_probs, sample_categorical

PROMPT = "In: What action should the robot take to {instruction}?\nOut:"
SIGLIP_MEAN, SIGLIP_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

# actor.model.vla defaults: a tiny model (a few million parameters) that runs on CPU
TINY = dict(image_size=64, patch_size=16, vision_hidden_size=128, vision_layers=2, vision_heads=4,
            vision_intermediate_size=256, use_dinov2=False, dino_hidden_size=None, dino_layers=None, dino_heads=None,
            dino_intermediate_size=None, dino_registers=0, llm_hidden_size=256, llm_layers=2, llm_heads=4,
            llm_kv_heads=4, llm_intermediate_size=512, llm_rms_norm_eps=1e-6, llm_rope_theta=10000.0,
            vocab_size=1024, action_token_end=None, prompt_suffix_ids=(), n_action_bins=256, value_hidden_size=256)


class ByteTokenizer:
    """A tokenizer that needs no files: UTF-8 bytes as ids 3..258 (pad 0, bos 1, eos 2). Tiny models use it; a
    real checkpoint brings its own (``tokenizer/`` in ``model_path``)."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [3 + b for b in text.encode("utf-8")]


def load_hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    class _Wrapped:
        pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        bos_token_id = tok.bos_token_id
        vocab_size = len(tok)

        def encode(self, text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        def save_pretrained(self, directory) -> None:
            tok.save_pretrained(str(directory))

    return _Wrapped()


def has_tokenizer_files(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def save_tokenizer(tokenizer, path: Path) -> None:
    """A checkpoint's own tokenizer goes into ``tokenizer/`` of the layout rlfleet writes (the byte tokenizer of
    tiny models needs no files)."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(path / "tokenizer")


class VisionBackbone(nn.Module):
    """SigLIP, optionally fused with DINOv2 (with register tokens, as OpenVLA's dinosiglip) -> patch features
    [n, patches, dim]. Like Prismatic, features come from each encoder's second-to-last layer, DINOv2's first."""

    def __init__(self, sizes: Mapping):
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        self.image_size = int(sizes["image_size"])
        patch = int(sizes["patch_size"])
        self.siglip = SiglipVisionModel(SiglipVisionConfig(
            image_size=self.image_size, patch_size=patch, hidden_size=int(sizes["vision_hidden_size"]),
            num_hidden_layers=int(sizes["vision_layers"]), num_attention_heads=int(sizes["vision_heads"]),
            intermediate_size=int(sizes["vision_intermediate_size"]), vision_use_head=False))
        self.dino, self.dino_skip = None, 0
        self.out_dim = int(sizes["vision_hidden_size"])
        if sizes.get("use_dinov2"):
            from transformers import Dinov2Config, Dinov2Model, Dinov2WithRegistersConfig, Dinov2WithRegistersModel

            width = int(sizes.get("dino_hidden_size") or sizes["vision_hidden_size"])
            inter = int(sizes.get("dino_intermediate_size") or sizes["vision_intermediate_size"])
            registers = int(sizes.get("dino_registers") or 0)
            if inter % width:
                raise ValueError(f"actor.model.vla.dino_intermediate_size {inter} must be a multiple of the DINOv2 "
                                 f"width {width}")
            kw = dict(image_size=self.image_size, patch_size=patch, hidden_size=width, mlp_ratio=inter // width,
                      num_hidden_layers=int(sizes.get("dino_layers") or sizes["vision_layers"]),
                      num_attention_heads=int(sizes.get("dino_heads") or sizes["vision_heads"]), layerscale_value=1.0)
            self.dino = Dinov2WithRegistersModel(Dinov2WithRegistersConfig(num_register_tokens=registers, **kw)) \
                if registers else Dinov2Model(Dinov2Config(**kw))
            self.dino_skip = 1 + registers  # CLS and register tokens are not patches
            self.out_dim += width
        self.num_patches = (self.image_size // patch) ** 2
        for name, mean, std in (("siglip", SIGLIP_MEAN, SIGLIP_STD), ("dino", IMAGENET_MEAN, IMAGENET_STD)):
            self.register_buffer(f"{name}_mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
            self.register_buffer(f"{name}_std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [n, H, W, 3] -> [n, patches, out_dim]."""
        x = images.permute(0, 3, 1, 2).to(self.siglip_mean.dtype) / 255.0
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        feats = self.siglip(pixel_values=(x - self.siglip_mean) / self.siglip_std,
                            output_hidden_states=True).hidden_states[-2]
        if self.dino is not None:
            dino = self.dino(pixel_values=(x - self.dino_mean) / self.dino_std,
                             output_hidden_states=True).hidden_states[-2][:, self.dino_skip:]
            feats = torch.cat([dino, feats], dim=-1)
        return feats


class Projector(nn.Module):
    """Prismatic's MLP projector: GELU MLP from patch features to the LM width (3 layers when fused)."""

    def __init__(self, vision_dim: int, llm_dim: int, fused: bool):
        super().__init__()
        if fused:
            mid = 4 * vision_dim
            self.net = nn.Sequential(nn.Linear(vision_dim, mid), nn.GELU(), nn.Linear(mid, llm_dim), nn.GELU(),
                                     nn.Linear(llm_dim, llm_dim))
        else:
            self.net = nn.Sequential(nn.Linear(vision_dim, llm_dim), nn.GELU(), nn.Linear(llm_dim, llm_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class OpenVLAPolicy(PolicyMixin, nn.Module):
    def __init__(self, obs_specs: Mapping, action_dim: int, *, model_type: str = "openvla",
                 sizes: Mapping | None = None, num_action_chunks: int = 1, temperature: float = 1.0,
                 image_key: str | None = None, max_prompt_tokens: int = 64, add_value_head: bool = True,
                 is_lora: bool = False, lora_rank: int = 32, gradient_checkpointing: bool = False,
                 unnorm_stats: Mapping | None = None, tokenizer=None, logprob_type: str = "token_level",
                 use_proprio: bool = False, proprio_stats: Mapping | None = None,
                 extra_image_keys: Sequence[str] = ()):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model_type, self.parallel = model_type, model_type == "openvla_oft"
        if not self.parallel and num_action_chunks != 1:
            raise ValueError(f"model_type 'openvla' decodes one action per call; num_action_chunks="
                             f"{num_action_chunks} needs 'openvla_oft'")
        self.sizes = {**TINY, **dict(sizes or {})}
        images = sorted(k for k, s in obs_specs.items() if s.is_image)
        if not images:
            raise ValueError(f"model_type '{model_type}' needs an image observation; the env provides "
                             f"{sorted(obs_specs)}")
        if image_key is not None and image_key not in images:
            raise ValueError(f"actor.model.image_key: '{image_key}' is not an image observation ({images})")
        self.image_key = image_key or images[0]
        # OpenVLA-OFT's num_images_in_input > 1: further cameras, each through the same vision backbone and
        # projector, their patches after the first image's (LIBERO: the third-person view, then the wrist)
        self.extra_image_keys = [str(k) for k in extra_image_keys]
        if self.extra_image_keys and model_type != "openvla_oft":
            raise ValueError(f"actor.model.extra_image_keys: more than one image is OpenVLA-OFT's; model_type is "
                             f"'{model_type}'")
        for k in self.extra_image_keys:
            if k not in images:
                raise ValueError(f"actor.model.extra_image_keys: '{k}' is not an image observation ({images})")
        if len(set([self.image_key, *self.extra_image_keys])) != 1 + len(self.extra_image_keys):
            raise ValueError(f"actor.model.extra_image_keys: {self.extra_image_keys} repeats a camera (image_key is "
                             f"'{self.image_key}')")
        if use_proprio and model_type != "openvla_oft":
            raise ValueError(f"actor.model.use_proprio: the proprio projector is OpenVLA-OFT's; model_type is "
                             f"'{model_type}'")
        if use_proprio and ("state" not in obs_specs or obs_specs["state"].is_image):
            raise ValueError(f"actor.model.use_proprio: the env has no 'state' observation ({sorted(obs_specs)})")
        self.proprio_dim = int(np.prod(obs_specs["state"].shape)) if use_proprio else 0
        self.obs_specs, self.action_dim = dict(obs_specs), int(action_dim)
        self.num_action_chunks, self.logprob_type = int(num_action_chunks), logprob_type
        self.has_critic = bool(add_value_head)
        if temperature <= 0:
            raise ValueError(f"actor.model.temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)
        self.max_prompt_tokens = int(max_prompt_tokens)
        self.tokenizer = tokenizer or ByteTokenizer()
        s = self.sizes
        self.vocab_size, self.n_bins = int(s["vocab_size"]), int(s["n_action_bins"])
        # action ids are the last n_bins ids of the tokenizer's vocabulary (OpenVLA: 32000, the embedding table is
        # padded to 32064)
        self.action_end = int(s["action_token_end"] or self.vocab_size)
        self.prompt_suffix = [int(t) for t in (s.get("prompt_suffix_ids") or ())]
        if self.action_end - self.n_bins < self.tokenizer.vocab_size and isinstance(self.tokenizer, ByteTokenizer):
            raise ValueError(f"actor.model.vla.vocab_size {self.vocab_size} leaves no room for {self.n_bins} action "
                             f"ids after the {self.tokenizer.vocab_size} text ids")
        self.vision = VisionBackbone(s)
        llm_cfg = LlamaConfig(vocab_size=self.vocab_size, hidden_size=int(s["llm_hidden_size"]),
                              intermediate_size=int(s["llm_intermediate_size"]),
                              num_hidden_layers=int(s["llm_layers"]), num_attention_heads=int(s["llm_heads"]),
                              num_key_value_heads=int(s["llm_kv_heads"]), rms_norm_eps=float(s["llm_rms_norm_eps"]),
                              rope_theta=float(s["llm_rope_theta"]),
                              max_position_embeddings=2 + self.vision.num_patches * self.num_images
                              + (1 if use_proprio else 0) + self.max_prompt_tokens
                              + self.num_action_chunks * self.action_dim + 8,
                              pad_token_id=self.tokenizer.pad_token_id, bos_token_id=self.tokenizer.bos_token_id)
        self.llm = LlamaForCausalLM(llm_cfg)
        self.projector = Projector(self.vision.out_dim, llm_cfg.hidden_size, fused=bool(s["use_dinov2"]))
        self.action_query = nn.Parameter(torch.zeros(llm_cfg.hidden_size)) if self.parallel else None
        # OpenVLA-OFT's proprio projector: the normalised `state` observation -> one token after the image patches
        H = llm_cfg.hidden_size
        self.proprio_projector = nn.Sequential(nn.Linear(self.proprio_dim, H), nn.GELU(), nn.Linear(H, H)) \
            if use_proprio else None
        pq01, pq99 = (proprio_stats or {}).get("q01"), (proprio_stats or {}).get("q99")
        self.register_buffer("proprio_q01", torch.tensor(pq01 if pq01 is not None else [-1.0] * self.proprio_dim),
                             persistent=False)
        self.register_buffer("proprio_q99", torch.tensor(pq99 if pq99 is not None else [1.0] * self.proprio_dim),
                             persistent=False)
        self.proprio_stats = dict(proprio_stats) if proprio_stats and use_proprio else None
        self.value_head = nn.Sequential(nn.Linear(llm_cfg.hidden_size, int(s["value_hidden_size"])), nn.GELU(),
                                        nn.Linear(int(s["value_hidden_size"]), 1)) if add_value_head else None
        centres = torch.linspace(-1.0, 1.0, self.n_bins)
        self.register_buffer("bin_centres", (centres[:-1] + centres[1:]) / 2, persistent=False)
        q01, q99 = (unnorm_stats or {}).get("q01"), (unnorm_stats or {}).get("q99")
        self.register_buffer("q01", torch.tensor(q01 if q01 is not None else [-1.0] * action_dim), persistent=False)
        self.register_buffer("q99", torch.tensor(q99 if q99 is not None else [1.0] * action_dim), persistent=False)
        self.unnorm_stats = dict(unnorm_stats) if unnorm_stats else None  # written back by save_pretrained
        self.unnorm_name = "dataset"  # the dataset_statistics.json key save_pretrained writes them under
        mask = (unnorm_stats or {}).get("mask")  # OpenVLA keeps masked-out dimensions (the gripper) normalised
        self.register_buffer("unnorm_mask", torch.tensor(mask if mask is not None else [True] * action_dim,
                                                         dtype=torch.bool), persistent=False)
        if gradient_checkpointing:
            # transformers >= 5.23 names it activation checkpointing (the vLLM environment's older one does not)
            enable = getattr(self.llm, "activation_checkpointing_enable", None) or self.llm.gradient_checkpointing_enable
            enable()
        self.is_lora = False
        if is_lora:
            self.enable_lora(lora_rank)

    # --- the layout ---------------------------------------------------------------------------------------------
    @property
    def num_action_tokens(self) -> int:
        return self.num_action_chunks * self.action_dim

    @property
    def image_keys(self) -> list[str]:
        """The cameras the policy sees, in the order of their patches."""
        return [self.image_key, *self.extra_image_keys]

    @property
    def num_images(self) -> int:
        return 1 + len(self.extra_image_keys)

    def _lm(self):
        """The Llama body and LM head (through the peft wrapper when LoRA is on)."""
        base = self.llm.get_base_model() if self.is_lora else self.llm
        return base.model, base.lm_head

    def tokenize(self, instructions: Sequence[str] | None, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> left-padded ids [n, P] and mask [n, P] (the last P tokens of a longer prompt are kept)."""
        P = self.max_prompt_tokens
        ids = torch.full((n, P), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, P), dtype=torch.long)
        texts = list(instructions) if instructions else [""] * n
        for i, text in enumerate(texts):
            toks = self.tokenizer.encode(PROMPT.format(instruction=(text or "").strip().lower().rstrip(".")))
            toks = (toks + self.prompt_suffix)[-P:]
            if toks:
                ids[i, P - len(toks):] = torch.tensor(toks)
                mask[i, P - len(toks):] = 1
        return ids.to(device), mask.to(device)

    def _prefix(self, obs: Mapping[str, torch.Tensor], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """-> embeddings [n, S, H] and mask [n, S] of [BOS][patches of each camera][proprio, with use_proprio]
        [prompt]."""
        embed = self._lm()[0].embed_tokens
        images = obs[self.image_key]
        n = images.shape[0]
        # every camera through the backbone in one call (stacked along the batch), then side by side per sample
        cams = [obs[k] for k in self.image_keys]
        if len(cams) > 1 and any(c.shape != images.shape for c in cams):
            raise ValueError(f"cameras {list(self.image_keys)} have shapes {[tuple(c.shape) for c in cams]}: "
                             "the vision backbone needs every camera at one image size")
        patches = self.projector(self.vision(torch.cat(cams, 0) if len(cams) > 1 else images))
        if len(cams) > 1:
            patches = torch.cat(patches.split(n, 0), 1)
        bos = embed(torch.full((n, 1), self.tokenizer.bos_token_id, dtype=torch.long, device=images.device))
        if self.proprio_projector is not None:  # normalised to [-1, 1] by the demonstrations' q01/q99
            state = obs["state"].reshape(n, -1).to(self.proprio_q01.dtype)
            span = (self.proprio_q99 - self.proprio_q01).clamp(min=1e-8)
            proprio = self.proprio_projector(2.0 * (state - self.proprio_q01) / span - 1.0)[:, None]
            patches = torch.cat([patches, proprio.to(patches.dtype)], 1)
        emb = torch.cat([bos, patches.to(bos.dtype), embed(prompt_ids)], dim=1)
        mask = torch.cat([torch.ones((n, 1 + patches.shape[1]), dtype=torch.long, device=images.device),
                          prompt_mask.long()], dim=1)
        return emb, mask

    def _action_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., H] -> logits over the action ids only [..., n_bins], ordered by bin."""
        head = self._lm()[1]
        lo, hi = self.action_end - self.n_bins, self.action_end
        w = head.weight[lo:hi].flip(0)  # row b = token action_end - 1 - b
        bias = None if head.bias is None else head.bias[lo:hi].flip(0)
        return F.linear(hidden, w, bias) / self.temperature

    def _value(self, hidden_last_prompt: torch.Tensor) -> torch.Tensor | None:
        if self.value_head is None:
            return None
        return self.value_head(hidden_last_prompt.float()).squeeze(-1)

    def _decode_actions(self, bins: torch.Tensor) -> torch.Tensor:
        """Bins [n, chunk*dim] -> actions [n, chunk, dim] (bin centres, un-normalised)."""
        centres = self.bin_centres[bins.clamp(0, self.n_bins - 2)]
        a = centres.view(-1, self.num_action_chunks, self.action_dim)
        return torch.where(self.unnorm_mask, 0.5 * (a + 1.0) * (self.q99 - self.q01) + self.q01, a)

    def _bidirectional_mask(self, mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
        """4D bool mask: causal over the prefix, action positions see the prefix and each other."""
        n, S = mask.shape
        m = torch.tril(torch.ones(S, S, dtype=torch.bool, device=mask.device))
        m[prefix_len:, prefix_len:] = True
        return (m[None] & mask.bool()[:, None, :])[:, None]

    def _forward(self, emb, mask, **kw):
        body = self._lm()[0]
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)
        return body(inputs_embeds=emb, attention_mask=mask, position_ids=position_ids, **kw)

    # --- the policy interface -----------------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: Mapping[str, torch.Tensor], deterministic: bool = False,
            instructions: Sequence[str] | None = None, noise=None) -> PolicyOutput:
        images = obs[self.image_key]
        n = images.shape[0]
        prompt_ids, prompt_mask = self.tokenize(instructions, n, images.device)
        emb, mask = self._prefix(obs, prompt_ids, prompt_mask)
        S, D = emb.shape[1], self.num_action_tokens
        if self.parallel:
            queries = self.action_query.to(emb.dtype).expand(n, D, -1)
            full_mask = torch.cat([mask, torch.ones((n, D), dtype=torch.long, device=mask.device)], 1)
            body = self._lm()[0]
            hidden = body(inputs_embeds=torch.cat([emb, queries], 1),
                          attention_mask=self._bidirectional_mask(full_mask, S),
                          position_ids=(full_mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state
            logits = self._action_logits(hidden[:, S:])
            bins = logits.argmax(-1) if deterministic else sample_categorical(logits, noise)
            logp = torch.log_softmax(logits.float(), -1).gather(-1, bins[..., None]).squeeze(-1)
            value = self._value(hidden[:, S - 1])
        else:
            out = self._forward(emb, mask, use_cache=True)
            cache, h = out.past_key_values, out.last_hidden_state[:, -1]
            value = self._value(h)
            bins_l, logp_l = [], []
            embed = self._lm()[0].embed_tokens
            for t in range(D):
                logits = self._action_logits(h)
                b = logits.argmax(-1) if deterministic else sample_categorical(logits, noise)
                bins_l.append(b)
                logp_l.append(torch.log_softmax(logits.float(), -1).gather(-1, b[:, None]).squeeze(-1))
                if t == D - 1:
                    break
                mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long, device=mask.device)], 1)
                tok = (self.action_end - 1 - b)[:, None]
                pos = (mask.sum(1, keepdim=True) - 1)
                h = self._lm()[0](inputs_embeds=embed(tok), attention_mask=mask, position_ids=pos,
                                  past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
            bins, logp = torch.stack(bins_l, 1), torch.stack(logp_l, 1)
        return self._output(bins, logp, value, prompt_ids, prompt_mask)

    def _output(self, bins, logp, value, prompt_ids, prompt_mask) -> PolicyOutput:
        """Sampled bins [n, D] and their log-probs [n, D] -> the PolicyOutput (actions, log-probs at the
        granularity, forward inputs)."""
        per_dim = logp.view(bins.shape[0], self.num_action_chunks, self.action_dim)
        return PolicyOutput(self._decode_actions(bins), reduce_log_probs(per_dim, self.logprob_type), value,
                            {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask.to(torch.uint8),
                             "action_bins": bins})

    # --- decoding by another engine (the vLLM backend) ---------------------------------------------------------
    # act() split in three, for an engine that decodes the action tokens itself from prompt embeddings:
    # prompt_embeddings (vision + projector + token embeddings, and the value), the engine's decode restricted to
    # action_token_ids, then output_from_tokens. The result equals act()'s up to the engine's arithmetic.
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

    def output_from_tokens(self, tokens: torch.Tensor, token_log_probs: torch.Tensor, values, prompt_inputs
                           ) -> PolicyOutput:
        """Decoded action token ids [n, D] and their log-probs (over the action ids, at this temperature) [n, D]
        -> the PolicyOutput that act() would give for them."""
        bins = (self.action_end - 1 - tokens.long()).to(self.bin_centres.device)
        if bool(((bins < 0) | (bins >= self.n_bins)).any()):
            raise ValueError(f"decoded tokens outside the action ids {self.action_end - self.n_bins}.."
                             f"{self.action_end - 1}: {tokens.tolist()}")
        return self._output(bins, token_log_probs.float(), values, prompt_inputs["prompt_ids"],
                            prompt_inputs["prompt_mask"])

    def evaluate(self, obs: Mapping[str, torch.Tensor], forward_inputs: Mapping[str, torch.Tensor],
                 instructions: Sequence[str] | None = None) -> PolicyEval:
        images = obs[self.image_key]
        bins = forward_inputs["action_bins"].long()
        emb, mask = self._prefix(obs, forward_inputs["prompt_ids"].long(), forward_inputs["prompt_mask"].long())
        n, S, D = emb.shape[0], emb.shape[1], self.num_action_tokens
        if self.parallel:
            queries = self.action_query.to(emb.dtype).expand(n, D, -1)
            full_mask = torch.cat([mask, torch.ones((n, D), dtype=torch.long, device=mask.device)], 1)
            hidden = self._lm()[0](inputs_embeds=torch.cat([emb, queries], 1),
                                   attention_mask=self._bidirectional_mask(full_mask, S),
                                   position_ids=(full_mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state
            predicting = hidden[:, S:]
        else:  # teacher forcing: the prefix and all but the last action token; keep only the predicting positions
            embed = self._lm()[0].embed_tokens
            toks = (self.action_end - 1 - bins[:, :-1])
            full_mask = torch.cat([mask, torch.ones((n, D - 1), dtype=torch.long, device=mask.device)], 1)
            hidden = self._forward(torch.cat([emb, embed(toks)], 1), full_mask).last_hidden_state
            predicting = hidden[:, S - 1:]
        logits = self._action_logits(predicting).float()
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, bins[..., None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1).sum(-1)
        per_dim = logp.view(n, self.num_action_chunks, self.action_dim)
        return PolicyEval(reduce_log_probs(per_dim, self.logprob_type), entropy, self._value(hidden[:, S - 1]))

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

    def expert_forward_inputs(self, obs, actions, instructions=None) -> dict[str, torch.Tensor]:
        images = obs[self.image_key]
        prompt_ids, prompt_mask = self.tokenize(instructions, images.shape[0], images.device)
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask.to(torch.uint8),
                "action_bins": self.action_bins(actions)}

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
        self.unnorm_stats = {"q01": list(stats["q01"]), "q99": list(stats["q99"]),
                             "mask": self.unnorm_mask.tolist()}

    # --- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, model_cfg, obs_specs: Mapping, action_dim: int, normalize_obs: bool,
                    logprob_type: str = "token_level") -> OpenVLAPolicy:
        sizes = {k: (list(v) if k == "prompt_suffix_ids" else v) for k, v in model_cfg.vla.items()}
        tokenizer, stats, state = None, None, None
        if model_cfg.model_path:
            sizes, tokenizer, stats, state = load_checkpoint_dir(model_cfg.model_path, model_cfg.unnorm_key, sizes)
        policy = cls(obs_specs, action_dim, model_type=model_cfg.model_type, sizes=sizes,
                     num_action_chunks=model_cfg.num_action_chunks, temperature=model_cfg.temperature,
                     image_key=model_cfg.image_key, max_prompt_tokens=model_cfg.max_prompt_tokens,
                     add_value_head=model_cfg.add_value_head, is_lora=False,
                     gradient_checkpointing=model_cfg.gradient_checkpointing,
                     unnorm_stats=stats["action"] if stats else None, tokenizer=tokenizer, logprob_type=logprob_type,
                     use_proprio=model_cfg.use_proprio, proprio_stats=stats["proprio"] if stats else None,
                     extra_image_keys=list(model_cfg.extra_image_keys or ()))
        if model_cfg.model_path:
            _check_cameras(Path(model_cfg.model_path), policy.image_keys)
        if state is not None:
            missing, unexpected = policy.load_state_dict(state, strict=False)
            # a fresh critic is expected; DINOv2's mask token is never used for inference; OpenVLA-OFT's released
            # checkpoints have no action query: OFT zeroes the action positions' embeddings, as its zero init does
            missing = [k for k in missing if not k.startswith("value_head.") and not k.endswith("mask_token")
                       and k != "action_query"]
            if missing or unexpected:
                hint = ""
                if any(k.startswith("proprio_projector.") for k in missing + unexpected):
                    hint = (f"; the checkpoint was trained {'without' if model_cfg.use_proprio else 'with'} a "
                            f"proprio projector: set actor.model.use_proprio={str(not model_cfg.use_proprio).lower()}")
                raise ValueError(f"{model_cfg.model_path}/model.safetensors: missing tensors {missing[:3]}, "
                                 f"unexpected {unexpected[:3]}{hint}")
        if model_cfg.is_lora:
            policy.enable_lora(model_cfg.lora_rank)
        return policy

    def enable_lora(self, rank: int) -> None:
        from peft import LoraConfig, get_peft_model

        for p in self.parameters():
            p.requires_grad_(False)
        with warnings.catch_warnings():  # peft asks transformers a deprecated question; nothing for users to do
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            self.llm = get_peft_model(self.llm, LoraConfig(
                r=int(rank), lora_alpha=int(rank), lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        for head in (self.value_head, self.proprio_projector):  # new modules train in full (OFT trains its projector)
            if head is not None:
                for p in head.parameters():
                    p.requires_grad_(True)
        self.is_lora = True

    @property
    def trains_adapters_only(self) -> bool:
        # enable_lora freezes every base weight; the value head does not touch log-probs, a proprio projector does
        return self.is_lora and self.proprio_projector is None

    @contextlib.contextmanager
    def adapters_disabled(self):
        if not self.is_lora:
            raise NotImplementedError("OpenVLAPolicy: no adapters to disable (actor.model.is_lora is false)")
        with self.llm.disable_adapter():
            yield

    def save_pretrained(self, path: str | Path) -> None:
        """Write this model in the checkpoint layout ``model_path`` loads (LoRA merged into the base weights)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        llm = self.llm.merge_and_unload() if self.is_lora else self.llm
        state = {f"llm.{k}": v for k, v in llm.state_dict().items()}
        state.update({k: v for k, v in self.state_dict().items() if not k.startswith("llm.")})
        save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({"model_type": self.model_type, "vla": self.sizes,
                                                      "num_images_in_input": self.num_images,
                                                      "image_keys": self.image_keys}, indent=2))
        save_tokenizer(self.tokenizer, path)
        if self.unnorm_stats:
            entry = {"action": self.unnorm_stats, **({"proprio": self.proprio_stats} if self.proprio_stats else {})}
            (path / "dataset_statistics.json").write_text(json.dumps({self.unnorm_name: entry},
                                                                     indent=1))
        if self.is_lora:  # the adapters are merged now: this object goes on as the merged model
            self.llm = llm
            self.is_lora = False


def load_checkpoint_dir(path: str | Path, unnorm_key: str | None, fallback: Mapping | None = None):
    """A checkpoint directory -> (sizes, tokenizer or None, dataset statistics ``{"action", "proprio"}`` or None,
    state dict). Two
    layouts: rlfleet's (``save_pretrained``) and OpenVLA's own hub layout (``openvla/openvla-7b``: Prismatic's
    timm key names, sharded safetensors, ``norm_stats`` in config.json), mapped key by key without remote code."""
    from safetensors.torch import load_file

    path = Path(path)
    if (path / "config.json").is_file() and "vision_backbone_id" in json.loads((path / "config.json").read_text()):
        return load_openvla_hub_dir(path, unnorm_key, fallback)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"actor.model.model_path: {path} needs config.json and model.safetensors "
                                f"(rlfleet's VLA checkpoint layout)")
    cfg = json.loads((path / "config.json").read_text())
    sizes = {**TINY, **cfg.get("vla", {})}
    tokenizer = load_hf_tokenizer(path / "tokenizer") if (path / "tokenizer").is_dir() else None
    stats_file = path / "dataset_statistics.json"
    stats = _pick_stats(json.loads(stats_file.read_text()) if stats_file.is_file() else {}, unnorm_key, stats_file)
    return sizes, tokenizer, stats, load_file(str(path / "model.safetensors"))


def _check_cameras(path: Path, image_keys: Sequence[str]) -> None:
    """A checkpoint trained on N cameras (config.json ``num_images_in_input``, OpenVLA-OFT's name) loads into a
    policy that sees N cameras: the weights alone cannot tell, the patch sequence the LM learned can."""
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    n = cfg.get("num_images_in_input")
    if n is not None and int(n) != len(image_keys):
        trained = cfg.get("image_keys") or f"{n} cameras"
        raise ValueError(f"actor.model.model_path: {path} was trained on {n} image(s) ({trained}); this policy sees "
                         f"{len(image_keys)} ({list(image_keys)}): set actor.model.image_key and "
                         f"actor.model.extra_image_keys to match")


def lm_weight_name(name: str) -> str | None:
    """A checkpoint tensor name -> its name in a Llama causal LM (transformers' and vLLM's ``model.*`` /
    ``lm_head.*``), or None for the parts that are not the language model (vision backbone, projector, value head,
    OFT's action query). Knows rlfleet's layout (``llm.``), OpenVLA's hub layout (``language_model.``) and bare
    LM names; the vLLM backend loads checkpoints and weight updates through it."""
    for prefix in ("llm.", "language_model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name if name.startswith(("model.", "lm_head.")) else None


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """-> (all parameters, trainable parameters)."""
    total = sum(p.numel() for p in model.parameters())
    return total, sum(p.numel() for p in model.parameters() if p.requires_grad)


def _pick_stats(all_stats: Mapping, unnorm_key: str | None, where: Path):
    if not unnorm_key:
        return None
    if unnorm_key not in all_stats:
        raise KeyError(f"actor.model.unnorm_key: '{unnorm_key}' is not in {where} (has: {sorted(all_stats) or 'none'})")
    entry = all_stats[unnorm_key]
    return {"action": entry.get("action", entry), "proprio": entry.get("proprio")}


def _read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a directory's safetensors (sharded with model.safetensors.index.json, or one file)."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"actor.model.model_path: no *.safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state


def _vit_blocks(state: Mapping, prefix: str) -> int:
    return len({k[len(prefix):].split(".")[0] for k in state if k.startswith(prefix)})


def _heads_for(timm_id: str | None, fallback: int) -> int:
    """Attention heads are not in the weights: from the timm model id (Prismatic's backbones), else the config."""
    known = {"so400m": 16, "large": 16, "vit_l": 16, "base": 12, "vit_b": 12, "small": 6, "vit_s": 6}
    for key, heads in known.items():
        if timm_id and key in timm_id:
            return heads
    return int(fallback)


def _map_timm_vit(state: Mapping, src: str, dst: str, n_blocks: int, dino: bool) -> dict[str, torch.Tensor]:
    """Prismatic's timm ViT keys (``src``) -> transformers' SigLIP / DINOv2 keys (``dst``)."""
    out: dict[str, torch.Tensor] = {}
    emb = f"{dst}embeddings."
    if dino:
        out[f"{emb}patch_embeddings.projection.weight"] = state[f"{src}patch_embed.proj.weight"]
        out[f"{emb}patch_embeddings.projection.bias"] = state[f"{src}patch_embed.proj.bias"]
        out[f"{emb}cls_token"] = state[f"{src}cls_token"]
        pos = state[f"{src}pos_embed"]  # patches only (timm no_embed_class): the CLS position adds nothing
        out[f"{emb}position_embeddings"] = torch.cat([torch.zeros_like(pos[:, :1]), pos], 1)
        if f"{src}reg_token" in state:
            out[f"{emb}register_tokens"] = state[f"{src}reg_token"]
        out[f"{dst}layernorm.weight"], out[f"{dst}layernorm.bias"] = state[f"{src}norm.weight"], state[f"{src}norm.bias"]
    else:
        out[f"{emb}patch_embedding.weight"] = state[f"{src}patch_embed.proj.weight"]
        out[f"{emb}patch_embedding.bias"] = state[f"{src}patch_embed.proj.bias"]
        out[f"{emb}position_embedding.weight"] = state[f"{src}pos_embed"][0]
        out[f"{dst}post_layernorm.weight"] = state[f"{src}norm.weight"]
        out[f"{dst}post_layernorm.bias"] = state[f"{src}norm.bias"]
    for i in range(n_blocks):
        b = f"{src}blocks.{i}."
        d = f"{dst}encoder.layer.{i}." if dino else f"{dst}encoder.layers.{i}."
        att = f"{d}attention." if dino else f"{d}self_attn."
        names = ("q_proj", "k_proj", "v_proj")
        for kind in ("weight", "bias"):
            for name, part in zip(names, state[f"{b}attn.qkv.{kind}"].chunk(3, dim=0)):
                out[f"{att}{name}.{kind}"] = part
            out[f"{att}{'o_proj' if dino else 'out_proj'}.{kind}"] = state[f"{b}attn.proj.{kind}"]
            out[f"{d}{'norm1' if dino else 'layer_norm1'}.{kind}"] = state[f"{b}norm1.{kind}"]
            out[f"{d}{'norm2' if dino else 'layer_norm2'}.{kind}"] = state[f"{b}norm2.{kind}"]
            out[f"{d}mlp.fc1.{kind}"] = state[f"{b}mlp.fc1.{kind}"]
            out[f"{d}mlp.fc2.{kind}"] = state[f"{b}mlp.fc2.{kind}"]
        if dino:
            out[f"{d}layer_scale1.lambda1"] = state[f"{b}ls1.scale_factor"]
            out[f"{d}layer_scale2.lambda1"] = state[f"{b}ls2.scale_factor"]
    return out


def load_openvla_hub_dir(path: Path, unnorm_key: str | None, fallback: Mapping | None = None):
    """OpenVLA's released layout -> (sizes, tokenizer, stats, state dict in this policy's names). Sizes come from
    the weights' shapes and config.json; what neither holds (attention heads of an unknown ViT) from ``fallback``
    (``actor.model.vla``)."""
    cfg = json.loads((path / "config.json").read_text())
    fallback = {**TINY, **dict(fallback or {})}
    timm_ids = list(cfg.get("timm_model_ids") or [])
    state = _read_safetensors_dir(path)
    fused = any(k.startswith("vision_backbone.fused_featurizer.") for k in state)
    sig_src = "vision_backbone.fused_featurizer." if fused else "vision_backbone.featurizer."
    sig_w = state[f"{sig_src}patch_embed.proj.weight"]
    text = cfg.get("text_config", {})
    vocab = int(state["language_model.lm_head.weight"].shape[0])
    sizes = {**TINY, "patch_size": int(sig_w.shape[-1]), "vision_hidden_size": int(sig_w.shape[0]),
             "vision_layers": _vit_blocks(state, f"{sig_src}blocks."), "vision_heads": _heads_for(timm_ids[-1] if timm_ids else None, fallback["vision_heads"]),
             "vision_intermediate_size": int(state[f"{sig_src}blocks.0.mlp.fc1.weight"].shape[0]),
             "image_size": int((cfg.get("image_sizes") or [224])[0]), "use_dinov2": fused,
             "llm_hidden_size": int(state["language_model.model.embed_tokens.weight"].shape[1]),
             "llm_layers": _vit_blocks(state, "language_model.model.layers."),
             "llm_heads": int(text.get("num_attention_heads", 32)),
             "llm_kv_heads": int(text.get("num_key_value_heads") or text.get("num_attention_heads", 32)),
             "llm_intermediate_size": int(state["language_model.model.layers.0.mlp.gate_proj.weight"].shape[0]),
             "llm_rms_norm_eps": float(text.get("rms_norm_eps", 1e-5)),
             "llm_rope_theta": float(text.get("rope_theta", 10000.0)), "vocab_size": vocab,
             "action_token_end": vocab - int(cfg.get("pad_to_multiple_of", 0)),
             "n_action_bins": int(cfg.get("n_action_bins", 256)),
             "prompt_suffix_ids": [29871] if vocab - int(cfg.get("pad_to_multiple_of", 0)) == 32000 else []}
    mapped = _map_timm_vit(state, sig_src, "vision.siglip.", sizes["vision_layers"], dino=False)
    if fused:
        src = "vision_backbone.featurizer."
        dw = state[f"{src}patch_embed.proj.weight"]
        sizes.update(dino_hidden_size=int(dw.shape[0]), dino_layers=_vit_blocks(state, f"{src}blocks."),
                     dino_heads=_heads_for(timm_ids[0] if timm_ids else None,
                                           fallback["dino_heads"] or fallback["vision_heads"]),
                     dino_intermediate_size=int(state[f"{src}blocks.0.mlp.fc1.weight"].shape[0]),
                     dino_registers=int(state[f"{src}reg_token"].shape[1]) if f"{src}reg_token" in state else 0)
        mapped.update(_map_timm_vit(state, src, "vision.dino.", sizes["dino_layers"], dino=True))
    for i, fc in enumerate(("fc1", "fc2", "fc3") if fused else ("fc1", "fc2")):
        for kind in ("weight", "bias"):
            mapped[f"projector.net.{2 * i}.{kind}"] = state[f"projector.{fc}.{kind}"]
    for k, v in state.items():
        if k.startswith("language_model."):
            mapped["llm." + k[len("language_model."):]] = v
    mapped.update(_load_oft_components(path))
    tokenizer = load_hf_tokenizer(path) if has_tokenizer_files(path) else None
    stats = _pick_stats(cfg.get("norm_stats", {}), unnorm_key, path / "config.json")
    return sizes, tokenizer, stats, mapped


def _load_oft_components(path: Path) -> dict[str, torch.Tensor]:
    """OpenVLA-OFT's released checkpoints keep the proprio projector beside the VLA, in
    ``proprio_projector--<step>_checkpoint.pt`` (a state dict of fc1/fc2, ``module.``-prefixed when saved from DDP)
    -> this policy's ``proprio_projector.*`` names. A checkpoint whose actions come from a separate action head
    (``action_head--*.pt``: OFT's L1-regression or diffusion head) is refused: rlfleet decodes action tokens."""
    heads = sorted(path.glob("action_head--*.pt"))
    if heads:
        raise ValueError(f"actor.model.model_path: {path} predicts continuous actions with {heads[0].name} (OpenVLA-OFT's "
                         f"L1-regression or diffusion action head); rlfleet's openvla_oft decodes discrete action "
                         f"tokens from the LM head, so it needs a checkpoint fine-tuned on action tokens")
    files = sorted(path.glob("proprio_projector--*.pt"))
    if not files:
        return {}
    if len(files) > 1:
        raise ValueError(f"actor.model.model_path: {path} holds {len(files)} proprio projectors "
                         f"({[f.name for f in files]}); keep the one of the checkpoint's step")
    state = torch.load(files[0], map_location="cpu", weights_only=True)
    out = {}
    for k, v in state.items():
        name = k[len("module."):] if k.startswith("module.") else k
        layer, _, kind = name.partition(".")
        if layer not in ("fc1", "fc2") or kind not in ("weight", "bias"):
            raise ValueError(f"{files[0]}: unexpected tensor '{k}' (OpenVLA-OFT's proprio projector has fc1 and fc2)")
        out[f"proprio_projector.{0 if layer == 'fc1' else 2}.{kind}"] = v
    return out

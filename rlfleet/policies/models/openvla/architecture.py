"""Architecture: sizes, vision backbone, projector, Llama LM and the input layout [BOS][patches][proprio][prompt]."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from rlfleet.policies.families import FAMILIES
from rlfleet.policies.models.openvla.tokenizers import PROMPT, ByteTokenizer

SIGLIP_MEAN, SIGLIP_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

# actor.model.vla defaults: a tiny model (a few million parameters) that runs on CPU, written once, in the family's
# size YAML (sizes.yaml in this package; its entry in rlfleet.policies.families names it)
TINY = FAMILIES["openvla"].defaults()


class VisionBackbone(nn.Module):
    """SigLIP, optionally fused with DINOv2 (with register tokens, as OpenVLA's dinosiglip) -> patch features
    [n, patches, dim]. Like Prismatic, features come from each encoder's second-to-last layer, DINOv2's first."""

    def __init__(self, sizes: Mapping):
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        self.image_size = int(sizes["image_size"])
        patch = int(sizes["patch_size"])
        self.siglip = SiglipVisionModel(
            SiglipVisionConfig(
                image_size=self.image_size,
                patch_size=patch,
                hidden_size=int(sizes["vision_hidden_size"]),
                num_hidden_layers=int(sizes["vision_layers"]),
                num_attention_heads=int(sizes["vision_heads"]),
                intermediate_size=int(sizes["vision_intermediate_size"]),
                vision_use_head=False,
            )
        )
        self.dino, self.dino_skip = None, 0
        self.out_dim = int(sizes["vision_hidden_size"])
        if sizes.get("use_dinov2"):
            from transformers import Dinov2Config, Dinov2Model, Dinov2WithRegistersConfig, Dinov2WithRegistersModel

            width = int(sizes.get("dino_hidden_size") or sizes["vision_hidden_size"])
            inter = int(sizes.get("dino_intermediate_size") or sizes["vision_intermediate_size"])
            registers = int(sizes.get("dino_registers") or 0)
            if inter % width:
                raise ValueError(
                    f"actor.model.vla.dino_intermediate_size {inter} must be a multiple of the DINOv2 width {width}"
                )
            kw = dict(
                image_size=self.image_size,
                patch_size=patch,
                hidden_size=width,
                mlp_ratio=inter // width,
                num_hidden_layers=int(sizes.get("dino_layers") or sizes["vision_layers"]),
                num_attention_heads=int(sizes.get("dino_heads") or sizes["vision_heads"]),
                layerscale_value=1.0,
            )
            self.dino = (
                Dinov2WithRegistersModel(Dinov2WithRegistersConfig(num_register_tokens=registers, **kw))
                if registers
                else Dinov2Model(Dinov2Config(**kw))
            )
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
        feats = self.siglip(
            pixel_values=(x - self.siglip_mean) / self.siglip_std, output_hidden_states=True
        ).hidden_states[-2]
        if self.dino is not None:
            dino = self.dino(
                pixel_values=(x - self.dino_mean) / self.dino_std, output_hidden_states=True
            ).hidden_states[-2][:, self.dino_skip :]
            feats = torch.cat([dino, feats], dim=-1)
        return feats


class Projector(nn.Module):
    """Prismatic's MLP projector: GELU MLP from patch features to the LM width (3 layers when fused)."""

    def __init__(self, vision_dim: int, llm_dim: int, fused: bool):
        super().__init__()
        if fused:
            mid = 4 * vision_dim
            self.net = nn.Sequential(
                nn.Linear(vision_dim, mid), nn.GELU(), nn.Linear(mid, llm_dim), nn.GELU(), nn.Linear(llm_dim, llm_dim)
            )
        else:
            self.net = nn.Sequential(nn.Linear(vision_dim, llm_dim), nn.GELU(), nn.Linear(llm_dim, llm_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class OpenVLAArchitecture(nn.Module):
    """The modules of an OpenVLA policy and the forward passes over its input layout (the policy is
    ``rlfleet.policies.models.openvla.policy.OpenVLAPolicy``)."""

    def __init__(
        self,
        obs_specs: Mapping,
        action_dim: int,
        *,
        model_type: str = "openvla",
        sizes: Mapping | None = None,
        num_action_chunks: int = 1,
        temperature: float = 1.0,
        image_key: str | None = None,
        max_prompt_tokens: int = 64,
        add_value_head: bool = True,
        gradient_checkpointing: bool = False,
        tokenizer=None,
        logprob_type: str = "token_level",
        use_proprio: bool = False,
        proprio_stats: Mapping | None = None,
        extra_image_keys: Sequence[str] = (),
    ):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model_type, self.parallel = model_type, model_type == "openvla_oft"
        if not self.parallel and num_action_chunks != 1:
            raise ValueError(
                f"model_type 'openvla' decodes one action per call; num_action_chunks="
                f"{num_action_chunks} needs 'openvla_oft'"
            )
        self.sizes = {**TINY, **dict(sizes or {})}
        images = sorted(k for k, s in obs_specs.items() if s.is_image)
        if not images:
            raise ValueError(
                f"model_type '{model_type}' needs an image observation; the env provides {sorted(obs_specs)}"
            )
        if image_key is not None and image_key not in images:
            raise ValueError(f"actor.model.image_key: '{image_key}' is not an image observation ({images})")
        self.image_key = image_key or images[0]
        # OpenVLA-OFT's num_images_in_input > 1: further cameras, each through the same vision backbone and
        # projector, their patches after the first image's (LIBERO: the third-person view, then the wrist)
        self.extra_image_keys = [str(k) for k in extra_image_keys]
        if self.extra_image_keys and model_type != "openvla_oft":
            raise ValueError(
                f"actor.model.extra_image_keys: more than one image is OpenVLA-OFT's; model_type is '{model_type}'"
            )
        for k in self.extra_image_keys:
            if k not in images:
                raise ValueError(f"actor.model.extra_image_keys: '{k}' is not an image observation ({images})")
        if len(set([self.image_key, *self.extra_image_keys])) != 1 + len(self.extra_image_keys):
            raise ValueError(
                f"actor.model.extra_image_keys: {self.extra_image_keys} repeats a camera (image_key is "
                f"'{self.image_key}')"
            )
        if use_proprio and model_type != "openvla_oft":
            raise ValueError(
                f"actor.model.use_proprio: the proprio projector is OpenVLA-OFT's; model_type is '{model_type}'"
            )
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
            raise ValueError(
                f"actor.model.vla.vocab_size {self.vocab_size} leaves no room for {self.n_bins} action "
                f"ids after the {self.tokenizer.vocab_size} text ids"
            )
        self.vision = VisionBackbone(s)
        llm_cfg = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=int(s["llm_hidden_size"]),
            intermediate_size=int(s["llm_intermediate_size"]),
            num_hidden_layers=int(s["llm_layers"]),
            num_attention_heads=int(s["llm_heads"]),
            num_key_value_heads=int(s["llm_kv_heads"]),
            rms_norm_eps=float(s["llm_rms_norm_eps"]),
            rope_theta=float(s["llm_rope_theta"]),
            max_position_embeddings=2
            + self.vision.num_patches * self.num_images
            + (1 if use_proprio else 0)
            + self.max_prompt_tokens
            + self.num_action_chunks * self.action_dim
            + 8,
            pad_token_id=self.tokenizer.pad_token_id,
            bos_token_id=self.tokenizer.bos_token_id,
        )
        self.llm = LlamaForCausalLM(llm_cfg)
        self.projector = Projector(self.vision.out_dim, llm_cfg.hidden_size, fused=bool(s["use_dinov2"]))
        self.action_query = nn.Parameter(torch.zeros(llm_cfg.hidden_size)) if self.parallel else None
        # OpenVLA-OFT's proprio projector: the normalised `state` observation -> one token after the image patches
        H = llm_cfg.hidden_size
        self.proprio_projector = (
            nn.Sequential(nn.Linear(self.proprio_dim, H), nn.GELU(), nn.Linear(H, H)) if use_proprio else None
        )
        pq01, pq99 = (proprio_stats or {}).get("q01"), (proprio_stats or {}).get("q99")
        self.register_buffer(
            "proprio_q01", torch.tensor(pq01 if pq01 is not None else [-1.0] * self.proprio_dim), persistent=False
        )
        self.register_buffer(
            "proprio_q99", torch.tensor(pq99 if pq99 is not None else [1.0] * self.proprio_dim), persistent=False
        )
        self.proprio_stats = dict(proprio_stats) if proprio_stats and use_proprio else None
        self.value_head = (
            nn.Sequential(
                nn.Linear(llm_cfg.hidden_size, int(s["value_hidden_size"])),
                nn.GELU(),
                nn.Linear(int(s["value_hidden_size"]), 1),
            )
            if add_value_head
            else None
        )
        if gradient_checkpointing:
            # transformers >= 5.23 names it activation checkpointing (the vLLM environment's older one does not)
            enable = (
                getattr(self.llm, "activation_checkpointing_enable", None) or self.llm.gradient_checkpointing_enable
            )
            enable()
        self.is_lora = False  # enable_lora (checkpoint.py) puts adapters on the LM

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
                ids[i, P - len(toks) :] = torch.tensor(toks)
                mask[i, P - len(toks) :] = 1
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
            raise ValueError(
                f"cameras {list(self.image_keys)} have shapes {[tuple(c.shape) for c in cams]}: "
                "the vision backbone needs every camera at one image size"
            )
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
        mask = torch.cat(
            [torch.ones((n, 1 + patches.shape[1]), dtype=torch.long, device=images.device), prompt_mask.long()], dim=1
        )
        return emb, mask

    def _value(self, hidden_last_prompt: torch.Tensor) -> torch.Tensor | None:
        if self.value_head is None:
            return None
        return self.value_head(hidden_last_prompt.float()).squeeze(-1)

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


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """-> (all parameters, trainable parameters)."""
    total = sum(p.numel() for p in model.parameters())
    return total, sum(p.numel() for p in model.parameters() if p.requires_grad)

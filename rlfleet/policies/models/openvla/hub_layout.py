"""OpenVLA's released hub layout (Prismatic's timm names, OFT's proprio projector) -> this policy's tensor names."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from rlfleet.policies.models.openvla.architecture import TINY
from rlfleet.policies.models.openvla.tokenizers import has_tokenizer_files, load_hf_tokenizer


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

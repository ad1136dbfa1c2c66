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


# --- the one mapping, both ways ----------------------------------------------------------------------------------
# A row: (the released name, this policy's name(s), how the tensor changes). Reading applies ``to_ours``, export
# ``to_hub``; the table is the same, so each is the other's inverse.
_CONVERT = {
    "same": (lambda t: [t], lambda ts: ts[0]),
    "qkv": (lambda t: list(t.chunk(3, dim=0)), lambda ts: torch.cat(ts, dim=0)),  # timm fuses q, k, v
    "row": (lambda t: [t[0]], lambda ts: ts[0][None]),  # SigLIP's position table: timm keeps a batch dim
    # DINOv2: timm (no_embed_class) gives the CLS token no position; transformers' table has a CLS row (zero here;
    # export folds a non-zero one into cls_token first, the same sum the forward pass makes)
    "patch_pos": (lambda t: [torch.cat([torch.zeros_like(t[:, :1]), t], 1)], lambda ts: ts[0][:, 1:]),
}
RLFLEET_HINTS = "rlfleet"  # config.json: sizes the weights cannot tell (attention heads), written by the export
_HINTED = ("vision_heads", "dino_heads", "prompt_suffix_ids", "value_hidden_size")
HUB_LLM, OUR_LLM = "language_model.", "llm."  # the Llama LM: the same names under each prefix
HUB_SIGLIP_FUSED, HUB_SIGLIP_ALONE, HUB_DINO = ("vision_backbone.fused_featurizer.", "vision_backbone.featurizer.",
                                                "vision_backbone.featurizer.")
OUR_SIGLIP, OUR_DINO = "vision.siglip.", "vision.dino."
PROPRIO_LAYERS = (("fc1", 0), ("fc2", 2))  # OpenVLA-OFT's ProprioProjector fc1/fc2 <-> proprio_projector.0/.2


def _vit_rows(src: str, dst: str, n_blocks: int, dino: bool, registers: bool) -> list[tuple[str, tuple, str]]:
    """Prismatic's timm ViT names (``src``) <-> transformers' SigLIP / DINOv2 names (``dst``)."""
    emb = f"{dst}embeddings."
    if dino:
        rows = [("patch_embed.proj.weight", f"{emb}patch_embeddings.projection.weight", "same"),
                ("patch_embed.proj.bias", f"{emb}patch_embeddings.projection.bias", "same"),
                ("cls_token", f"{emb}cls_token", "same"), ("pos_embed", f"{emb}position_embeddings", "patch_pos"),
                ("norm.weight", f"{dst}layernorm.weight", "same"), ("norm.bias", f"{dst}layernorm.bias", "same")]
        rows += [("reg_token", f"{emb}register_tokens", "same")] if registers else []
    else:
        rows = [("patch_embed.proj.weight", f"{emb}patch_embedding.weight", "same"),
                ("patch_embed.proj.bias", f"{emb}patch_embedding.bias", "same"),
                ("pos_embed", f"{emb}position_embedding.weight", "row"),
                ("norm.weight", f"{dst}post_layernorm.weight", "same"),
                ("norm.bias", f"{dst}post_layernorm.bias", "same")]
    rows = [(src + a, (b,), kind) for a, b, kind in rows]
    att_name, out_name, n1, n2 = ("attention.", "o_proj", "norm1", "norm2") if dino else \
        ("self_attn.", "out_proj", "layer_norm1", "layer_norm2")
    for i in range(n_blocks):
        b, d = f"{src}blocks.{i}.", f"{dst}encoder.layer.{i}." if dino else f"{dst}encoder.layers.{i}."
        att = d + att_name
        for kind in ("weight", "bias"):
            rows += [(f"{b}attn.qkv.{kind}", tuple(f"{att}{q}.{kind}" for q in ("q_proj", "k_proj", "v_proj")), "qkv"),
                     (f"{b}attn.proj.{kind}", (f"{att}{out_name}.{kind}",), "same"),
                     (f"{b}norm1.{kind}", (f"{d}{n1}.{kind}",), "same"),
                     (f"{b}norm2.{kind}", (f"{d}{n2}.{kind}",), "same"),
                     (f"{b}mlp.fc1.{kind}", (f"{d}mlp.fc1.{kind}",), "same"),
                     (f"{b}mlp.fc2.{kind}", (f"{d}mlp.fc2.{kind}",), "same")]
        if dino:
            rows += [(f"{b}ls1.scale_factor", (f"{d}layer_scale1.lambda1",), "same"),
                     (f"{b}ls2.scale_factor", (f"{d}layer_scale2.lambda1",), "same")]
    return rows


def openvla_rows(siglip_blocks: int, dino_blocks: int | None, dino_registers: bool) -> list[tuple[str, tuple, str]]:
    """The whole table but the LM (which keeps its names under ``HUB_LLM`` / ``OUR_LLM``): the vision backbone(s)
    and the projector (fc1..fc3 fused, fc1..fc2 SigLIP alone)."""
    fused = dino_blocks is not None
    rows = _vit_rows(HUB_SIGLIP_FUSED if fused else HUB_SIGLIP_ALONE, OUR_SIGLIP, siglip_blocks, False, False)
    if fused:
        rows += _vit_rows(HUB_DINO, OUR_DINO, dino_blocks, True, dino_registers)
    for i, fc in enumerate(("fc1", "fc2", "fc3") if fused else ("fc1", "fc2")):
        rows += [(f"projector.{fc}.{kind}", (f"projector.net.{2 * i}.{kind}",), "same") for kind in ("weight", "bias")]
    return rows


def hub_to_ours(state: Mapping, rows) -> dict[str, torch.Tensor]:
    out = {}
    for hub, ours, kind in rows:
        out.update(zip(ours, _CONVERT[kind][0](state[hub])))
    out.update({OUR_LLM + k[len(HUB_LLM):]: v for k, v in state.items() if k.startswith(HUB_LLM)})
    return out


def ours_to_hub(state: Mapping, rows) -> dict[str, torch.Tensor]:
    out = {hub: _CONVERT[kind][1]([state[o] for o in ours]) for hub, ours, kind in rows}
    out.update({HUB_LLM + k[len(OUR_LLM):]: v for k, v in state.items() if k.startswith(OUR_LLM)})
    return out


def load_openvla_hub_dir(path: Path, unnorm_key: str | None, fallback: Mapping | None = None):
    """OpenVLA's released layout -> (sizes, tokenizer, stats, state dict in this policy's names). Sizes come from
    the weights' shapes and config.json; what neither holds (attention heads of an unknown ViT) from ``fallback``
    (``actor.model.vla``)."""
    cfg = json.loads((path / "config.json").read_text())
    # what neither the weights nor Prismatic's keys hold, as rlfleet's export records it (RLFLEET_HINTS)
    hints = {k: v for k, v in (cfg.get(RLFLEET_HINTS) or {}).items() if k in _HINTED}
    fallback = {**TINY, **dict(fallback or {}), **hints}
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
             "n_action_bins": int(cfg.get("n_action_bins", 256)), "value_hidden_size": int(fallback["value_hidden_size"]),
             "prompt_suffix_ids": list(hints["prompt_suffix_ids"]) if "prompt_suffix_ids" in hints else
             [29871] if vocab - int(cfg.get("pad_to_multiple_of", 0)) == 32000 else []}
    dino_blocks = None
    if fused:
        src = HUB_DINO
        dw = state[f"{src}patch_embed.proj.weight"]
        dino_blocks = _vit_blocks(state, f"{src}blocks.")
        sizes.update(dino_hidden_size=int(dw.shape[0]), dino_layers=dino_blocks,
                     dino_heads=_heads_for(timm_ids[0] if timm_ids else None,
                                           fallback["dino_heads"] or fallback["vision_heads"]),
                     dino_intermediate_size=int(state[f"{src}blocks.0.mlp.fc1.weight"].shape[0]),
                     dino_registers=int(state[f"{src}reg_token"].shape[1]) if f"{src}reg_token" in state else 0)
    mapped = hub_to_ours(state, openvla_rows(sizes["vision_layers"], dino_blocks, bool(sizes.get("dino_registers"))))
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
        if layer not in dict(PROPRIO_LAYERS) or kind not in ("weight", "bias"):
            raise ValueError(f"{files[0]}: unexpected tensor '{k}' (OpenVLA-OFT's proprio projector has fc1 and fc2)")
        out[f"proprio_projector.{dict(PROPRIO_LAYERS)[layer]}.{kind}"] = v
    return out

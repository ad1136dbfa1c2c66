"""OpenVLA's released hub layout (Prismatic's timm names, OFT's proprio projector) <-> this policy's tensor names: one
table, read by the loader (``load_openvla_hub_dir``) and inverted by the export (``save_openvla_hub_dir``), and checks
of a written folder against its index and the architecture its config.json describes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from rlfleet.policies.model_folder import (
    check_sizes,
    has_file,
    load_pt_weights,
    load_tensors,
    read_config,
    shard_names,
    tensor_headers,
)
from rlfleet.policies.models.openvla.architecture import TINY
from rlfleet.policies.models.openvla.tokenizers import has_tokenizer_files, load_hf_tokenizer
from rlfleet.untrusted import BadFile, check_count, folder_root


def _pick_stats(all_stats: Mapping, unnorm_key: str | None, where: Path, field: str = ""):
    """The statistics stored under ``unnorm_key`` (dataset_statistics.json, or config.json's ``norm_stats``
    where ``field`` is "norm_stats"), each checked: q01 and q99 lists of as many finite numbers, an optional
    mask of as many booleans, for the actions and (optionally) the proprio state."""
    if not unnorm_key:
        return None
    if not isinstance(all_stats, Mapping):
        raise BadFile(where, field or "top level", "a JSON object of statistics by dataset", type(all_stats).__name__)
    if unnorm_key not in all_stats:
        raise KeyError(f"actor.model.unnorm_key: '{unnorm_key}' is not in {where} (has: {sorted(all_stats) or 'none'})")
    entry = all_stats[unnorm_key]
    name = f"{field}.{unnorm_key}" if field else unnorm_key
    if not isinstance(entry, Mapping):
        raise BadFile(where, name, "a JSON object of statistics", type(entry).__name__)
    action = entry.get("action", entry)
    _check_stats(action, where, f"{name}.action" if "action" in entry else name)
    proprio = entry.get("proprio")
    if proprio is not None:
        _check_stats(proprio, where, f"{name}.proprio")
    return {
        "action": action,
        "proprio": proprio,
        "source": where,
        "field": f"{name}.action" if "action" in entry else name,
    }


def _check_stats(stats, where: Path, field: str, most: int = 4096) -> None:
    import math

    if not isinstance(stats, Mapping):
        raise BadFile(where, field, "a JSON object with q01 and q99", type(stats).__name__)
    widths = []
    for key in ("q01", "q99"):
        values = stats.get(key)
        if (
            not isinstance(values, list)
            or not 0 < len(values) <= most
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)
        ):
            raise BadFile(where, f"{field}.{key}", f"a list of 1 to {most} finite numbers", repr(values)[:80])
        widths.append(len(values))
    mask = stats.get("mask")
    if mask is not None and (not isinstance(mask, list) or not all(isinstance(v, bool) for v in mask)):
        raise BadFile(where, f"{field}.mask", "a list of booleans", repr(mask)[:80])
    if mask is not None:
        widths.append(len(mask))
    if len(set(widths)) != 1:
        raise BadFile(where, field, "q01, q99 (and mask) of the same length", f"lengths {widths}")


def _read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a directory's safetensors (sharded with model.safetensors.index.json, or one file), every
    shard named by the index inside the folder and every header checked before a tensor is read."""
    files = shard_names(path)
    if not files:
        raise FileNotFoundError(f"actor.model.model_path: no *.safetensors in {path}")
    return load_tensors(path, files)


def _vit_blocks(state: Mapping, prefix: str) -> int:
    return len({k[len(prefix) :].split(".")[0] for k in state if k.startswith(prefix)})


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
HUB_SIGLIP_FUSED, HUB_SIGLIP_ALONE, HUB_DINO = (
    "vision_backbone.fused_featurizer.",
    "vision_backbone.featurizer.",
    "vision_backbone.featurizer.",
)
OUR_SIGLIP, OUR_DINO = "vision.siglip.", "vision.dino."
PROPRIO_LAYERS = (("fc1", 0), ("fc2", 2))  # OpenVLA-OFT's ProprioProjector fc1/fc2 <-> proprio_projector.0/.2


def _vit_rows(src: str, dst: str, n_blocks: int, dino: bool, registers: bool) -> list[tuple[str, tuple, str]]:
    """Prismatic's timm ViT names (``src``) <-> transformers' SigLIP / DINOv2 names (``dst``)."""
    emb = f"{dst}embeddings."
    if dino:
        rows = [
            ("patch_embed.proj.weight", f"{emb}patch_embeddings.projection.weight", "same"),
            ("patch_embed.proj.bias", f"{emb}patch_embeddings.projection.bias", "same"),
            ("cls_token", f"{emb}cls_token", "same"),
            ("pos_embed", f"{emb}position_embeddings", "patch_pos"),
            ("norm.weight", f"{dst}layernorm.weight", "same"),
            ("norm.bias", f"{dst}layernorm.bias", "same"),
        ]
        rows += [("reg_token", f"{emb}register_tokens", "same")] if registers else []
    else:
        rows = [
            ("patch_embed.proj.weight", f"{emb}patch_embedding.weight", "same"),
            ("patch_embed.proj.bias", f"{emb}patch_embedding.bias", "same"),
            ("pos_embed", f"{emb}position_embedding.weight", "row"),
            ("norm.weight", f"{dst}post_layernorm.weight", "same"),
            ("norm.bias", f"{dst}post_layernorm.bias", "same"),
        ]
    rows = [(src + a, (b,), kind) for a, b, kind in rows]
    att_name, out_name, n1, n2 = (
        ("attention.", "o_proj", "norm1", "norm2") if dino else ("self_attn.", "out_proj", "layer_norm1", "layer_norm2")
    )
    for i in range(n_blocks):
        b, d = f"{src}blocks.{i}.", f"{dst}encoder.layer.{i}." if dino else f"{dst}encoder.layers.{i}."
        att = d + att_name
        for kind in ("weight", "bias"):
            rows += [
                (f"{b}attn.qkv.{kind}", tuple(f"{att}{q}.{kind}" for q in ("q_proj", "k_proj", "v_proj")), "qkv"),
                (f"{b}attn.proj.{kind}", (f"{att}{out_name}.{kind}",), "same"),
                (f"{b}norm1.{kind}", (f"{d}{n1}.{kind}",), "same"),
                (f"{b}norm2.{kind}", (f"{d}{n2}.{kind}",), "same"),
                (f"{b}mlp.fc1.{kind}", (f"{d}mlp.fc1.{kind}",), "same"),
                (f"{b}mlp.fc2.{kind}", (f"{d}mlp.fc2.{kind}",), "same"),
            ]
        if dino:
            rows += [
                (f"{b}ls1.scale_factor", (f"{d}layer_scale1.lambda1",), "same"),
                (f"{b}ls2.scale_factor", (f"{d}layer_scale2.lambda1",), "same"),
            ]
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
    out.update({OUR_LLM + k[len(HUB_LLM) :]: v for k, v in state.items() if k.startswith(HUB_LLM)})
    return out


def ours_to_hub(state: Mapping, rows) -> dict[str, torch.Tensor]:
    out = {hub: _CONVERT[kind][1]([state[o] for o in ours]) for hub, ours, kind in rows}
    out.update({HUB_LLM + k[len(OUR_LLM) :]: v for k, v in state.items() if k.startswith(OUR_LLM)})
    return out


def load_openvla_hub_dir(path: Path, unnorm_key: str | None, fallback: Mapping | None = None):
    """OpenVLA's released layout -> (sizes, tokenizer, stats, state dict in this policy's names). Sizes come from
    the weights' shapes and config.json; what neither holds (attention heads of an unknown ViT) from ``fallback``
    (``actor.model.vla``)."""
    source = path / "config.json"
    cfg = read_config(path)
    check_sizes(cfg, source)  # text_config's heads, n_action_bins, pad_to_multiple_of, ...: bounded
    # what neither the weights nor Prismatic's keys hold, as rlfleet's export records it (RLFLEET_HINTS)
    hints = cfg.get(RLFLEET_HINTS) or {}
    text = cfg.get("text_config") or {}
    timm_ids = cfg.get("timm_model_ids") or []
    image_sizes = cfg.get("image_sizes") or [224]
    for name, value, kind in (
        (RLFLEET_HINTS, hints, dict),
        ("text_config", text, dict),
        ("timm_model_ids", timm_ids, list),
        ("image_sizes", image_sizes, list),
        ("norm_stats", cfg.get("norm_stats") or {}, dict),
    ):
        if not isinstance(value, kind):
            raise BadFile(source, name, f"a JSON {'object' if kind is dict else 'array'}", type(value).__name__)
    if not all(t is None or isinstance(t, str) for t in timm_ids):
        raise BadFile(source, "timm_model_ids", "timm model ids (strings or null)", repr(timm_ids)[:80])
    for size in image_sizes:
        check_count("image_sizes", size, 8192, source=source, minimum=1)
    hints = {k: v for k, v in hints.items() if k in _HINTED}
    fallback = {**TINY, **dict(fallback or {}), **hints}
    for key in ("rms_norm_eps", "rope_theta"):
        v = text.get(key)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
            raise BadFile(source, f"text_config.{key}", "a positive number", repr(v)[:80])
    state = _read_safetensors_dir(path)
    try:
        sizes, mapped = _sizes_and_state(cfg, state, hints, fallback, text, timm_ids, image_sizes)
    except KeyError as exc:
        raise BadFile(path, f"tensor {exc}", "present (OpenVLA's released layout)", "missing") from None
    mapped.update(_load_oft_components(path))
    tokenizer = load_hf_tokenizer(path) if has_tokenizer_files(path) else None
    stats = _pick_stats(cfg.get("norm_stats") or {}, unnorm_key, path / "config.json", "norm_stats")
    return sizes, tokenizer, stats, mapped


def _sizes_and_state(cfg, state, hints, fallback, text, timm_ids, image_sizes):
    """The sizes the weights' shapes (and config.json) give, and the state dict in this policy's names."""
    fused = any(k.startswith("vision_backbone.fused_featurizer.") for k in state)
    sig_src = "vision_backbone.fused_featurizer." if fused else "vision_backbone.featurizer."
    sig_w = state[f"{sig_src}patch_embed.proj.weight"]
    vocab = int(state["language_model.lm_head.weight"].shape[0])
    sizes = {
        **TINY,
        "patch_size": int(sig_w.shape[-1]),
        "vision_hidden_size": int(sig_w.shape[0]),
        "vision_layers": _vit_blocks(state, f"{sig_src}blocks."),
        "vision_heads": _heads_for(timm_ids[-1] if timm_ids else None, fallback["vision_heads"]),
        "vision_intermediate_size": int(state[f"{sig_src}blocks.0.mlp.fc1.weight"].shape[0]),
        "image_size": int(image_sizes[0]),
        "use_dinov2": fused,
        "llm_hidden_size": int(state["language_model.model.embed_tokens.weight"].shape[1]),
        "llm_layers": _vit_blocks(state, "language_model.model.layers."),
        "llm_heads": int(text.get("num_attention_heads", 32)),
        "llm_kv_heads": int(text.get("num_key_value_heads") or text.get("num_attention_heads", 32)),
        "llm_intermediate_size": int(state["language_model.model.layers.0.mlp.gate_proj.weight"].shape[0]),
        "llm_rms_norm_eps": float(text.get("rms_norm_eps", 1e-5)),
        "llm_rope_theta": float(text.get("rope_theta", 10000.0)),
        "vocab_size": vocab,
        "action_token_end": vocab - int(cfg.get("pad_to_multiple_of", 0)),
        "n_action_bins": int(cfg.get("n_action_bins", 256)),
        "value_hidden_size": int(fallback["value_hidden_size"]),
        "prompt_suffix_ids": list(hints["prompt_suffix_ids"])
        if "prompt_suffix_ids" in hints
        else [29871]
        if vocab - int(cfg.get("pad_to_multiple_of", 0)) == 32000
        else [],
    }
    dino_blocks = None
    if fused:
        src = HUB_DINO
        dw = state[f"{src}patch_embed.proj.weight"]
        dino_blocks = _vit_blocks(state, f"{src}blocks.")
        sizes.update(
            dino_hidden_size=int(dw.shape[0]),
            dino_layers=dino_blocks,
            dino_heads=_heads_for(
                timm_ids[0] if timm_ids else None, fallback["dino_heads"] or fallback["vision_heads"]
            ),
            dino_intermediate_size=int(state[f"{src}blocks.0.mlp.fc1.weight"].shape[0]),
            dino_registers=int(state[f"{src}reg_token"].shape[1]) if f"{src}reg_token" in state else 0,
        )
    mapped = hub_to_ours(state, openvla_rows(sizes["vision_layers"], dino_blocks, bool(sizes.get("dino_registers"))))
    return sizes, mapped


def _load_oft_components(path: Path) -> dict[str, torch.Tensor]:
    """OpenVLA-OFT's released checkpoints keep the proprio projector beside the VLA, in
    ``proprio_projector--<step>_checkpoint.pt`` (a state dict of fc1/fc2, ``module.``-prefixed when saved from DDP)
    -> this policy's ``proprio_projector.*`` names. A checkpoint whose actions come from a separate action head
    (``action_head--*.pt``: OFT's L1-regression or diffusion head) is refused: rlfleet decodes action tokens."""
    heads = sorted(path.glob("action_head--*.pt"))
    if heads:
        raise ValueError(
            f"actor.model.model_path: {path} predicts continuous actions with {heads[0].name} (OpenVLA-OFT's "
            f"L1-regression or diffusion action head); rlfleet's openvla_oft decodes discrete action "
            f"tokens from the LM head, so it needs a checkpoint fine-tuned on action tokens"
        )
    files = sorted(path.glob("proprio_projector--*.pt"))
    if not files:
        return {}
    if len(files) > 1:
        raise ValueError(
            f"actor.model.model_path: {path} holds {len(files)} proprio projectors "
            f"({[f.name for f in files]}); keep the one of the checkpoint's step"
        )
    state = load_pt_weights(files[0], folder_root(path))  # weights only, memory-mapped, inside the folder
    out = {}
    for k, v in state.items():
        name = k[len("module.") :] if k.startswith("module.") else k
        layer, _, kind = name.partition(".")
        if layer not in dict(PROPRIO_LAYERS) or kind not in ("weight", "bias"):
            raise ValueError(f"{files[0]}: unexpected tensor '{k}' (OpenVLA-OFT's proprio projector has fc1 and fc2)")
        out[f"proprio_projector.{dict(PROPRIO_LAYERS)[layer]}.{kind}"] = v
    return out


# --- export: this policy -> the released layout ---------------------------------------------------------------------
# OpenVLA-7B's backbones, by their sizes (what Prismatic's config names): written only when the weights are theirs
_OPENVLA_7B_SIGLIP = dict(vision_hidden_size=1152, vision_layers=27, patch_size=14, image_size=224)
_OPENVLA_7B_DINO = dict(dino_hidden_size=1024, dino_layers=24, dino_registers=4)
_OPENVLA_7B_LLM = dict(llm_hidden_size=4096, llm_layers=32, llm_intermediate_size=11008)


def _is(sizes: Mapping, ref: Mapping) -> bool:
    return all(sizes.get(k) == v for k, v in ref.items())


def hub_config(
    sizes: Mapping,
    *,
    model_type: str,
    stats: Mapping | None,
    num_images: int,
    image_keys,
    pad_token_id: int,
    bos_token_id: int,
    dtype: str,
) -> dict:
    """config.json of OpenVLA's released layout (Prismatic's ``OpenVLAConfig`` keys) for these sizes, plus
    ``rlfleet``: what the weights cannot tell (attention heads) for loading it back here."""
    fused = bool(sizes.get("use_dinov2"))
    image = int(sizes["image_size"])
    real = _is(sizes, _OPENVLA_7B_SIGLIP) and (not fused or _is(sizes, _OPENVLA_7B_DINO))
    if real:  # Prismatic's own ids: its code builds the backbones from the timm ids
        timm = (["vit_large_patch14_reg4_dinov2.lvd142m"] if fused else []) + ["vit_so400m_patch14_siglip_224"]
        backbone = "dinosiglip-vit-so-224px" if fused else "siglip-vit-so400m"
    else:  # no timm model has these sizes: Prismatic's code cannot build them, rlfleet's loader can
        timm = [None] * (2 if fused else 1)
        backbone = f"rlfleet-{'dinosiglip' if fused else 'siglip'}-{image}px"
    vocab = int(sizes["vocab_size"])
    action_end = int(sizes.get("action_token_end") or vocab)
    llama = _is(sizes, _OPENVLA_7B_LLM) and action_end == 32000
    text = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": int(sizes["llm_hidden_size"]),
        "intermediate_size": int(sizes["llm_intermediate_size"]),
        "num_hidden_layers": int(sizes["llm_layers"]),
        "num_attention_heads": int(sizes["llm_heads"]),
        "num_key_value_heads": int(sizes["llm_kv_heads"]),
        "rms_norm_eps": float(sizes["llm_rms_norm_eps"]),
        "rope_theta": float(sizes["llm_rope_theta"]),
        "pad_token_id": pad_token_id,
        "bos_token_id": bos_token_id,
        "torch_dtype": dtype,
    }
    cfg = {
        "architectures": ["OpenVLAForActionPrediction"],
        "auto_map": {
            "AutoConfig": "configuration_prismatic.OpenVLAConfig",
            "AutoModelForVision2Seq": "modeling_prismatic.OpenVLAForActionPrediction",
        },
        "model_type": "openvla",
        "vision_backbone_id": backbone,
        "llm_backbone_id": "llama2-7b-pure" if llama else f"rlfleet-llama-{sizes['llm_hidden_size']}",
        "arch_specifier": "no-align+fused-gelu-mlp" if fused else "no-align+gelu-mlp",
        "use_fused_vision_backbone": fused,
        "image_resize_strategy": "resize-naive",
        "image_sizes": [image] * len(timm),
        "timm_model_ids": timm,
        "timm_override_act_layers": [None] * len(timm),
        "llm_max_length": 2048,
        "pad_token_id": pad_token_id,
        "pad_to_multiple_of": vocab - action_end,
        "output_projector_states": False,
        "n_action_bins": int(sizes["n_action_bins"]),
        "norm_stats": dict(stats or {}),
        "text_config": text,
        "torch_dtype": dtype,
        "num_images_in_input": int(num_images),
        "image_keys": list(image_keys),
        RLFLEET_HINTS: {
            "model_type": model_type,
            **{
                k: (list(sizes[k]) if k == "prompt_suffix_ids" else sizes[k])
                for k in _HINTED
                if sizes.get(k) is not None
            },
        },
    }
    if llama:
        cfg["hf_llm_id"] = "meta-llama/Llama-2-7b-hf"
    return cfg


def hub_processor_configs(sizes: Mapping) -> dict[str, dict]:
    """preprocessor_config.json and processor_config.json of the release (Prismatic's processor, remote code):
    each backbone's input size, mean and std."""
    from rlfleet.policies.models.openvla.architecture import IMAGENET_MEAN, IMAGENET_STD, SIGLIP_MEAN, SIGLIP_STD

    fused, image = bool(sizes.get("use_dinov2")), int(sizes["image_size"])
    means = ([list(IMAGENET_MEAN)] if fused else []) + [list(SIGLIP_MEAN)]
    stds = ([list(IMAGENET_STD)] if fused else []) + [list(SIGLIP_STD)]
    auto = {
        "AutoImageProcessor": "processing_prismatic.PrismaticImageProcessor",
        "AutoProcessor": "processing_prismatic.PrismaticProcessor",
    }
    return {
        "preprocessor_config.json": {
            "auto_map": auto,
            "image_processor_type": "PrismaticImageProcessor",
            "processor_class": "PrismaticProcessor",
            "image_resize_strategy": "resize-naive",
            "input_sizes": [[3, image, image]] * len(means),
            "interpolations": ["bicubic"] * len(means),
            "means": means,
            "stds": stds,
            "use_fused_vision_backbone": fused,
        },
        "processor_config.json": {
            "auto_map": {"AutoProcessor": auto["AutoProcessor"]},
            "processor_class": "PrismaticProcessor",
        },
    }


def save_openvla_hub_dir(
    path: Path,
    state: Mapping[str, torch.Tensor],
    sizes: Mapping,
    *,
    model_type: str,
    tokenizer,
    stats: Mapping | None,
    num_images: int,
    image_keys,
    step: int | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """This policy's weights (``state``, LoRA merged, this policy's names) -> OpenVLA's released layout in ``path``:
    config.json, (sharded) safetensors in Prismatic's names with model.safetensors.index.json, the tokenizer's and
    processor's files, dataset_statistics.json, and OpenVLA-OFT's ``proprio_projector--<step>_checkpoint.pt``. The
    value head (a critic, no part of the release) is not written; ``load_openvla_hub_dir`` reads it all back.
    ``stats``: ``{unnorm_key: {"action": ..., "proprio": ...}}``."""
    from huggingface_hub import save_torch_state_dict

    from rlfleet.policies.models.openvla.tokenizers import save_tokenizer_files

    path = Path(path)
    query = state.get("action_query")
    if query is not None and bool(query.detach().ne(0).any()):
        raise ValueError(
            "the OFT action query trained away from zero, and OpenVLA-OFT's layout has none (it zeroes "
            "the action positions' embeddings): export it with --layout rlfleet"
        )
    state = {k: v.detach() for k, v in state.items()}
    if f"{OUR_DINO}embeddings.cls_token" in state:  # timm's DINOv2 has no CLS position: fold it into the token
        pos = state[f"{OUR_DINO}embeddings.position_embeddings"]
        state[f"{OUR_DINO}embeddings.cls_token"] = state[f"{OUR_DINO}embeddings.cls_token"] + pos[:, :1]
        state[f"{OUR_DINO}embeddings.position_embeddings"] = torch.cat([torch.zeros_like(pos[:, :1]), pos[:, 1:]], 1)
    fused = f"{OUR_DINO}embeddings.cls_token" in state
    rows = openvla_rows(
        _vit_blocks(state, f"{OUR_SIGLIP}encoder.layers."),
        _vit_blocks(state, f"{OUR_DINO}encoder.layer.") if fused else None,
        f"{OUR_DINO}embeddings.register_tokens" in state,
    )
    hub = ours_to_hub(state, rows)
    path.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(
        {k: v.contiguous().clone() for k, v in hub.items()},
        str(path),
        max_shard_size=max_shard_size,
        metadata={"format": "pt"},
    )
    dtype = str(next(iter(hub.values())).dtype).removeprefix("torch.")
    pad, bos = tokenizer.pad_token_id, tokenizer.bos_token_id
    (path / "config.json").write_text(
        json.dumps(
            hub_config(
                sizes,
                model_type=model_type,
                stats=stats,
                num_images=num_images,
                image_keys=image_keys,
                pad_token_id=pad,
                bos_token_id=bos,
                dtype=dtype,
            ),
            indent=2,
        )
    )
    for name, content in hub_processor_configs(sizes).items():
        (path / name).write_text(json.dumps(content, indent=2))
    save_tokenizer_files(tokenizer, path)
    if stats:
        (path / "dataset_statistics.json").write_text(json.dumps(stats, indent=1))
    if "proprio_projector.0.weight" in state:  # as OFT's training script saves it (from DDP: module.-prefixed)
        proj = {
            f"module.{fc}.{kind}": state[f"proprio_projector.{i}.{kind}"].clone()
            for fc, i in PROPRIO_LAYERS
            for kind in ("weight", "bias")
        }
        torch.save(proj, path / f"proprio_projector--{int(step or 0)}_checkpoint.pt")
    return path


# --- checks of a written folder (what transformers' loaders would read) -----------------------------------------------
def safetensors_index_problems(path: Path) -> list[str]:
    """model.safetensors.index.json against its shards: every indexed tensor is in the shard the index names,
    every tensor of a shard is indexed, and total_size is the tensors' bytes. [] when consistent (or unsharded).
    Shards are read by their checked headers only (model_folder), never loaded."""
    path = Path(path)
    index = "model.safetensors.index.json"
    if not has_file(path, index):
        return [] if has_file(path, "model.safetensors") else [f"{path}: no model.safetensors(.index.json)"]
    data = read_config(path, index)
    problems, held, total = [], {}, 0
    for shard in shard_names(path):  # each named inside the folder
        if not (path / shard).is_file():
            problems.append(f"{shard}: named by the index, missing")
            continue
        for k, entry in tensor_headers(path, [shard]).items():
            held[k] = shard
            begin, end = entry["data_offsets"]
            total += end - begin
    weight_map = data["weight_map"]
    problems += [f"{k}: indexed in {s}, not there" for k, s in weight_map.items() if held.get(k) != s]
    problems += [f"{k}: in {s}, not indexed" for k, s in held.items() if k not in weight_map]
    size = (data.get("metadata") or {}).get("total_size")
    if size is not None and check_count("metadata.total_size", size, 1 << 50, source=path / index) != total:
        problems.append(f"metadata.total_size {size} != {total} bytes in the shards")
    return problems


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    names = sorted({p.name for p in Path(path).glob("*.safetensors")} - {"adapter_model.safetensors"})
    return {k: tuple(e["shape"]) for k, e in tensor_headers(path, names).items()}


def openvla_hub_problems(path: Path) -> list[str]:
    """An OpenVLA folder against the architecture its config.json describes: the index, then every tensor Prismatic's
    model has for those sizes (Llama from text_config; each timm ViT from its patch size, width and depth, the
    image size and, for OpenVLA-7B's backbones, the timm ids; the projector between them), with its shape, and no
    other tensor. [] when it all holds."""
    path = Path(path)
    problems = safetensors_index_problems(path)
    cfg = read_config(path)
    for key in (
        "vision_backbone_id",
        "llm_backbone_id",
        "image_sizes",
        "n_action_bins",
        "norm_stats",
        "text_config",
        "timm_model_ids",
        "use_fused_vision_backbone",
        "pad_to_multiple_of",
    ):
        if key not in cfg:
            problems.append(f"config.json: no {key}")
    shapes, want = _shapes(path), {}
    t = cfg["text_config"]
    H, V, inter = t["hidden_size"], t["vocab_size"], t["intermediate_size"]
    hd = H // t["num_attention_heads"]
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    want.update(
        {
            "language_model.model.embed_tokens.weight": (V, H),
            "language_model.lm_head.weight": (V, H),
            "language_model.model.norm.weight": (H,),
        }
    )
    for i in range(t["num_hidden_layers"]):
        b = f"language_model.model.layers.{i}."
        want.update(
            {
                f"{b}self_attn.q_proj.weight": (q, H),
                f"{b}self_attn.k_proj.weight": (kv, H),
                f"{b}self_attn.v_proj.weight": (kv, H),
                f"{b}self_attn.o_proj.weight": (H, q),
                f"{b}mlp.gate_proj.weight": (inter, H),
                f"{b}mlp.up_proj.weight": (inter, H),
                f"{b}mlp.down_proj.weight": (H, inter),
                f"{b}input_layernorm.weight": (H,),
                f"{b}post_attention_layernorm.weight": (H,),
            }
        )
    fused = bool(cfg["use_fused_vision_backbone"])
    known = {"vit_so400m_patch14_siglip_224": (1152, 27, 14), "vit_large_patch14_reg4_dinov2.lvd142m": (1024, 24, 14)}
    widths = []
    for j, src in enumerate([HUB_DINO, HUB_SIGLIP_FUSED] if fused else [HUB_SIGLIP_ALONE]):
        pw = shapes.get(f"{src}patch_embed.proj.weight")
        if pw is None:
            problems.append(f"{src}patch_embed.proj.weight: missing")
            continue
        D, p = pw[0], pw[-1]
        blocks = _vit_blocks(shapes, f"{src}blocks.")
        timm_id = (cfg["timm_model_ids"] or [None] * 2)[j]
        if timm_id in known and known[timm_id] != (D, blocks, p):
            problems.append(f"{src}: width {D}, {blocks} blocks, patch {p}; {timm_id} has {known[timm_id]}")
        n_patch = (int(cfg["image_sizes"][j]) // p) ** 2
        I = shapes.get(f"{src}blocks.0.mlp.fc1.weight", (0,))[0]
        want.update(
            {
                f"{src}patch_embed.proj.weight": (D, 3, p, p),
                f"{src}patch_embed.proj.bias": (D,),
                f"{src}pos_embed": (1, n_patch, D),
                f"{src}norm.weight": (D,),
                f"{src}norm.bias": (D,),
            }
        )
        if src == HUB_DINO and fused:
            want[f"{src}cls_token"] = (1, 1, D)
            if f"{src}reg_token" in shapes:
                want[f"{src}reg_token"] = (1, shapes[f"{src}reg_token"][1], D)
        for i in range(blocks):
            b = f"{src}blocks.{i}."
            want.update(
                {
                    f"{b}attn.qkv.weight": (3 * D, D),
                    f"{b}attn.qkv.bias": (3 * D,),
                    f"{b}attn.proj.weight": (D, D),
                    f"{b}attn.proj.bias": (D,),
                    f"{b}mlp.fc1.weight": (I, D),
                    f"{b}mlp.fc1.bias": (I,),
                    f"{b}mlp.fc2.weight": (D, I),
                    f"{b}mlp.fc2.bias": (D,),
                    **{f"{b}{n}.{k}": (D,) for n in ("norm1", "norm2") for k in ("weight", "bias")},
                }
            )
            if src == HUB_DINO and fused:
                want.update({f"{b}ls1.scale_factor": (D,), f"{b}ls2.scale_factor": (D,)})
        widths.append(D)
    dim = sum(widths)
    dims = [(dim, 4 * dim), (4 * dim, H), (H, H)] if fused else [(dim, H), (H, H)]
    for i, (a, b) in enumerate(dims):
        want.update({f"projector.fc{i + 1}.weight": (b, a), f"projector.fc{i + 1}.bias": (b,)})
    problems += [f"{k}: missing (expected {list(s)})" for k, s in want.items() if k not in shapes]
    problems += [
        f"{k}: {list(shapes[k])}, expected {list(s)}" for k, s in want.items() if k in shapes and shapes[k] != s
    ]
    # timm's SigLIP has a MAP head (attn_pool.*) that Prismatic never runs: allowed, not required (rlfleet holds none)
    problems += [f"{k}: not a tensor of this architecture" for k in shapes if k not in want and ".attn_pool." not in k]
    return problems

"""services/learner/export.py (what `coordinatorctl export` runs) per model family, from a checkpoint written the
learner's way, in both layouts: OpenVLA-OFT with LoRA merged or as a peft adapter, π0 merged; each loads back through
rlfleet's real loader (actor.model.model_path) with the checkpoint's weights. The upstream layouts are also checked
as transformers and peft read them: the tokenizer through AutoTokenizer, π0 through PI0ForConditionalGeneration, the
safetensors index against its shards, every tensor's shape against the architecture config.json describes, and the
adapter applied by peft to a model whose LM is named as the release's (language_model)."""

from __future__ import annotations

import json

import pytest
import torch

from rlfleet.config import load_config
from rlfleet.policies import build_policy
from rlfleet.policies.models.openvla.hub_layout import openvla_hub_problems, safetensors_index_problems
from rlfleet.policies.models.openvla.tokenizers import ByteTokenizer
from rlfleet.wire.spaces import TensorSpace
from services.learner import checkpoint
from services.learner.batch import RewardScaler
from services.learner.export import ExportError, export_checkpoint, write_export

SPECS = {"third_person": TensorSpace((32, 32, 3), "uint8"), "state": TensorSpace((7,), "float32")}
OFT = [
    "actor.model.model_type=openvla_oft",
    "actor.model.vla.image_size=32",
    "actor.model.num_action_chunks=2",
    "actor.model.is_lora=true",
    "actor.model.lora_rank=4",
    "actor.model.use_proprio=true",
    "env.train.max_steps_per_rollout_epoch=32",
    "actor.global_batch_size=256",
    "actor.micro_batch_size=256",
]
PI0 = ["actor.model.model_type=openpi", "actor.model.num_action_chunks=4", "env.train.max_steps_per_rollout_epoch=32"]


def _trained_checkpoint(tmp_path, overrides):
    """A policy whose trained weights differ from a fresh build's, saved as the learner saves a checkpoint."""
    cfg = load_config(None, overrides)
    torch.manual_seed(cfg.runner.seed)
    policy = build_policy(cfg.actor.model, SPECS, 4, True, cfg.algorithm.logprob_type)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))  # as training moves what trains (LoRA: adapters and heads)
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad])
    ckpt = tmp_path / "checkpoints" / "global_step_1"
    ckpt.mkdir(parents=True)
    checkpoint.save_sharded(ckpt, policy, opt)
    checkpoint.write_leader_files(
        ckpt,
        RewardScaler(cfg.algorithm.gamma).state_dict(),
        {
            "epoch": 0,
            "weights_version": 1,
            "env_steps": 0,
            "elapsed_s": 0.0,
            "action_dim": 4,
            "obs_specs": {k: s.to_json() for k, s in SPECS.items()},
            "world_size": 1,
        },
    )
    return cfg, policy, ckpt


def _equal(a: dict, b: dict, but: str = "\0") -> bool:
    """The same tensors, those whose names start with ``but`` left out (the value head: no part of a release)."""
    a, b = ({k: v for k, v in d.items() if not k.startswith(but)} for d in (a, b))
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _tokenizer_files_load(path):
    """AutoTokenizer (transformers itself, no remote code) reads the folder's tokenizer: the ids rlfleet's byte
    tokenizer gives, pad and bos as the model's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    text = "In: What action should the robot take to pick up the cube?\nOut: </s> é"
    assert tok.encode(text, add_special_tokens=False) == ByteTokenizer().encode(text)
    assert (tok.pad_token_id, tok.bos_token_id) == (ByteTokenizer.pad_token_id, ByteTokenizer.bos_token_id)


def _merged_state(policy):
    llm = policy.llm.merge_and_unload() if policy.is_lora else policy.llm
    state = {f"llm.{k}": v for k, v in llm.state_dict().items()}
    state.update({k: v for k, v in policy.state_dict().items() if not k.startswith("llm.")})
    return state


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing")
def test_oft_lora_merged_and_as_adapter(tmp_path):
    cfg, trained, ckpt = _trained_checkpoint(tmp_path, OFT)
    want = _merged_state(trained)
    merged = export_checkpoint(cfg, ckpt, tmp_path / "merged", layout="rlfleet")
    assert {"config.json", "model.safetensors"} <= {p.name for p in merged.iterdir()}
    back = build_policy(
        load_config(None, [*OFT, "actor.model.is_lora=false", f"actor.model.model_path={merged}"]).actor.model,
        SPECS,
        4,
        True,
    )
    assert _equal(back.state_dict(), want)

    adapter = export_checkpoint(cfg, ckpt, tmp_path / "adapter", lora="adapter", layout="rlfleet")
    names = {p.name for p in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "modules.safetensors"} <= names
    assert "model.safetensors" not in names
    from peft import PeftModel
    from safetensors.torch import load_file

    torch.manual_seed(cfg.runner.seed)  # the base as the run built it (here: from sizes, model_path null)
    base = build_policy(load_config(None, [*OFT, "actor.model.is_lora=false"]).actor.model, SPECS, 4, True)
    llm = PeftModel.from_pretrained(base.llm, str(adapter)).merge_and_unload()
    got = {f"llm.{k}": v for k, v in llm.state_dict().items()}
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in got)
    modules = load_file(str(adapter / "modules.safetensors"))
    assert any(k.startswith("proprio_projector.") for k in modules) and any(
        k.startswith("value_head.") for k in modules
    )
    assert all(torch.equal(v, want[k]) for k, v in modules.items())
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] is None


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing")
def test_oft_lora_in_openvlas_released_layout(tmp_path):
    """--layout upstream (the default): openvla/openvla-7b's layout, sharded; loaded back by rlfleet's hub-layout
    loader with the merged weights (the value head, no part of a release, starts fresh)."""
    cfg, trained, ckpt = _trained_checkpoint(tmp_path, OFT)
    want = _merged_state(trained)
    out = export_checkpoint(cfg, ckpt, tmp_path / "up", max_shard_size="200KB")
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "processor_config.json",
        "proprio_projector--1_checkpoint.pt",
    } <= names
    assert len([n for n in names if n.startswith("model-000")]) > 1 and "model.safetensors" not in names
    assert openvla_hub_problems(out) == []  # index <-> shards, and each tensor's shape for config.json's sizes
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["OpenVLAForActionPrediction"] and config["use_fused_vision_backbone"] is False
    assert config["text_config"]["hidden_size"] == trained.sizes["llm_hidden_size"]
    assert config["num_images_in_input"] == 1 and config["n_action_bins"] == 256
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {k.split(".")[0] for k in index} == {"vision_backbone", "projector", "language_model"}
    assert "vision_backbone.featurizer.blocks.0.attn.qkv.weight" in index and "language_model.lm_head.weight" in index
    proj = torch.load(out / "proprio_projector--1_checkpoint.pt", weights_only=True)
    assert sorted(proj) == ["module.fc1.bias", "module.fc1.weight", "module.fc2.bias", "module.fc2.weight"]
    _tokenizer_files_load(out)
    back = build_policy(
        load_config(None, [*OFT, "actor.model.is_lora=false", f"actor.model.model_path={out}"]).actor.model,
        SPECS,
        4,
        True,
    )
    assert _equal(back.state_dict(), want, but="value_head.")

    # the adapter in the release's module names: peft applies it to a model whose LM is `language_model`
    adapter = export_checkpoint(cfg, ckpt, tmp_path / "adapter", lora="adapter")
    names = {p.name for p in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "proprio_projector--1_checkpoint.pt"} <= names
    assert "modules.safetensors" not in names
    from peft import PeftModel
    from safetensors.torch import load_file

    keys = load_file(str(adapter / "adapter_model.safetensors"))
    assert keys and all(k.startswith("base_model.model.language_model.model.layers.") for k in keys)
    assert json.loads((adapter / "adapter_config.json").read_text())["auto_mapping"] is None  # not the LM's class
    torch.manual_seed(cfg.runner.seed)
    base = build_policy(load_config(None, [*OFT, "actor.model.is_lora=false"]).actor.model, SPECS, 4, True)
    released = torch.nn.Module()
    released.language_model = base.llm
    merged = PeftModel.from_pretrained(released, str(adapter)).merge_and_unload()
    got = {f"llm.{k}": v for k, v in merged.language_model.state_dict().items()}
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in got)


def test_openvla_released_layout_round_trips_dinosiglip(tmp_path):
    """The fused backbone (DINOv2 with registers + SigLIP): the export writes the tensors the loader's own test
    builds by hand (tests/rlfleet/test_openvla.py), folds a non-zero DINOv2 CLS position into the CLS token (timm has
    none) and acts and evaluates the same after loading; an OFT action query away from zero is refused."""
    from tests.rlfleet.test_openvla import INSTR, _obs, _to_openvla_hub

    sizes = [
        "actor.model.vla.use_dinov2=true",
        "actor.model.vla.dino_registers=4",
        "actor.model.vla.dino_hidden_size=96",
        "actor.model.vla.dino_heads=4",
        "actor.model.vla.dino_intermediate_size=192",
        "actor.model.vla.vision_heads=2",
        "actor.model.vla.image_size=32",
        "actor.model.vla.vocab_size=1088",
        "actor.model.vla.action_token_end=1024",
    ]
    cfg = load_config(None, ["actor.model.model_type=openvla", *sizes])
    torch.manual_seed(0)
    specs = {
        "third_person": TensorSpace((32, 32, 3), "uint8"),
        "wrist": TensorSpace((32, 32, 3), "uint8"),
        "state": TensorSpace((7,), "float32"),
    }
    p = build_policy(cfg.actor.model, specs, 4, True, "token_level")
    with torch.no_grad():  # the loader test's convention: a zero CLS position
        p.vision.dino.embeddings.position_embeddings[:, 0] = 0.0
    from safetensors.torch import load_file

    hub = {
        k: v for f in write_export(p, tmp_path / "zero-cls").glob("*.safetensors") for k, v in load_file(str(f)).items()
    }
    assert _equal(hub, _to_openvla_hub(p)) and openvla_hub_problems(tmp_path / "zero-cls") == []
    with torch.no_grad():
        p.vision.dino.embeddings.position_embeddings[:, 0].normal_()
    out = write_export(p, tmp_path / "up")
    config = json.loads((out / "config.json").read_text())
    assert (
        config["use_fused_vision_backbone"] and config["pad_to_multiple_of"] == 64 and len(config["image_sizes"]) == 2
    )
    other = load_config(None, ["actor.model.model_type=openvla", f"actor.model.model_path={out}"])  # TINY's heads
    q = build_policy(other.actor.model, specs, 4, True, "token_level")  # heads from config.json's rlfleet entry
    assert q.vision.dino.config.num_attention_heads == 4 and q.vision.siglip.config.num_attention_heads == 2
    obs = _obs()
    want, got = p.act(obs, True, INSTR), q.act(obs, True, INSTR)
    assert torch.equal(want.forward_inputs["action_bins"], got.forward_inputs["action_bins"])
    assert (q.evaluate(obs, want.forward_inputs, INSTR).log_probs - want.log_probs).abs().max() < 1e-5
    cfg = load_config(
        None,
        [
            "actor.model.model_type=openvla_oft",
            "actor.model.vla.image_size=32",
            "actor.model.num_action_chunks=2",
            "env.train.max_steps_per_rollout_epoch=32",
            "actor.global_batch_size=256",
            "actor.micro_batch_size=256",
        ],
    )
    oft = build_policy(cfg.actor.model, SPECS, 4, True, "token_level")
    with torch.no_grad():
        oft.action_query.add_(0.1)
    with pytest.raises(ExportError, match="action query trained away from zero.*--layout rlfleet"):
        write_export(oft, tmp_path / "oft")


def test_pi0_both_layouts_and_adapter_refused(tmp_path):
    cfg, trained, ckpt = _trained_checkpoint(tmp_path, PI0)
    out = export_checkpoint(cfg, ckpt, tmp_path / "pi0", layout="rlfleet")
    back = build_policy(
        load_config(None, [*PI0, f"actor.model.model_path={out}"]).actor.model,
        SPECS,
        4,
        True,
        cfg.algorithm.logprob_type,
    )
    assert _equal(back.state_dict(), trained.state_dict())

    # transformers' π0 layout (lerobot/pi0_base as rlfleet loads it): PI0ForConditionalGeneration reads it back
    up = export_checkpoint(cfg, ckpt, tmp_path / "pi0-up", max_shard_size="300KB")
    assert safetensors_index_problems(up) == [] and json.loads((up / "config.json").read_text())["model_type"] == "pi0"
    index = json.loads((up / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("paligemma_with_expert.paligemma.") for k in index)  # lerobot's names
    assert any(k.startswith("paligemma_with_expert.gemma_expert.") for k in index)
    _tokenizer_files_load(up)
    back = build_policy(
        load_config(None, [*PI0, f"actor.model.model_path={up}"]).actor.model,
        SPECS,
        4,
        True,
        cfg.algorithm.logprob_type,
    )
    assert _equal(back.state_dict(), trained.state_dict(), but="value_head.")
    with pytest.raises(ExportError, match="trained without LoRA"):
        write_export(trained, tmp_path / "nope", lora="adapter")
    pi05 = build_policy(load_config(None, [*PI0, "actor.model.openpi.pi05=true"]).actor.model, SPECS, 4, True)
    with pytest.raises(ExportError, match="π0.5 .* no upstream layout transformers loads.*--layout rlfleet"):
        write_export(pi05, tmp_path / "pi05")
    with pytest.raises(ExportError, match="--layout: 'hub' is not one of upstream, rlfleet"):
        write_export(trained, tmp_path / "bad", layout="hub")

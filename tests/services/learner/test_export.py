"""services/learner/export.py (what `coordinatorctl export` runs) per model family, from a checkpoint written the
learner's way: OpenVLA-OFT with LoRA merged or as a peft adapter, π0 merged; each loads back with the checkpoint's
weights."""

from __future__ import annotations

import json

import pytest
import torch

from rlfleet.config import load_config
from rlfleet.policies import build_policy
from rlfleet.wire.spaces import TensorSpace
from services.learner import checkpoint
from services.learner.export import ExportError, export_checkpoint, write_export

SPECS = {"third_person": TensorSpace((32, 32, 3), "uint8"), "state": TensorSpace((7,), "float32")}
OFT = ["actor.model.model_type=openvla_oft", "actor.model.vla.image_size=32", "actor.model.num_action_chunks=2",
       "actor.model.is_lora=true", "actor.model.lora_rank=4", "actor.model.use_proprio=true",
       "env.train.max_steps_per_rollout_epoch=32", "actor.global_batch_size=256", "actor.micro_batch_size=256"]
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
    checkpoint.write_leader_files(ckpt, {"mean": torch.zeros(1)}, {
        "epoch": 0, "weights_version": 1, "env_steps": 0, "elapsed_s": 0.0, "action_dim": 4,
        "obs_specs": {k: s.to_json() for k, s in SPECS.items()}, "world_size": 1})
    return cfg, policy, ckpt


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _merged_state(policy):
    llm = policy.llm.merge_and_unload() if policy.is_lora else policy.llm
    state = {f"llm.{k}": v for k, v in llm.state_dict().items()}
    state.update({k: v for k, v in policy.state_dict().items() if not k.startswith("llm.")})
    return state


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing")
def test_oft_lora_merged_and_as_adapter(tmp_path):
    cfg, trained, ckpt = _trained_checkpoint(tmp_path, OFT)
    want = _merged_state(trained)
    merged = export_checkpoint(cfg, ckpt, tmp_path / "merged")
    assert {"config.json", "model.safetensors"} <= {p.name for p in merged.iterdir()}
    back = build_policy(load_config(None, [*OFT, "actor.model.is_lora=false",
                                           f"actor.model.model_path={merged}"]).actor.model, SPECS, 4, True)
    assert _equal(back.state_dict(), want)

    adapter = export_checkpoint(cfg, ckpt, tmp_path / "adapter", lora="adapter")
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
    assert any(k.startswith("proprio_projector.") for k in modules) and any(k.startswith("value_head.")
                                                                            for k in modules)
    assert all(torch.equal(v, want[k]) for k, v in modules.items())
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] is None


def test_pi0_merged_and_adapter_refused(tmp_path):
    cfg, trained, ckpt = _trained_checkpoint(tmp_path, PI0)
    out = export_checkpoint(cfg, ckpt, tmp_path / "pi0")
    back = build_policy(load_config(None, [*PI0, f"actor.model.model_path={out}"]).actor.model, SPECS, 4, True,
                        cfg.algorithm.logprob_type)
    assert _equal(back.state_dict(), trained.state_dict())
    with pytest.raises(ExportError, match="trained without LoRA"):
        write_export(trained, tmp_path / "nope", lora="adapter")

"""The real-size VLA configs build the published architectures: each is built on PyTorch's meta device (shapes
only, no memory) and its parameters are counted against the released models' sizes."""

from __future__ import annotations

import pytest
import torch

from rlfleet.config import load_config
from rlfleet.policies import build_policy
from rlfleet.wire.spaces import TensorSpace

IMAGE = TensorSpace((224, 224, 3), "uint8")


def _count(module, skip: str = "\0") -> int:
    return sum(p.numel() for n, p in module.named_parameters() if skip not in n)


def _build(name: str, specs: dict, action_dim: int):
    cfg = load_config(name, [])
    with torch.device("meta"):
        return cfg, build_policy(cfg.actor.model, specs, action_dim, True, cfg.algorithm.logprob_type)


@pytest.mark.parametrize(
    "name, specs",
    [
        ("maniskill_pickcube_ppo_openvla", {"pixels": IMAGE, "state": TensorSpace((25,), "float32")}),
        ("maniskill_put_on_plate_ppo_openvla", {"pixels": IMAGE, "state": TensorSpace((25,), "float32")}),
        (
            "libero_spatial_grpo_openvla_oft",
            {"agentview": IMAGE, "wrist": IMAGE, "state": TensorSpace((8,), "float32")},
        ),
    ],
)
def test_openvla_7b_architecture(name, specs):
    cfg, policy = _build(name, specs, 7)
    heads = _count(policy.value_head) if getattr(policy, "value_head", None) is not None else 0
    # OpenVLA-7B: Llama-2 7B with 32064 rows (6,738,939,904) + SigLIP so400m and DINOv2 ViT-L/14 with registers
    # (715,675,376 without SigLIP's unused attention-pool head) + the fused projector (71,385,600)
    oft = 4096 if cfg.actor.model.model_type == "openvla_oft" else 0  # OFT's action-query embedding
    assert _count(policy, skip="lora_") - heads - oft == 7_526_000_880
    lora = _count(policy) - _count(policy, skip="lora_")
    assert lora == 79_953_920  # rank 32 on every linear layer of the Llama (what trains and travels)
    assert cfg.actor.model.precision == "bf16" and cfg.actor.model.is_lora
    assert policy.autocast_dtype == torch.bfloat16


def test_pi0_architecture():
    cfg, policy = _build("metaworld_mt50_ppo_pi0", {"corner": IMAGE, "state": TensorSpace((49,), "float32")}, 4)
    vlm, expert = _count(policy.pi0.model.vlm), _count(policy.pi0.model.dit)
    unused = policy.pi0.model.dit.embed_tokens.weight
    assert vlm == 2_938_573_760  # PaliGemma 3B (SigLIP so400m + Gemma 2B)
    assert expert - unused.numel() == 311_464_960  # the Gemma 300M action expert
    assert not unused.requires_grad  # its token table is never used (the expert reads embeddings)
    assert policy.num_action_chunks == 5 and policy.autocast_dtype == torch.bfloat16


def test_a_real_size_config_is_refused_in_seconds_where_it_cannot_fit(tmp_path):
    """`coordinatorctl start` of a real-size config on a machine without the memory fails before starting anything,
    with the numbers (here: a 2.4 GB budget stands in for a small machine)."""
    from rlfleet.config import fit
    from rlfleet.policies import footprint

    cfg = load_config("metaworld_mt50_ppo_pi0", [])
    fp = footprint.estimate(cfg.actor.model, "chunk_level")
    assert fp.parameters == 3_518_742_497  # π0 (the expert's unused token table included) + a value head
    assert (
        fp.inference_bytes("bf16") == 2 * 2 * fp.parameters
        and fp.learner_bytes() == 4 * fp.parameters + 12 * fp.trainable
    )
    tiny = load_config("pandapickcube_vision_ppo_openvla_tiny", [])
    small = footprint.estimate(tiny.actor.model, "token_level")
    assert small.parameters < 5_000_000 and fit.check(tiny) is None  # tiny models fit anywhere
    original = footprint.available_memory
    footprint.available_memory = lambda: ("this machine's available RAM (no GPU)", 2.4e9)
    try:
        why = fit.check(cfg)
    finally:
        footprint.available_memory = original
    assert why.startswith("the openpi policy of this config has 3.52B parameters")
    # one inference server's 2 bf16 copies (14.1 GB) + the one learner rank (86.7 GB: tests/rlfleet/test_footprint.py)
    assert "each inference server holds 2 copies (14.1 GB" in why and "= 86.7 GB for one rank" in why
    assert "100.7 GB where this machine's available RAM (no GPU) has 2.4 GB" in why
    footprint.available_memory = lambda: ("this machine's available RAM (no GPU)", 50e9)
    try:  # supervised fine-tuning holds the learner's copy only: one process, a batch of sft.batch_size rows
        why = fit.check(cfg, inference=False)
        assert "the learner, per rank of 1: 53.1 GB of fp32 weights" in why and "a micro batch of 32 rows" in why
        assert why.count("inference server") == 0 and "ranks need" not in why
    finally:
        footprint.available_memory = original
    # a KL penalty (algorithm.kl_beta) keeps a frozen fp32 copy in the learner; with LoRA the base is the reference
    assert fp.learner_bytes(reference_copy=True) == fp.learner_bytes() + 4 * fp.parameters
    footprint.available_memory = lambda: ("the smallest of 8 GPU(s)", 61e9)
    try:  # 88.0 GB for one rank on a GPU does not fit a 61 GB GPU; two ranks (60.1 GB each) do
        why = fit.check(cfg)
        assert "= 88.0 GB for one rank" in why and "2 ranks need 60.1 GB each" in why
        why = fit.check(load_config("metaworld_mt50_ppo_pi0", ["algorithm.kl_beta=0.05"]))
        assert "14.1 GB of the KL reference (a frozen copy for algorithm.kl_beta" in why
        assert "3 ranks need 55.7 GB each" in why  # sharded too: 2 ranks need 67.1 GB each (7.0 GB of it)
        vla = load_config("maniskill_pickcube_ppo_openvla", ["algorithm.kl_beta=0.05"])
        assert vla.actor.model.is_lora and fit.check(vla) is None  # no copy: the base with adapters off
    finally:
        footprint.available_memory = original
    # a checkpoint directory is sized from its safetensors headers, without reading the tensors
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    assert footprint.checkpoint_parameters(tmp_path) == 17

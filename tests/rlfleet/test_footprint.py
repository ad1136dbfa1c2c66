"""The start-up memory check counts the learner per rank (rlfleet/policies/footprint.py): FSDP2 shards weights,
gradients, Adam state and the KL reference over the ranks; the gathered units, autocast's copies and a micro
batch's activations are each rank's in full. The real-size configs are built on PyTorch's meta device (no memory)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from rlfleet.config import fit, load_config
from rlfleet.policies import footprint

GPUS = "the smallest of 8 GPU(s)"
RAM = "this machine's available RAM (no GPU)"
PLACED_2 = ["cluster.num_gpus_per_node=8", "cluster.component_placement={'env,rollout': 0-1, actor: 2-3}"]


def _estimate(name: str, *overrides: str):
    cfg = load_config(name, list(overrides))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cfg, footprint.estimate(cfg.actor.model, cfg.algorithm.logprob_type)


@pytest.fixture(scope="module")
def pi0():
    return _estimate("metaworld_mt50_ppo_pi0")


def _on(monkeypatch, where: str, have: float):
    monkeypatch.setattr(footprint, "available_memory", lambda: (where, have))


def test_two_ranks_halve_the_sharded_parts_of_a_real_size_model(pi0):
    cfg, fp = pi0
    assert fp.parameters == 3_518_742_497 and fp.trainable == 3_255_418_849 and fp.precision == "bf16"
    # the FSDP units: a Gemma 2B decoder layer is the largest; the root keeps the token tables (the expert's frozen)
    assert fp.largest_unit == fp.largest_unit_trainable == 110_104_576
    assert fp.root == 795_356_449 and fp.root_trainable == fp.root - 263_323_648
    kw = dict(gpu=True, reference_copy=True, rows=cfg.actor.micro_batch_size)
    one, two, four = fp.rank_parts(1, **kw), fp.rank_parts(2, **kw), fp.rank_parts(4, **kw)
    assert one["sharded"] == 4 * fp.parameters + 12 * fp.trainable == fp.learner_bytes()
    assert two["sharded"] == one["sharded"] // 2 and two["reference"] == one["reference"] // 2 == 2 * fp.parameters
    assert four["sharded"] == two["sharded"] // 2 and four["reference"] == two["reference"] // 2
    assert fp.rank_parts(8, **kw)["sharded"] == math.ceil(one["sharded"] / 8)
    # what is not sharded is each rank's in full: the same at 2 and 4 ranks
    assert two["activations"] == four["activations"] == one["activations"] == 20 * fp.activations_per_row > 0
    # bf16 gathers of the root, the largest unit and the next; fp32 reduce-scatter of their bf16 gradients
    assert (
        two["gathered"]
        == four["gathered"]
        == (2 * (fp.root + 2 * fp.largest_unit) + 6 * (fp.root_trainable + fp.largest_unit_trainable))
    )
    # on a GPU, the optimizer step's temporaries: 10% of the rank's fp32 trainable weights (measured on an H200)
    assert one["transient"] == math.ceil(0.4 * fp.trainable) and two["transient"] == math.ceil(0.2 * fp.trainable)
    assert fp.rank_bytes(2, **kw) - fp.rank_bytes(4, **kw) == pytest.approx(
        (two["sharded"] + two["reference"] + two["transient"]) / 2, abs=2
    )
    # one rank is not sharded: nothing gathered, but autocast's bf16 copies of the trained weights
    assert one["gathered"] == 0 and one["autocast"] == 2 * fp.trainable and two["autocast"] == 0
    # CPU ranks gather fp32 and run their fp32 weights under autocast
    cpu = fp.rank_parts(2, gpu=False, reference_copy=True, rows=20)
    assert cpu["gathered"] == 4 * (fp.root + 2 * fp.largest_unit) + 4 * (fp.root_trainable + fp.largest_unit_trainable)
    assert cpu["autocast"] == 2 * fp.trainable and cpu["sharded"] == two["sharded"]


def test_the_refusal_names_the_per_rank_numbers_and_the_world_size_that_fits(pi0, monkeypatch):
    cfg, fp = pi0
    _on(monkeypatch, GPUS, 47e9)
    why = fit.check(cfg)
    assert (
        "the learner, per rank of 1: 53.1 GB of fp32 weights, gradients and Adam state of what trains "
        "(unsharded), 6.5 GB of bf16 autocast copies of the weights, 27.0 GB of activations (estimated, a micro "
        "batch of 20 rows), 1.3 GB of optimizer-step temporaries = 88.0 GB for one rank; that is 88.0 GB where the "
        "smallest of 8 GPU(s) has 47.0 GB"
    ) in why
    # 3 ranks need 51.0 GB each, 4 ranks 46.5 GB: 4 is the smallest world size that fits
    assert fp.rank_bytes(3, gpu=True, rows=20) > 47e9 >= fp.rank_bytes(4, gpu=True, rows=20)
    assert "4 ranks need 46.5 GB each: place the actor on 4 GPUs (cluster.component_placement, e.g. actor: 0-3)" in why
    # the world size comes from the actor placement when the cluster has GPUs
    two = load_config("metaworld_mt50_ppo_pi0", PLACED_2)
    four = load_config(
        "metaworld_mt50_ppo_pi0",
        ["cluster.num_gpus_per_node=8", "cluster.component_placement={'env,rollout': 0-3, actor: 4-7}"],
    )
    assert fit.learner_world_size(two) == 2 and fit.learner_world_size(four) == 4
    assert fit.check(four) is None
    why = fit.check(two)
    assert (
        "per rank of 2: 26.6 GB of fp32 weights, gradients and Adam state of what trains (its 1/2 shard), 5.9 GB "
        "of FSDP units gathered whole (bf16), 27.0 GB of activations"
    ) in why
    assert "= 60.1 GB for each rank" in why and "4 ranks need 46.5 GB each" in why and "autocast" not in why
    # nothing fits where a rank's gathered units and activations alone are more than a GPU
    _on(monkeypatch, GPUS, 25e9)
    assert "No number of ranks fits: the gathered units and activations alone are 32.9 GB per rank" in fit.check(cfg)


def test_on_one_host_the_ranks_add_up(pi0, monkeypatch):
    """CPU ranks share the machine's RAM: the need is the sum over ranks plus the inference servers, and more ranks
    only add their gathered units, autocast copies and activations."""
    cfg, fp = pi0
    cfg4 = load_config("metaworld_mt50_ppo_pi0", ["cluster.learner_world_size=4"])
    assert fit.learner_world_size(cfg4) == 4 and fit.learner_world_size(cfg) == 1
    one, four = fp.rank_bytes(1, gpu=False, rows=20), fp.rank_bytes(4, gpu=False, rows=20)
    server = fp.inference_bytes("bf16")
    assert 4 * four > one  # the shards add up to one rank's whole; the rest is every rank's own
    _on(monkeypatch, RAM, (server + one + server + 4 * four) / 2)  # between the one-rank and four-rank totals
    assert fit.check(cfg) is None
    why = fit.check(cfg4)
    assert f"its 4 ranks {4 * four / 1e9:.1f} GB together; that is {(server + 4 * four) / 1e9:.1f} GB where" in why
    assert "fp32 weights, gradients and Adam state of what trains (its 1/4 shard)" in why
    assert "GB of FSDP units gathered whole (fp32)" in why
    assert (
        f"With 1 rank ({one / 1e9:.1f} GB) the run would need {(server + one) / 1e9:.1f} GB: set "
        f"cluster.learner_world_size=1" in why
    )
    _on(monkeypatch, RAM, 2.4e9)
    assert "no number of ranks fits here" in fit.check(cfg4)


def test_the_kl_reference_is_sharded_like_the_weights(pi0, monkeypatch):
    cfg, fp = pi0
    kl = load_config("metaworld_mt50_ppo_pi0", ["algorithm.kl_beta=0.05", *PLACED_2])
    _on(monkeypatch, GPUS, 61e9)
    why = fit.check(kl)
    # 4 B x 3.52B parameters / 2 ranks
    assert (
        f"{2 * fp.parameters / 1e9:.1f} GB of the KL reference (a frozen copy for algorithm.kl_beta, sharded the "
        f"same way)"
        in why
        and "7.0 GB of the KL reference" in why
    )
    assert "= 67.1 GB for each rank" in why and "3 ranks need 55.7 GB each" in why
    assert fit.check(load_config("metaworld_mt50_ppo_pi0", PLACED_2)) is None  # kl_beta 0: 60.1 GB fits
    # supervised fine-tuning has no reference, whatever kl_beta says
    _on(monkeypatch, RAM, 50e9)
    assert "KL reference" not in fit.check(kl, inference=False)


def test_lora_shrinks_the_trained_part_and_keeps_no_reference(monkeypatch):
    lora_cfg, lora = _estimate("maniskill_pickcube_ppo_openvla")
    full_cfg, full = _estimate("maniskill_pickcube_ppo_openvla", "actor.model.is_lora=false")
    assert lora_cfg.actor.model.is_lora and lora_cfg.actor.model.gradient_checkpointing
    assert full.trainable == full.parameters == 7_530_197_233
    heads = full.parameters - 7_526_000_880  # the value head trains either way
    assert lora.trainable == 79_953_920 + heads and lora.parameters == full.parameters + 79_953_920
    # a Llama decoder layer is the largest unit; with LoRA only its adapters (79,953,920 / 32) train
    assert full.largest_unit == full.largest_unit_trainable == 202_383_360
    assert lora.largest_unit == 202_383_360 + 2_498_560 and lora.largest_unit_trainable == 2_498_560
    assert lora.autocast_parameters == lora.trainable and full.autocast_parameters == full.parameters
    for world in (1, 2, 4):
        sharded = lora.rank_parts(world, gpu=True, rows=16)["sharded"]
        assert sharded == math.ceil((4 * lora.parameters + 12 * lora.trainable) / world)
        assert sharded < full.rank_parts(world, gpu=True, rows=16)["sharded"] / 3
    # the frozen vision backbone keeps no activations: only the checkpointed Llama's (256 patches + 64 prompt + 7
    # action tokens + 2) x (32 layers x 4 B x 4096 + one bf16 block of 10 x 4096 + 4 x 11008)
    assert lora.activations_per_row == 329 * (32 * 4 * 4096 + 2 * (10 * 4096 + 4 * 11008))
    assert full.activations_per_row > 4 * lora.activations_per_row
    kl = load_config("maniskill_pickcube_ppo_openvla", ["algorithm.kl_beta=0.05"])
    _on(monkeypatch, RAM, 1e9)
    why = fit.check(kl)
    assert "KL reference" not in why and "(0.084B trained)" in why  # the reference is the base, adapters off
    # without gradient checkpointing, the backward into the adapters keeps bf16 copies of the frozen base
    _, plain = _estimate("maniskill_pickcube_ppo_openvla", "actor.model.gradient_checkpointing=false")
    assert plain.autocast_parameters == plain.parameters


def test_gradient_checkpointing_lowers_the_activations():
    on = load_config("maniskill_pickcube_ppo_openvla", ["actor.model.is_lora=false"]).actor.model
    off = load_config(
        "maniskill_pickcube_ppo_openvla", ["actor.model.is_lora=false", "actor.model.gradient_checkpointing=false"]
    ).actor.model
    assert on.gradient_checkpointing and footprint.activation_bytes(off) > footprint.activation_bytes(on)
    block = 2 * (10 * 4096 + 4 * 11008)  # one bf16 Llama block's activations per token
    assert footprint.activation_bytes(off) - footprint.activation_bytes(on) == 329 * (
        32 * block - (32 * 4 * 4096 + block)
    )
    # π0's VLM frozen (train_expert_only): only the expert's pass and the prefix keys/values it reads
    pi0 = load_config("metaworld_mt50_ppo_pi0", []).actor.model
    frozen = load_config("metaworld_mt50_ppo_pi0", ["actor.model.openpi.train_expert_only=true"]).actor.model
    assert footprint.activation_bytes(frozen) == 6 * 18 * 2 * (10 * 1024 + 4 * 4096) + 304 * 18 * 2 * 256 * 2
    assert footprint.activation_bytes(pi0) > 100 * footprint.activation_bytes(frozen)


def test_a_checkpoint_is_split_into_units_from_its_headers(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {
            "llm.model.layers.0.w": torch.zeros(3, 4),
            "llm.model.layers.0.b": torch.zeros(4),
            "llm.model.layers.1.w": torch.zeros(5, 4),
            "vision.encoder.layer.0.w": torch.zeros(2),
            "llm.model.embed_tokens.weight": torch.zeros(5),
        },
        str(tmp_path / "model.safetensors"),
    )
    cfg = load_config("pandapickcube_vision_ppo_openvla_tiny", [f"actor.model.model_path={tmp_path}"])
    fp = footprint.estimate(cfg.actor.model, "token_level")
    assert (fp.parameters, fp.trainable, fp.largest_unit, fp.root) == (43, 43, 20, 5)
    assert fp.activations_per_row == footprint.activation_bytes(cfg.actor.model) > 0


def test_an_evaluation_learner_counts_weights_only(pi0, monkeypatch):
    """runner.only_eval (`coordinatorctl eval`): the learner never trains or runs the policy, so no gradients, Adam
    state, autocast copies, activations or optimizer temporaries; the real-size π0 that needs 4 GPUs of 47 GB to
    train is evaluated with its learner on one."""
    cfg, fp = pi0
    ev = load_config("metaworld_mt50_ppo_pi0", ["runner.only_eval=true"])
    _on(monkeypatch, GPUS, 47e9)
    assert "88.0 GB for one rank" in fit.check(cfg)
    assert fit.check(ev) is None
    _on(monkeypatch, GPUS, 12e9)
    why = fit.check(ev)
    weights = 4 * fp.parameters / 1e9
    assert (
        f"the learner, per rank of 1: {weights:.1f} GB of fp32 weights (runner.only_eval: no gradients or Adam "
        f"state) (unsharded), 0.0 GB of activations"
    ) in why, why
    assert "optimizer-step temporaries" not in why and "autocast" not in why
    _on(monkeypatch, GPUS, 4 * fp.parameters + 1)  # the inference server's two bf16 copies are as large: both fit
    assert fit.check(ev) is None


def test_a_learner_rank_and_an_inference_server_on_one_gpu_add_up(monkeypatch):
    """RLinf's collocated placement (`actor,rollout: 0`) puts the learner's rank and the inference server's copies on
    one GPU: the check adds them up there, says so, and says that apart they would fit."""
    one_gpu = [
        "cluster.num_gpus_per_node=1",
        "cluster.component_placement={'actor,rollout': 0}",
        "actor.micro_batch_size=4",
    ]
    shared = load_config("metaworld_mt50_ppo_pi0", one_gpu)
    apart = load_config(
        "metaworld_mt50_ppo_pi0",
        [
            "cluster.num_gpus_per_node=2",
            "actor.micro_batch_size=4",
            "cluster.component_placement={'env,rollout': 1, actor: 0}",
        ],
    )
    assert fit.shared_gpu(shared) == (0, 1) and fit.shared_gpu(apart) == (None, 0)
    # the default placement on 8 GPUs: the inference server acts on GPU 0, which holds rank 0 too
    assert fit.shared_gpu(load_config("metaworld_mt50_ppo_pi0", ["cluster.num_gpus_per_node=8"])) == (0, 1)
    _on(monkeypatch, "the smallest of 1 GPU(s)", 75e9)
    assert fit.check(apart) is None  # 66.4 GB and 14.1 GB, each on its GPU
    why = fit.check(shared)
    assert (
        "= 66.4 GB for one rank; GPU 0 holds a learner rank and 1 inference server (cluster.component_placement): "
        "66.4 + 14.1 GB; that is 80.4 GB where the smallest of 1 GPU(s) has 75.0 GB. Apart they fit"
    ) in why
    _on(monkeypatch, "the smallest of 1 GPU(s)", 85e9)
    assert fit.check(shared) is None
    expert = load_config("metaworld_mt50_ppo_pi0", [*one_gpu, "actor.model.openpi.train_expert_only=true"])
    _on(monkeypatch, "the smallest of 1 GPU(s)", 40e9)
    assert fit.check(expert) is None  # the action expert trains: 18.8 + 14.1 GB

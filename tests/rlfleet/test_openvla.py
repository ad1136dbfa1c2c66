"""OpenVLA / OpenVLA-OFT policies (real transformers models at tiny sizes): the log-prob path, PPO and GRPO steps
on a fixed batch, LoRA, the checkpoint layout, and weight updates into the inference engine."""

from __future__ import annotations

import json

import pytest
import torch

from rlfleet.config import load_config
from rlfleet.policies import build_policy
from rlfleet.wire.spaces import TensorSpace
from services.learner import grpo, ppo

SPECS = {
    "third_person": TensorSpace((32, 32, 3), "uint8"),
    "wrist": TensorSpace((32, 32, 3), "uint8"),
    "state": TensorSpace((7,), "float32"),
}
INSTR = ["pick up the red cube and lift it"] * 4 + ["push the cube to the left"] * 4


def _policy(model_type="openvla", logprob_type="token_level", *overrides):
    cfg = load_config(
        None,
        [
            f"actor.model.model_type={model_type}",
            "actor.model.vla.image_size=32",
            "env.train.max_steps_per_rollout_epoch=32",
            "actor.global_batch_size=256",
            "actor.micro_batch_size=256",
            *overrides,
        ],
    )
    torch.manual_seed(0)
    return cfg, build_policy(cfg.actor.model, SPECS, 4, True, logprob_type)


def _obs(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {
        "third_person": torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g),
        "wrist": torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g),
        "state": torch.randn(n, 7, generator=g),
    }


@pytest.mark.parametrize(
    "model_type, chunks, lora", [("openvla", 1, False), ("openvla_oft", 4, False), ("openvla_oft", 2, True)]
)
@pytest.mark.parametrize("logprob_type", ["token_level", "action_level", "chunk_level"])
def test_act_and_evaluate_share_one_log_prob(model_type, chunks, lora, logprob_type):
    _, p = _policy(
        model_type,
        logprob_type,
        f"actor.model.num_action_chunks={chunks}",
        f"actor.model.is_lora={str(lora).lower()}",
        "actor.model.lora_rank=4",
    )
    obs = _obs()
    out = p.act(obs, False, INSTR)
    width = {"token_level": 4 * chunks, "action_level": chunks, "chunk_level": 1}[logprob_type]
    assert out.actions.shape == (8, chunks, 4) and out.log_probs.shape == (8, width)
    assert out.actions.abs().max() <= 1.0 and torch.isfinite(out.log_probs).all()
    ev = p.evaluate(obs, out.forward_inputs)
    assert (ev.log_probs - out.log_probs).abs().max() < 1e-5
    assert (ev.values - out.values).abs().max() < 1e-5 and ev.entropy.shape == (8,)
    greedy = p.act(obs, True, INSTR)
    assert torch.equal(greedy.actions, p.act(obs, True, INSTR).actions)  # deterministic = greedy


def test_instruction_changes_the_action_distribution():
    _, p = _policy()
    obs = _obs()
    a = p.evaluate(obs, p.act(obs, False, INSTR).forward_inputs)
    fi = p.act(obs, False, ["open the drawer"] * 8).forward_inputs
    assert not torch.equal(fi["prompt_ids"][0], p.tokenize(INSTR[:1], 1, "cpu")[0][0])
    b = p.evaluate(obs, {**fi, "action_bins": p.act(obs, False, INSTR).forward_inputs["action_bins"]})
    assert (a.log_probs - b.log_probs).abs().max() > 1e-4


def _steps(p, obs, fi, old_lp, adv, n=5, lr=1e-3, critic=None):
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=lr)
    losses = []
    for _ in range(n):
        ev = p.evaluate(obs, fi)
        loss, _ = ppo.policy_loss(
            ev.log_probs,
            old_lp,
            adv[:, None].expand_as(ev.log_probs),
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
            clip_ratio_c=None,
        )
        if critic is not None:
            v_loss, _ = ppo.value_loss(ev.values, critic[0], critic[1], value_clip=None, huber_delta=None)
            loss = loss + 0.5 * v_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, p.evaluate(obs, fi)


def test_ppo_steps_raise_the_log_prob_of_advantaged_actions_and_fit_the_value():
    _, p = _policy("openvla", "token_level")
    obs = _obs()
    out = p.act(obs, False, INSTR)
    adv = torch.tensor([1.0, -1.0] * 4)
    returns = torch.full((8,), 0.5)
    losses, ev = _steps(p, obs, out.forward_inputs, out.log_probs, adv, critic=(out.values, returns))
    assert losses[-1] < losses[0]
    moved = (ev.log_probs - out.log_probs).sum(1)
    assert (moved[adv > 0] > 0).all() and (moved[adv < 0] < 0).all()
    assert ((ev.values - returns) ** 2).mean() < ((out.values - returns) ** 2).mean()


def test_grpo_steps_with_lora_move_only_the_adapters():
    _, p = _policy(
        "openvla_oft",
        "token_level",
        "actor.model.num_action_chunks=2",
        "actor.model.is_lora=true",
        "actor.model.lora_rank=4",
        "actor.model.add_value_head=false",
    )
    base = {k: v.clone() for k, v in p.state_dict().items() if "lora_" not in k}
    obs = _obs()
    out = p.act(obs, False, INSTR)
    assert out.values is None and not p.has_critic
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0]])
    adv, mask, _ = grpo.grpo_advantages(rewards, torch.ones_like(rewards), group_size=4)
    losses, ev = _steps(p, obs, out.forward_inputs, out.log_probs, adv[0])
    assert losses[-1] < losses[0]
    moved = (ev.log_probs - out.log_probs).sum(1)
    assert (moved[adv[0] > 0] > 0).all()
    after = p.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # base weights frozen
    assert p.trains_adapters_only
    with torch.no_grad(), p.adapters_disabled():  # the KL reference of a LoRA run: the start, without a copy
        off = p.evaluate(obs, out.forward_inputs).log_probs
    assert torch.allclose(off, out.log_probs, atol=1e-5) and not torch.allclose(ev.log_probs, out.log_probs)
    with torch.no_grad():
        assert torch.allclose(p.evaluate(obs, out.forward_inputs).log_probs, ev.log_probs, atol=1e-5)
    sync = p.sync_state_dict()
    assert sync and all("lora_" in k for k in sync)
    full = sum(t.numel() * t.element_size() for t in p.state_dict().values())
    assert sum(t.numel() * t.element_size() for t in sync.values()) < full / 5


def test_checkpoint_layout_round_trip_and_clear_errors(tmp_path):
    cfg, p = _policy("openvla", "token_level", "actor.model.is_lora=true", "actor.model.lora_rank=4")
    obs = _obs()
    with torch.no_grad():
        for name, q in p.named_parameters():
            if "lora_B" in name:
                q.add_(0.05)  # adapters that change the output, to check they are merged on export
    want = p.act(obs, True, INSTR).actions
    p.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "dataset_statistics.json").write_text(
        json.dumps({"bridge": {"action": {"q01": [-2.0, -2.0, -2.0, 0.0], "q99": [2.0, 2.0, 2.0, 1.0]}}})
    )
    loaded_cfg = load_config(None, ["actor.model.model_type=openvla", f"actor.model.model_path={tmp_path / 'ckpt'}"])
    q = build_policy(loaded_cfg.actor.model, SPECS, 4, True, "token_level")
    assert torch.allclose(q.act(obs, True, INSTR).actions, want, atol=1e-6)
    unnorm_cfg = load_config(
        None,
        [
            "actor.model.model_type=openvla",
            f"actor.model.model_path={tmp_path / 'ckpt'}",
            "actor.model.unnorm_key=bridge",
        ],
    )
    r = build_policy(unnorm_cfg.actor.model, SPECS, 4, True, "token_level")
    got = r.act(obs, True, INSTR).actions
    assert torch.allclose(got[..., :3], want[..., :3] * 2.0, atol=1e-5)
    assert torch.allclose(got[..., 3], (want[..., 3] + 1) / 2, atol=1e-5)
    bad = load_config(
        None,
        [
            "actor.model.model_type=openvla",
            f"actor.model.model_path={tmp_path / 'ckpt'}",
            "actor.model.unnorm_key=libero",
        ],
    )
    with pytest.raises(KeyError, match="unnorm_key: 'libero' is not in .*has: \\['bridge'\\]"):
        build_policy(bad.actor.model, SPECS, 4, True, "token_level")
    missing = load_config(None, ["actor.model.model_type=openvla", f"actor.model.model_path={tmp_path / 'nothing'}"])
    with pytest.raises(FileNotFoundError, match="nothing: no such folder"):
        build_policy(missing.actor.model, SPECS, 4, True, "token_level")


def test_a_vla_needs_an_image_and_openvla_no_chunks():
    with pytest.raises(ValueError, match="needs an image observation"):
        cfg = load_config(None, ["actor.model.model_type=openvla"])
        build_policy(cfg.actor.model, {"state": TensorSpace((7,), "float32")}, 4, True, "token_level")
    from rlfleet.config import ConfigError

    with pytest.raises(
        ConfigError, match="an action chunk per call is for model_type openvla_oft and openpi; model_type is 'openvla'"
    ):
        load_config(
            None,
            [
                "actor.model.model_type=openvla",
                "actor.model.num_action_chunks=4",
                "actor.global_batch_size=128",
                "actor.micro_batch_size=128",
            ],
        )


def test_engine_loads_partial_updates_into_its_idle_copy():
    from services.inference.engine import InferenceEngine

    cfg, p = _policy(
        "openvla_oft",
        "token_level",
        "actor.model.num_action_chunks=2",
        "actor.model.is_lora=true",
        "actor.model.lora_rank=4",
    )
    engine = InferenceEngine(cfg.actor.model, logprob_type="token_level")
    engine.set_weights(0, {k: v.clone() for k, v in p.state_dict().items()}, obs_specs=SPECS, action_dim=4)
    first, spare = engine.model, engine._spare
    assert first is not spare
    with torch.no_grad():
        for name, q in p.named_parameters():
            if "lora_B" in name:
                q.add_(0.1)
    sync = p.sync_state_dict()
    engine.set_weights(1, {k: v.clone() for k, v in sync.items()}, partial=True)
    assert engine.model is spare and engine._spare is first  # swapped, no new copy
    assert engine.bytes_loaded < 2 * sum(t.numel() * t.element_size() for t in p.state_dict().values())
    obs = {k: v.numpy() for k, v in _obs().items()}
    res = engine.act_now(obs, True, INSTR)
    assert res.weights_version == 1
    assert torch.allclose(torch.from_numpy(res.actions), p.act(_obs(), True, INSTR).actions)


@pytest.mark.parametrize(
    "model_type, extra",
    [
        ("openvla", []),
        ("openvla_oft", ["actor.model.num_action_chunks=2"]),
        ("openpi", ["actor.model.num_action_chunks=2"]),
    ],
)
@pytest.mark.parametrize("adv_type", ["gae", "grpo"])
def test_each_vla_learns_from_ppo_and_grpo_advantages(model_type, extra, adv_type):
    """A few optimizer steps on a fixed batch lower the loss and move the log-probs the advantages' way."""
    _, p = _policy(model_type, "chunk_level", *extra)
    obs = _obs()
    out = p.act(obs, False, INSTR)
    if adv_type == "grpo":  # two groups of four, scored by return
        rewards = torch.tensor([[3.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0]])
        adv = grpo.grpo_advantages(rewards, torch.ones_like(rewards), group_size=4)[0][0]
        critic = None
    else:
        adv = torch.tensor([1.0, -1.0] * 4)
        critic = (out.values, torch.full((8,), 0.5))
    losses, ev = _steps(p, obs, out.forward_inputs, out.log_probs, adv, lr=5e-4, critic=critic)
    assert losses[-1] < losses[0], losses
    moved = (ev.log_probs - out.log_probs).sum(1).detach()
    assert moved[adv > 0].mean() > 0 > moved[adv < 0].mean()


def _to_openvla_hub(policy) -> dict[str, torch.Tensor]:
    """This policy's weights under OpenVLA's released key names (Prismatic: timm ViTs, fc1..fc3, language_model)."""
    out = {}

    def vit(sd, dst, dino):
        emb = "embeddings."
        if dino:
            out[f"{dst}patch_embed.proj.weight"] = sd[f"{emb}patch_embeddings.projection.weight"]
            out[f"{dst}patch_embed.proj.bias"] = sd[f"{emb}patch_embeddings.projection.bias"]
            out[f"{dst}cls_token"] = sd[f"{emb}cls_token"]
            out[f"{dst}reg_token"] = sd[f"{emb}register_tokens"]
            out[f"{dst}pos_embed"] = sd[f"{emb}position_embeddings"][:, 1:]
            out[f"{dst}norm.weight"], out[f"{dst}norm.bias"] = sd["layernorm.weight"], sd["layernorm.bias"]
            layers, att, o, n1, n2 = "encoder.layer.", "attention.", "o_proj", "norm1", "norm2"
        else:
            out[f"{dst}patch_embed.proj.weight"] = sd[f"{emb}patch_embedding.weight"]
            out[f"{dst}patch_embed.proj.bias"] = sd[f"{emb}patch_embedding.bias"]
            out[f"{dst}pos_embed"] = sd[f"{emb}position_embedding.weight"][None]
            out[f"{dst}norm.weight"], out[f"{dst}norm.bias"] = sd["post_layernorm.weight"], sd["post_layernorm.bias"]
            layers, att, o, n1, n2 = "encoder.layers.", "self_attn.", "out_proj", "layer_norm1", "layer_norm2"
        n = len({k.split(".")[2] for k in sd if k.startswith(layers)})
        for i in range(n):
            src, b = f"{layers}{i}.", f"{dst}blocks.{i}."
            for kind in ("weight", "bias"):
                out[f"{b}attn.qkv.{kind}"] = torch.cat(
                    [sd[f"{src}{att}{q}.{kind}"] for q in ("q_proj", "k_proj", "v_proj")]
                )
                out[f"{b}attn.proj.{kind}"] = sd[f"{src}{att}{o}.{kind}"]
                out[f"{b}norm1.{kind}"], out[f"{b}norm2.{kind}"] = sd[f"{src}{n1}.{kind}"], sd[f"{src}{n2}.{kind}"]
                out[f"{b}mlp.fc1.{kind}"], out[f"{b}mlp.fc2.{kind}"] = (
                    sd[f"{src}mlp.fc1.{kind}"],
                    sd[f"{src}mlp.fc2.{kind}"],
                )
            if dino:
                out[f"{b}ls1.scale_factor"] = sd[f"{src}layer_scale1.lambda1"]
                out[f"{b}ls2.scale_factor"] = sd[f"{src}layer_scale2.lambda1"]

    vit(policy.vision.dino.state_dict(), "vision_backbone.featurizer.", dino=True)
    vit(policy.vision.siglip.state_dict(), "vision_backbone.fused_featurizer.", dino=False)
    for i, fc in enumerate(("fc1", "fc2", "fc3")):
        for kind in ("weight", "bias"):
            out[f"projector.{fc}.{kind}"] = policy.projector.net[2 * i].state_dict()[kind]
    out.update({f"language_model.{k}": v for k, v in policy.llm.state_dict().items()})
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def test_openvla_hub_layout_loads_by_key_mapping(tmp_path):
    """A checkpoint in openvla/openvla-7b's layout (fused DINOv2-with-registers + SigLIP, sharded safetensors,
    padded vocabulary, norm_stats with a gripper mask in config.json) loads without remote code and acts the same."""
    from safetensors.torch import save_file

    sizes = [
        "actor.model.vla.use_dinov2=true",
        "actor.model.vla.dino_registers=4",
        "actor.model.vla.dino_hidden_size=96",
        "actor.model.vla.dino_heads=4",
        "actor.model.vla.dino_intermediate_size=192",
        "actor.model.vla.vocab_size=1088",
        "actor.model.vla.action_token_end=1024",
        "actor.model.vla.llm_heads=4",
        "actor.model.vla.llm_kv_heads=4",
        "actor.model.vla.llm_rms_norm_eps=1e-5",
        "actor.model.vla.image_size=32",
    ]
    _, p = _policy("openvla", "token_level", *sizes)
    with torch.no_grad():  # timm's DINOv2 (no_embed_class) gives the CLS token no position embedding
        p.vision.dino.embeddings.position_embeddings[:, 0] = 0.0
    hub = _to_openvla_hub(p)
    names = sorted(hub)
    half = len(names) // 2
    ckpt = tmp_path / "openvla-7b"
    ckpt.mkdir()
    save_file({k: hub[k] for k in names[:half]}, str(ckpt / "model-00001-of-00002.safetensors"))
    save_file({k: hub[k] for k in names[half:]}, str(ckpt / "model-00002-of-00002.safetensors"))
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps(
            {"weight_map": {k: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, k in enumerate(names)}}
        )
    )
    (ckpt / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["OpenVLAForActionPrediction"],
                "vision_backbone_id": "dinosiglip-vit-so-224px",
                "image_sizes": [32, 32],
                "n_action_bins": 256,
                "pad_to_multiple_of": 64,
                "text_config": {"num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-5},
                "norm_stats": {
                    "bridge_orig": {
                        "action": {
                            "q01": [-2.0, -2.0, -2.0, 0.0],
                            "q99": [2.0, 2.0, 2.0, 1.0],
                            "mask": [True, True, True, False],
                        }
                    }
                },
            }
        )
    )
    # heads are not in the weights: a tiny ViT has no known timm id, so they come from actor.model.vla
    cfg = load_config(
        None,
        [
            "actor.model.model_type=openvla",
            f"actor.model.model_path={ckpt}",
            "actor.model.unnorm_key=bridge_orig",
            "actor.model.vla.dino_heads=4",
        ],
    )
    q = build_policy(cfg.actor.model, SPECS, 4, True, "token_level")
    assert q.vision.dino.config.num_register_tokens == 4 and q.action_end == 1024 and q.vocab_size == 1088
    obs = _obs()
    want, got = p.act(obs, True, INSTR), q.act(obs, True, INSTR)
    assert torch.equal(want.forward_inputs["action_bins"], got.forward_inputs["action_bins"])
    assert torch.allclose(got.actions[..., :3], want.actions[..., :3] * 2.0, atol=1e-5)
    assert torch.allclose(got.actions[..., 3], want.actions[..., 3], atol=1e-6)  # masked: stays normalised
    assert (q.evaluate(obs, want.forward_inputs).log_probs - want.log_probs).abs().max() < 1e-4


def test_activation_checkpointing_gives_the_same_lora_gradients():
    """gradient_checkpointing recomputes the LM in backward: same log-probs, same adapter gradients (the real-size
    configs train LoRA with it on)."""
    grads = []
    for gc in ("false", "true"):
        _, p = _policy(
            "openvla_oft",
            "token_level",
            "actor.model.is_lora=true",
            "actor.model.lora_rank=4",
            f"actor.model.gradient_checkpointing={gc}",
        )
        p.train()
        obs = _obs()
        out = p.act(obs, False, INSTR)
        p.evaluate(obs, out.forward_inputs).log_probs.sum().backward()
        grads.append({n: q.grad.clone() for n, q in p.named_parameters() if "lora_B" in n})
    assert grads[0] and grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][k], grads[1][k], atol=1e-5) and grads[0][k].abs().sum() > 0 for k in grads[0])


def test_oft_proprio_projector_reads_the_state_and_round_trips(tmp_path):
    """actor.model.use_proprio (OpenVLA-OFT's proprio projector): the `state` observation, normalised by the
    demonstrations' q01/q99, is one more prefix token; act and evaluate share the log-prob; the projector and the
    proprio statistics round-trip through the checkpoint layout; mismatches and misuse are named."""
    from rlfleet.config import ConfigError

    args = ("actor.model.num_action_chunks=2", "actor.model.use_proprio=true")
    cfg, p = _policy("openvla_oft", "token_level", *args)
    assert p.proprio_projector is not None and p.proprio_dim == 7
    p.set_action_statistics(
        {"q01": [-1.0] * 4, "q99": [1.0] * 4}, name="Toy-v0", proprio={"q01": [-2.0] * 7, "q99": [2.0] * 7}
    )
    obs = _obs()
    out = p.act(obs, False, INSTR)
    ev = p.evaluate(obs, out.forward_inputs)
    assert torch.allclose(ev.log_probs, out.log_probs, atol=1e-5)
    moved = p.evaluate({**obs, "state": obs["state"] + 3.0}, out.forward_inputs)
    assert (moved.log_probs - ev.log_probs).abs().max() > 1e-4  # the policy sees the state
    p.save_pretrained(tmp_path / "ckpt")
    stats = json.loads((tmp_path / "ckpt" / "dataset_statistics.json").read_text())
    assert stats["Toy-v0"]["proprio"] == {"q01": [-2.0] * 7, "q99": [2.0] * 7}
    loaded_cfg = load_config(
        None,
        [
            "actor.model.model_type=openvla_oft",
            "actor.model.vla.image_size=32",
            *args,
            f"actor.model.model_path={tmp_path / 'ckpt'}",
            "actor.model.unnorm_key=Toy-v0",
        ],
    )
    q = build_policy(loaded_cfg.actor.model, SPECS, 4, True, "token_level")
    assert torch.allclose(q.proprio_q99, torch.full((7,), 2.0))
    assert torch.allclose(q.evaluate(obs, out.forward_inputs).log_probs, ev.log_probs, atol=1e-5)
    without = load_config(
        None,
        [
            "actor.model.model_type=openvla_oft",
            "actor.model.vla.image_size=32",
            "actor.model.num_action_chunks=2",
            f"actor.model.model_path={tmp_path / 'ckpt'}",
        ],
    )
    with pytest.raises(ValueError, match="trained with a proprio projector: set actor.model.use_proprio=true"):
        build_policy(without.actor.model, SPECS, 4, True, "token_level")
    with pytest.raises(ValueError, match="use_proprio: the env has no 'state' observation"):
        build_policy(cfg.actor.model, {"wrist": SPECS["wrist"]}, 4, True, "token_level")
    with pytest.raises(ConfigError, match="use_proprio.*model_type is 'openvla'"):
        load_config(None, ["actor.model.model_type=openvla", "actor.model.use_proprio=true"])
    lora_cfg, lora = _policy("openvla_oft", "token_level", *args, "actor.model.is_lora=true", "actor.model.lora_rank=4")
    # the projector trains beside the adapters, so adapters-off is not the start: a KL reference needs a copy
    assert all(t.requires_grad for t in lora.proprio_projector.parameters()) and not lora.trains_adapters_only


def test_oft_sees_several_cameras_and_the_checkpoint_records_them(tmp_path):
    """actor.model.extra_image_keys (OpenVLA-OFT's num_images_in_input > 1): each further camera goes through the
    same vision backbone and projector, its patches after image_key's; act and evaluate share the log-prob; the
    checkpoint records the cameras and refuses a policy that sees a different number; misuse is named."""
    from rlfleet.config import ConfigError

    args = (
        "actor.model.num_action_chunks=2",
        "actor.model.image_key=wrist",
        "actor.model.extra_image_keys=[third_person]",
    )
    cfg, p = _policy("openvla_oft", "token_level", *args)
    _, single = _policy("openvla_oft", "token_level", *args[:2])
    assert p.image_keys == ["wrist", "third_person"]
    n_params = sum(t.numel() for t in p.parameters())
    assert n_params == sum(t.numel() for t in single.parameters())  # one backbone for every camera
    obs = _obs()
    emb, _ = p._prefix(obs, *p.tokenize(INSTR, 8, "cpu"))
    emb1, _ = single._prefix(obs, *single.tokenize(INSTR, 8, "cpu"))
    assert emb.shape[1] == emb1.shape[1] + p.vision.num_patches
    with torch.no_grad():  # one backbone call over the stacked cameras == one call per camera, in camera order
        each = torch.cat([p.projector(p.vision(obs[k])) for k in p.image_keys], 1)
    assert torch.allclose(emb[:, 1 : 1 + each.shape[1]], each.to(emb.dtype), atol=1e-5)
    with pytest.raises(ValueError, match=r"cameras \['wrist', 'third_person'\] have shapes .*one image size"):
        p._prefix({**obs, "third_person": obs["third_person"][:, :16]}, *p.tokenize(INSTR, 8, "cpu"))
    out = p.act(obs, False, INSTR)
    ev = p.evaluate(obs, out.forward_inputs, INSTR)
    assert torch.allclose(ev.log_probs, out.log_probs, atol=1e-5)
    other = _obs(seed=2)["third_person"]
    moved = p.evaluate({**obs, "third_person": other}, out.forward_inputs, INSTR)
    assert (moved.log_probs - ev.log_probs).abs().max() > 1e-4  # the policy sees the second camera
    p.save_pretrained(tmp_path / "ckpt")
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert written["num_images_in_input"] == 2 and written["image_keys"] == ["wrist", "third_person"]
    base = [
        "actor.model.model_type=openvla_oft",
        "actor.model.vla.image_size=32",
        f"actor.model.model_path={tmp_path / 'ckpt'}",
    ]
    q = build_policy(load_config(None, [*base, *args]).actor.model, SPECS, 4, True, "token_level")
    assert torch.allclose(q.evaluate(obs, out.forward_inputs, INSTR).log_probs, ev.log_probs, atol=1e-5)
    with pytest.raises(
        ValueError,
        match=r"trained on 2 image\(s\) \(\['wrist', 'third_person'\]\); this policy "
        r"sees 1 \(\['wrist'\]\)",
    ):
        build_policy(load_config(None, [*base, *args[:2]]).actor.model, SPECS, 4, True, "token_level")
    with pytest.raises(ValueError, match="extra_image_keys: 'top' is not an image observation"):
        build_policy(
            load_config(None, [*base[:2], "actor.model.extra_image_keys=[top]"]).actor.model,
            SPECS,
            4,
            True,
            "token_level",
        )
    with pytest.raises(ValueError, match="repeats a camera"):
        build_policy(
            load_config(
                None, [*base[:2], "actor.model.image_key=wrist", "actor.model.extra_image_keys=[wrist]"]
            ).actor.model,
            SPECS,
            4,
            True,
            "token_level",
        )
    with pytest.raises(ConfigError, match="extra_image_keys.*model_type is 'openvla'"):
        load_config(None, ["actor.model.model_type=openvla", "actor.model.extra_image_keys=[wrist]"])


def test_openvla_oft_hub_layout_loads_its_proprio_projector_and_refuses_an_action_head(tmp_path):
    """An OpenVLA-OFT checkpoint as released (OpenVLA's hub layout, the proprio projector in
    proprio_projector--<step>_checkpoint.pt with DDP's module. prefix, proprio statistics in norm_stats, no action
    query: OFT zeroes the action positions' embeddings) loads and acts the same; one whose actions come from an
    L1-regression/diffusion head (action_head--*.pt) is refused with the reason."""
    from safetensors.torch import save_file

    sizes = [
        "actor.model.vla.use_dinov2=true",
        "actor.model.vla.dino_registers=4",
        "actor.model.vla.dino_hidden_size=96",
        "actor.model.vla.dino_heads=4",
        "actor.model.vla.dino_intermediate_size=192",
        "actor.model.vla.vocab_size=1088",
        "actor.model.vla.action_token_end=1024",
        "actor.model.vla.llm_heads=4",
        "actor.model.vla.llm_kv_heads=4",
        "actor.model.vla.llm_rms_norm_eps=1e-5",
        "actor.model.vla.image_size=32",
    ]
    oft = ["actor.model.num_action_chunks=2", "actor.model.use_proprio=true"]
    _, p = _policy("openvla_oft", "token_level", *sizes, *oft)
    with torch.no_grad():
        p.vision.dino.embeddings.position_embeddings[:, 0] = 0.0
        torch.nn.init.normal_(p.proprio_projector[0].weight)  # far from the fresh projector a load would miss
    ckpt = tmp_path / "openvla-7b-oft"
    ckpt.mkdir()
    save_file(_to_openvla_hub(p), str(ckpt / "model.safetensors"))
    proj = {
        f"module.{fc}.{kind}": p.proprio_projector[i].state_dict()[kind].clone()
        for i, fc in ((0, "fc1"), (2, "fc2"))
        for kind in ("weight", "bias")
    }
    torch.save(proj, ckpt / "proprio_projector--150000_checkpoint.pt")
    stats = {"action": {"q01": [-1.0] * 4, "q99": [1.0] * 4}, "proprio": {"q01": [-2.0] * 7, "q99": [2.0] * 7}}
    (ckpt / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["OpenVLAForActionPrediction"],
                "vision_backbone_id": "dinosiglip-vit-so-224px",
                "image_sizes": [32, 32],
                "n_action_bins": 256,
                "pad_to_multiple_of": 64,
                "text_config": {"num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-5},
                "norm_stats": {"libero_spatial_no_noops": stats},
            }
        )
    )
    p.set_action_statistics(stats["action"], proprio=stats["proprio"])
    args = [
        "actor.model.model_type=openvla_oft",
        f"actor.model.model_path={ckpt}",
        *oft,
        "actor.model.unnorm_key=libero_spatial_no_noops",
        "actor.model.vla.dino_heads=4",
    ]
    q = build_policy(load_config(None, args).actor.model, SPECS, 4, True, "token_level")
    assert torch.equal(q.proprio_projector[0].weight, p.proprio_projector[0].weight)
    assert torch.allclose(q.proprio_q99, torch.full((7,), 2.0)) and torch.equal(q.action_query, p.action_query)
    # saved again (an SFT output, an export), the statistics keep the key they were picked by: a run configured with
    # the same unnorm_key loads the saved folder
    q.save_pretrained(tmp_path / "again")
    assert list(json.loads((tmp_path / "again" / "dataset_statistics.json").read_text())) == ["libero_spatial_no_noops"]
    obs = _obs()
    want, got = p.act(obs, True, INSTR), q.act(obs, True, INSTR)
    assert torch.equal(want.forward_inputs["action_bins"], got.forward_inputs["action_bins"])
    assert (q.evaluate(obs, want.forward_inputs, INSTR).log_probs - want.log_probs).abs().max() < 1e-4
    with pytest.raises(ValueError, match="trained with a proprio projector: set actor.model.use_proprio=true"):
        build_policy(
            load_config(None, [a for a in args if "use_proprio" not in a]).actor.model, SPECS, 4, True, "token_level"
        )
    torch.save({"module.model.fc1.weight": torch.zeros(2, 2)}, ckpt / "action_head--150000_checkpoint.pt")
    with pytest.raises(ValueError, match="action_head--150000_checkpoint.pt.*decodes discrete action tokens"):
        build_policy(load_config(None, args).actor.model, SPECS, 4, True, "token_level")

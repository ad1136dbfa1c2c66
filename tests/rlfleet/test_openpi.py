"""π0 and π0.5 (transformers' PI0ForConditionalGeneration at a tiny size) as RL policies: Flow-SDE and Flow-Noise
log-probs recomputed exactly, PPO steps that move them, deterministic evaluation, expert-only training, π0.5's
state-as-text prompt and time-conditioned norms."""

from __future__ import annotations

import pytest
import torch

from rlfleet.config import load_config
from rlfleet.policies import build_policy
from rlfleet.wire.spaces import TensorSpace
from services.learner import ppo

SPECS = {
    "third_person": TensorSpace((32, 32, 3), "uint8"),
    "wrist": TensorSpace((32, 32, 3), "uint8"),
    "state": TensorSpace((7,), "float32"),
}
INSTR = ["pick up the red cube"] * 4 + ["open the drawer"] * 4


def _policy(logprob_type="chunk_level", *overrides):
    cfg = load_config(
        None,
        [
            "actor.model.model_type=openpi",
            "actor.model.num_action_chunks=4",
            "env.train.max_steps_per_rollout_epoch=32",
            *overrides,
        ],
    )
    torch.manual_seed(0)
    return build_policy(cfg.actor.model, SPECS, 4, True, logprob_type)


def _obs(n=8):
    g = torch.Generator().manual_seed(3)
    return {
        "third_person": torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g),
        "wrist": torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g),
        "state": torch.randn(n, 7, generator=g),
    }


PI05 = ("actor.model.openpi.pi05=true", "actor.model.max_prompt_tokens=80")
FLOW_NOISE = ("actor.model.openpi.noise_method=flow_noise",)
VARIANTS = {"pi0": (), "pi05": PI05, "pi0_flow_noise": FLOW_NOISE, "pi05_flow_noise": PI05 + FLOW_NOISE}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("logprob_type", ["chunk_level", "action_level", "token_level"])
def test_log_prob_is_recomputed_exactly(logprob_type, variant):
    p = _policy(logprob_type, *VARIANTS[variant])
    obs = _obs()
    out = p.act(obs, False, INSTR)
    width = {"chunk_level": 1, "action_level": 4, "token_level": 16}[logprob_type]
    assert out.actions.shape == (8, 4, 4) and out.log_probs.shape == (8, width)
    if "flow_noise" in variant:  # the whole chain x_0 .. x_K is the forward input
        assert out.forward_inputs["chain"].shape == (8, 5, 4, 32)
        assert torch.equal(out.forward_inputs["chain"][:, -1, :, :4], out.actions)
    else:
        steps = out.forward_inputs["denoise_step"]
        assert steps.min() >= 0 and steps.max() < 4
    ev = p.evaluate(obs, out.forward_inputs)
    assert (ev.log_probs - out.log_probs).abs().max() < 1e-5 and (ev.values - out.values).abs().max() < 1e-5
    a, b = p.act(obs, True, INSTR), p.act(obs, True, INSTR)
    assert torch.equal(a.actions, b.actions)  # evaluation: the ODE, one observation -> one action
    assert not torch.equal(p.act(obs, False, INSTR).actions, out.actions)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ppo_steps_raise_the_log_prob_of_advantaged_chunks(variant):
    p = _policy("chunk_level", *VARIANTS[variant])
    obs = _obs()
    out = p.act(obs, False, INSTR)
    adv = torch.tensor([1.0, -1.0] * 4)
    # Flow-Noise's joint log-prob sums K steps of a small std: it is sharper, so a smaller step
    lr = 1e-4 if "flow_noise" in variant else 1e-3
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=lr)
    losses = []
    for _ in range(5):
        ev = p.evaluate(obs, out.forward_inputs)
        loss, _ = ppo.policy_loss(
            ev.log_probs, out.log_probs, adv[:, None], clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    moved = (p.evaluate(obs, out.forward_inputs).log_probs - out.log_probs).squeeze(1).detach()
    assert moved[adv > 0].mean() > 0 > moved[adv < 0].mean()  # on average (rows share one small model)


def test_train_expert_only_freezes_the_vlm_and_bad_sizes_are_named():
    p = _policy("chunk_level", "actor.model.openpi.train_expert_only=true")
    assert not any(q.requires_grad for q in p.pi0.model.vlm.parameters())
    assert all(q.requires_grad for n, q in p.pi0.model.dit.named_parameters() if not n.startswith("embed_tokens."))
    assert not p.pi0.model.dit.embed_tokens.weight.requires_grad  # never used: the expert reads embeddings
    assert set(p.sync_state_dict()) and not any(k.startswith("pi0.model.vlm.") for k in p.sync_state_dict())
    with pytest.raises(ValueError, match="exceed max_state_dim 4"):
        _policy("chunk_level", "actor.model.openpi.max_state_dim=4")
    with pytest.raises(ValueError, match="expert_layers must equal vlm_layers"):
        _policy("chunk_level", "actor.model.openpi.expert_layers=3")


def test_flow_noise_learns_its_std_within_bounds_and_evaluates_the_ode():
    p = _policy(
        "chunk_level", *FLOW_NOISE, "actor.model.openpi.noise_std_min=0.1", "actor.model.openpi.noise_std_max=0.3"
    )
    obs = _obs()
    out = p.act(obs, False, INSTR)
    chain = out.forward_inputs["chain"]
    ev = p.evaluate(obs, out.forward_inputs)
    # every step is stochastic: each of the 4 steps moves x away from the ODE's step by a bounded std
    std = p._noise_std()
    assert 0.1 <= float(std.min()) and float(std.max()) <= 0.3
    ev.log_probs.sum().backward()
    assert p.noise_head[0].weight.grad is not None and p.noise_head[0].weight.grad.abs().sum() > 0
    greedy = p.act(obs, True, INSTR)
    assert torch.equal(greedy.actions, p.act(obs, True, INSTR).actions)
    assert not torch.allclose(chain[:, 1], chain[:, 0])
    with pytest.raises(ValueError, match="openpi.noise_method'?: 'flow_ode' is not one of flow_sde, flow_noise"):
        _policy("chunk_level", "actor.model.openpi.noise_method=flow_ode")


def test_pi05_reads_the_state_as_text_and_the_time_through_its_norms():
    p = _policy("chunk_level", *PI05)
    assert not hasattr(p.pi0.embed_action_time, "state_proj")  # no state token for the expert
    obs = _obs()
    ids, mask = p.tokenize(INSTR, 8, "cpu", p._flat_state(obs, 8))
    text = bytes(int(i) - 3 for i in ids[0][mask[0].bool()][1:]).decode()
    bins = ((obs["state"][0].clamp(-1, 1) + 1) * 128).long().clamp(max=255)
    assert text == f"Task: pick up the red cube, State: {' '.join(str(int(b)) for b in bins)};\nAction: "
    long_instr = ["pick up the red cube " * 20] * 8  # the instruction is cut, never the state
    ids, mask = p.tokenize(long_instr, 8, "cpu", p._flat_state(obs, 8))
    assert bytes(int(i) - 3 for i in ids[0][mask[0].bool()][1:]).decode().endswith(";\nAction: ")
    # a different state is a different prompt, hence (through the VLM) different actions
    other = {**obs, "state": obs["state"] + 0.5}
    assert not torch.equal(p.act(obs, True, INSTR).actions, p.act(other, True, INSTR).actions)
    # the time conditions the expert once the norms' modulation has learned anything (zero at init)
    for m in p.modules():
        if m.__class__.__name__ == "AdaRMSNorm":
            torch.nn.init.normal_(m.modulation.weight, std=0.5)
    x = torch.randn(8, 4, 32)
    ids, mask, pixels, pixel_mask, state = p._inputs(obs, *p.tokenize(INSTR, 8, "cpu", p._flat_state(obs, 8)))
    cache, _ = p._prefix(ids, mask, pixels, pixel_mask)
    v1 = p._velocity(state, x, torch.full((8,), 1.0), mask, pixel_mask, cache)
    v2 = p._velocity(state, x, torch.full((8,), 0.5), mask, pixel_mask, cache)
    assert p._features.shape == (8, 4, 64) and not torch.allclose(v1, v2)
    with pytest.raises(ValueError, match="max_prompt_tokens: 40 cannot hold π0.5's prompt with a 7-D state"):
        _policy("chunk_level", "actor.model.openpi.pi05=true", "actor.model.max_prompt_tokens=40")


@pytest.mark.parametrize("variant", ["pi05", "pi05_flow_noise"])
def test_pi05_saved_and_loaded_acts_the_same(tmp_path, variant):
    p = _policy("chunk_level", *VARIANTS[variant])
    obs = _obs()
    p.save_pretrained(tmp_path / "m")
    # an SFT model has no noise head: Flow-Noise RL from it starts a fresh one
    q = _policy(
        "chunk_level", "actor.model.max_prompt_tokens=80", *FLOW_NOISE, f"actor.model.model_path={tmp_path / 'm'}"
    )
    assert q.pi05 and q.noise_method == "flow_noise"
    assert torch.equal(p.act(obs, True, INSTR).actions, q.act(obs, True, INSTR).actions)


def test_a_deep_copy_runs_on_its_own_norms_and_features():
    """The inference server double-buffers the policy: a copy's hooks must use the copy's modules."""
    import copy

    p = _policy("chunk_level", *PI05, *FLOW_NOISE)
    obs = _obs()
    q = copy.deepcopy(p)
    for m in q.modules():
        if m.__class__.__name__ == "AdaRMSNorm":
            torch.nn.init.normal_(m.modulation.weight, std=0.5)
    out = q.act(obs, False, INSTR)
    assert (q.evaluate(obs, out.forward_inputs).log_probs - out.log_probs).abs().max() < 1e-5
    assert p._features is None and q._features is not None
    assert not torch.equal(p.act(obs, True, INSTR).actions, q.act(obs, True, INSTR).actions)


def _transformers_pi0_checkpoint(path, chunk=4):
    """A tiny π0 saved by transformers itself (PI0ForConditionalGeneration.save_pretrained, sharded) with a real
    tokenizer's files next to it: the layout of transformers' π0 checkpoints (lerobot/pi0_base)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PI0Config,
        PI0ForConditionalGeneration,
        PreTrainedTokenizerFast,
    )

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "pick", "up", "the", "red", "cube", "open", "drawer", "\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(str(path))
    text = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    vision = dict(
        image_size=32, patch_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    cfg = PI0Config(
        vlm_config=PaliGemmaConfig(vision_config=vision, text_config=text, image_token_id=95, projection_dim=64),
        dit_config=GemmaConfig(
            vocab_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
        ),
        chunk_size=chunk,
        max_state_dim=16,
        max_action_dim=8,
        num_inference_steps=10,
    )
    torch.manual_seed(5)
    model = PI0ForConditionalGeneration(cfg)
    model.save_pretrained(str(path), max_shard_size="100KB")
    return model


def test_a_transformers_pi0_checkpoint_loads_and_round_trips(tmp_path):
    hub = tmp_path / "pi0_base"
    model = _transformers_pi0_checkpoint(hub)
    assert (hub / "model.safetensors.index.json").is_file() and (hub / "tokenizer_config.json").is_file()
    p = _policy("chunk_level", f"actor.model.model_path={hub}")
    assert p.sizes["vlm_hidden_size"] == 64 and p.sizes["max_action_dim"] == 8 and p.image_token_id == 95
    theirs = model.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in p.pi0.state_dict().items())
    ids, mask = p.tokenize(["pick up the red cube"], 1, "cpu")
    assert ids[0][mask[0].bool()].tolist() == [
        2,
        4,
        5,
        6,
        7,
        8,
    ]  # <bos> + the checkpoint's own ids (its "\n" is dropped)
    obs = _obs()
    out = p.act(obs, False, INSTR)
    assert out.actions.shape == (8, 4, 4)
    assert (p.evaluate(obs, out.forward_inputs).log_probs - out.log_probs).abs().max() < 1e-5
    # SFT/RL output in rlfleet's layout keeps the tokenizer and the architecture
    p.save_pretrained(tmp_path / "ours")
    assert (tmp_path / "ours" / "tokenizer" / "tokenizer_config.json").is_file()
    q = _policy("chunk_level", f"actor.model.model_path={tmp_path / 'ours'}")
    assert torch.equal(p.act(obs, True, INSTR).actions, q.act(obs, True, INSTR).actions)
    with pytest.raises(ValueError, match="num_action_chunks: 5, but the π0 checkpoint predicts chunks of 4"):
        load = load_config(
            None,
            [
                "actor.model.model_type=openpi",
                "actor.model.num_action_chunks=5",
                "env.train.max_steps_per_rollout_epoch=40",
                f"actor.model.model_path={hub}",
            ],
        )
        build_policy(load.actor.model, SPECS, 4, True, "chunk_level")
    with pytest.raises(ValueError, match="openpi.pi05: .* is a transformers π0 checkpoint"):
        _policy("chunk_level", f"actor.model.model_path={hub}", *PI05)
    (hub / "tokenizer_config.json").unlink()
    (hub / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="transformers π0 checkpoint without its tokenizer"):
        _policy("chunk_level", f"actor.model.model_path={hub}")


def test_pi05_learns_demonstrated_chunks_by_flow_matching():
    """Supervised fine-tuning of π0.5 (the state read as text): the flow-matching loss falls on a fixed batch."""
    p = _policy("chunk_level", *PI05, *FLOW_NOISE)
    obs = _obs()
    actions = torch.rand(8, 4, 4, generator=torch.Generator().manual_seed(1)) * 2 - 1

    def held_out() -> float:  # the loss at fixed times and noise
        total = 0.0
        with torch.no_grad():
            for i in range(4):
                torch.manual_seed(100 + i)
                total += float(p.bc_loss(obs, actions, INSTR))
        return total / 4

    before = held_out()
    opt = torch.optim.Adam(p.parameters(), lr=1e-3)
    torch.manual_seed(2)
    for _ in range(60):
        loss = p.bc_loss(obs, actions, INSTR)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert held_out() < 0.7 * before

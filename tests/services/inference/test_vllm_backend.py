"""rollout.backend=vllm: the parts that run in the main environment (config checks, the checkpoint key mapping),
and the vLLM decoder itself inside the vLLM environment (built on first use and cached, as a run builds it):
parity with the hf backend and the learner's log-probs, continuous batching across streams, weight updates, a
reload failure, an engine that cannot be rebuilt, an engine step that fails mid-decode, LoRA, the 7B layout."""

from __future__ import annotations

import json

import pytest

from rlfleet.config import ConfigError, load_config
from rlfleet.policies.models.openvla import lm_weight_name
from tests.simenv import run_in_env

VLA = "pandapickcube_vision_ppo_openvla_tiny"


def test_backend_config_errors_name_the_key_and_the_reason():
    assert load_config(VLA, ["rollout.backend=vllm"]).rollout.backend == "vllm"
    with pytest.raises(ConfigError, match=r"'rollout.backend': unknown backend 'vlm'; did you mean 'vllm'\?"):
        load_config(VLA, ["rollout.backend=vlm"])
    with pytest.raises(
        ConfigError,
        match=r"'rollout.backend': backend 'vllm' does not serve model_type "
        r"'openvla_oft' \(OpenVLA-OFT decodes",
    ):
        load_config(VLA, ["rollout.backend=vllm", "actor.model.model_type=openvla_oft"])
    with pytest.raises(ConfigError, match="does not serve model_type 'mlp'"):
        load_config(None, ["rollout.backend=vllm"])
    assert load_config(VLA, ["rollout.backend=vllm", "actor.model.is_lora=true"]).actor.model.is_lora


def test_checkpoint_names_map_to_the_language_model_only():
    assert lm_weight_name("llm.model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert lm_weight_name("language_model.lm_head.weight") == "lm_head.weight"  # OpenVLA's hub layout
    assert lm_weight_name("model.embed_tokens.weight") == "model.embed_tokens.weight"  # a weight update's names
    for other in (
        "vision.siglip.embeddings.patch_embedding.weight",
        "projector.net.0.weight",
        "value_head.0.bias",
        "action_query",
        "vision_backbone.featurizer.blocks.0.attn.qkv.weight",
        "projector.fc1.weight",
    ):
        assert lm_weight_name(other) is None, other


def test_environments_list_the_vllm_environment():
    from rlfleet.policies.backends import describe

    rows = {r["simulator"]: r for r in describe()}
    assert rows["vllm"]["environment"] == "vllm" and "openvla" in rows["vllm"]["examples"]


# Runs with the vLLM environment's python (vLLM pins its own torch and transformers); prints one JSON line.
DECODER_CHECKS = r'''
import json, threading, time
import numpy as np, torch
torch.set_num_threads(1)
from rlfleet.config import load_config
from rlfleet.wire.spaces import TensorSpace
from rlfleet.policies.models.actor_critic import to_torch_obs
from rlfleet.policies import build_policy
from rlfleet.errors import Unavailable
from services.inference.engine import InferenceEngine

cfg = load_config("pandapickcube_vision_ppo_openvla_tiny", ["rollout.backend=vllm"])
SPECS = {"third_person": TensorSpace((64, 64, 3), "uint8"), "state": TensorSpace((18,), "float32")}
torch.manual_seed(0)
learner = build_policy(cfg.actor.model, SPECS, 4, True, "token_level").eval()   # the learner's copy
state = {k: v.clone() for k, v in learner.state_dict().items()}
hf = InferenceEngine(cfg.actor.model, logprob_type="token_level")
vl = InferenceEngine(cfg.actor.model, logprob_type="token_level", backend="vllm", seed=0)
for e in (hf, vl):
    e.start()
    e.set_weights(0, state, obs_specs=SPECS, action_dim=4)
rng = np.random.default_rng(0)
n = 8
obs = {"third_person": rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8),
       "state": rng.standard_normal((n, 18)).astype(np.float32)}
instr = [f"pick up the red cube {i}" for i in range(n)]
out = {}

def greedy_same():
    a, b = hf.act_now(obs, True, instr), vl.act_now(obs, True, instr)
    return bool((a.forward_inputs["action_bins"] == b.forward_inputs["action_bins"]).all()) and \
        bool(np.array_equal(a.actions, b.actions))

out["greedy_same"] = greedy_same()
keys = np.arange(n, dtype=np.uint64) + 11
s1, s2 = vl.act_now(obs, False, instr, keys), vl.act_now(obs, False, instr, keys)
out["same_keys_same_tokens"] = bool((s1.forward_inputs["action_bins"] == s2.forward_inputs["action_bins"]).all())
out["sampled_bins_spread"] = int(len(np.unique(s1.forward_inputs["action_bins"])))
with torch.no_grad():
    ev = learner.evaluate(to_torch_obs(obs), {k: torch.from_numpy(v) for k, v in s1.forward_inputs.items()}, instr)
out["logp_max_diff"] = float((ev.log_probs - torch.from_numpy(s1.log_probs)).abs().max())
out["value_max_diff"] = float((ev.values - torch.from_numpy(s1.values)).abs().max())
out["weights_version"] = s1.weights_version

# four requests queued at once (four streams): decoded together, each row as it would be alone
before = vl.backend.steps_run
futs = [vl.submit({k: v[2 * i:2 * i + 2] for k, v in obs.items()}, True, stream=i, instructions=instr[2 * i:2 * i + 2])
        for i in range(4)]
parts = [f.result(60) for f in futs]
out["streams_steps"] = vl.backend.steps_run - before
alone = vl.act_now(obs, True, instr)
out["streams_match_alone"] = bool(np.array_equal(np.concatenate([p.forward_inputs["action_bins"] for p in parts]),
                                                  alone.forward_inputs["action_bins"]))

# a weights update: both backends follow it
with torch.no_grad():
    state = {k: (v + 0.05 * torch.randn_like(v)) if v.is_floating_point() and k.startswith("llm.") else v
             for k, v in state.items()}
for e in (hf, vl):
    e.set_weights(1, state)
out["after_update_greedy_same"] = greedy_same()
out["version_after_update"] = vl.act_now(obs, True, instr).weights_version

# a reload that breaks off half-way: the engine is rebuilt from the new weights and the update succeeds
vl.backend.fail_next_reloads = 1
state = {k: (v * 1.01) if v.is_floating_point() and k.startswith("llm.") else v for k, v in state.items()}
for e in (hf, vl):
    e.set_weights(2, state)
out["after_failed_reload_greedy_same"] = greedy_same()
out["engine_builds"], out["failed_reloads"] = vl.backend.engine_builds, vl.backend.failed_reloads

# ... and when the rebuild fails too: the update fails (the learner republishes), Act says UNAVAILABLE until an
# update succeeds
vl.backend.fail_next_reloads = 1
real_build = vl.backend._build
def broken_build(policy):
    raise RuntimeError("injected engine build failure")
vl.backend._build = broken_build
fatal = []
vl.backend.on_fatal = fatal.append  # the server exits here (to be restarted); this test stays up instead
try:
    vl.set_weights(3, state)
    out["update_error"] = None
except Unavailable as exc:
    out["update_error"] = str(exc)
try:
    vl.act_now(obs, True, instr)
    out["act_error"] = None
except Unavailable as exc:
    out["act_error"] = str(exc)
vl.backend._build = real_build
vl.backend.on_fatal = None
out["fatal"] = fatal
vl.set_weights(3, state)
hf.set_weights(3, state)
out["recovered_greedy_same"] = greedy_same()
out["recovered_version"] = vl.act_now(obs, True, instr).weights_version

# an engine step that fails mid-decode: a new engine, the rows in flight decoded again, the caller sees nothing
engine_now = vl.backend.llm.llm_engine
real_step, steps = engine_now.step, []
def flaky_step():
    steps.append(1)
    if len(steps) == 2:
        raise RuntimeError("injected engine step failure")
    return real_step()
engine_now.step = flaky_step
out["step_failure_greedy_same"] = greedy_same()
out["rebuilt_after_step_failure"] = vl.backend.engine_builds_after_failure
for e in (hf, vl):
    e.stop()
print(json.dumps(out))
'''


@pytest.mark.slow
def test_vllm_decoder_matches_hf_and_survives_reload_failures(vllm_checks):
    r = vllm_checks["decoder"]
    assert r["greedy_same"], r  # same weights and observations: same greedy actions
    assert r["same_keys_same_tokens"] and r["sampled_bins_spread"] > 8, r  # seeded per row, and really sampled
    assert r["logp_max_diff"] < 1e-3, r  # the learner's recomputation (acceptance: 1e-3)
    assert r["value_max_diff"] < 1e-5, r
    assert r["weights_version"] == 0
    assert r["streams_match_alone"] and r["streams_steps"] <= 8, r  # 4 streams in the same engine steps
    assert r["after_update_greedy_same"] and r["version_after_update"] == 1, r
    assert r["after_failed_reload_greedy_same"] and r["failed_reloads"] == 1 and r["engine_builds"] == 2, r
    assert "injected engine build failure" in r["update_error"], r
    assert "vLLM engine is down" in r["act_error"], r
    assert len(r["fatal"]) == 1 and "injected engine build failure" in r["fatal"][0], r
    assert r["recovered_greedy_same"] and r["recovered_version"] == 3, r
    assert r["step_failure_greedy_same"] and r["rebuilt_after_step_failure"] == 1, r


# LoRA: vLLM serves the frozen base weights and the adapters through its LoRA support (a new adapter per version)
LORA_CHECKS = r'''
import json, numpy as np, torch
torch.set_num_threads(1)
from rlfleet.config import load_config
from rlfleet.wire.spaces import TensorSpace
from rlfleet.policies import build_policy
from services.inference.engine import InferenceEngine
cfg = load_config("pandapickcube_vision_ppo_openvla_tiny", ["rollout.backend=vllm", "actor.model.is_lora=true", "actor.model.lora_rank=4"])
SPECS = {"third_person": TensorSpace((64, 64, 3), "uint8"), "state": TensorSpace((18,), "float32")}
torch.manual_seed(0)
p = build_policy(cfg.actor.model, SPECS, 4, True, "token_level").eval()
with torch.no_grad():
    for n_, q in p.named_parameters():
        if "lora_B" in n_: q.normal_(0, 0.3)
hf = InferenceEngine(cfg.actor.model, logprob_type="token_level")
vl = InferenceEngine(cfg.actor.model, logprob_type="token_level", backend="vllm", seed=0)
full = {k: v.clone() for k, v in p.state_dict().items()}
for e in (hf, vl):
    e.start(); e.set_weights(0, full, obs_specs=SPECS, action_dim=4)
rng = np.random.default_rng(0); n = 8
obs = {"third_person": rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8), "state": rng.standard_normal((n, 18)).astype(np.float32)}
instr = [f"pick up the red cube {i}" for i in range(n)]
def same():
    a, b = hf.act_now(obs, True, instr), vl.act_now(obs, True, instr)
    return bool((a.forward_inputs["action_bins"] == b.forward_inputs["action_bins"]).all())
out = {"lora_greedy_same": same()}
from rlfleet.policies.models.actor_critic import to_torch_obs
s1 = vl.act_now(obs, False, instr, np.arange(n, dtype=np.uint64))
with torch.no_grad():
    ev = p.evaluate(to_torch_obs(obs), {k: torch.from_numpy(v) for k, v in s1.forward_inputs.items()}, instr)
out["lora_logp_diff"] = float((ev.log_probs - torch.from_numpy(s1.log_probs)).abs().max())
with torch.no_grad():
    for n_, q in p.named_parameters():
        if "lora_B" in n_: q.add_(torch.randn_like(q) * 0.3)
sync = {k: v.clone() for k, v in p.sync_state_dict().items()}
for e in (hf, vl): e.set_weights(1, sync, partial=True)
out["lora_after_update_same"] = same()
out["n_sync"] = len(sync)
for e in (hf, vl): e.stop()
print(json.dumps(out))
'''


@pytest.mark.slow
def test_vllm_serves_lora_adapters_and_their_updates(vllm_checks):
    r = vllm_checks["lora"]
    assert r["lora_greedy_same"] and r["lora_after_update_same"], r
    assert r["lora_logp_diff"] < 1e-3, r
    assert r["n_sync"] < 40, r  # a partial update: the adapters and the value head only


# OpenVLA-7B's layout in miniature: DINOv2 (with registers) fused with SigLIP, and a vocabulary padded past the
# tokenizer's (action ids end at 1024, the embedding table has 1088 rows, as 32000 of 32064 in the 7B model)
LAYOUT_CHECKS = r'''
import json, numpy as np, torch
torch.set_num_threads(1)
from rlfleet.config import load_config
from rlfleet.wire.spaces import TensorSpace
from rlfleet.policies.models.actor_critic import to_torch_obs
from rlfleet.policies import build_policy
from services.inference.engine import InferenceEngine
sizes = ["actor.model.vla.use_dinov2=true", "actor.model.vla.dino_registers=4", "actor.model.vla.dino_hidden_size=96",
         "actor.model.vla.dino_heads=4", "actor.model.vla.dino_intermediate_size=192",
         "actor.model.vla.vocab_size=1088", "actor.model.vla.action_token_end=1024", "actor.model.vla.llm_kv_heads=2"]
cfg = load_config("pandapickcube_vision_ppo_openvla_tiny", ["rollout.backend=vllm", *sizes])
SPECS = {"third_person": TensorSpace((64, 64, 3), "uint8")}
torch.manual_seed(0)
p = build_policy(cfg.actor.model, SPECS, 7, True, "token_level").eval()
state = {k: v.clone() for k, v in p.state_dict().items()}
hf = InferenceEngine(cfg.actor.model, logprob_type="token_level")
vl = InferenceEngine(cfg.actor.model, logprob_type="token_level", backend="vllm", seed=0)
for e in (hf, vl):
    e.start(); e.set_weights(0, state, obs_specs=SPECS, action_dim=7)
rng = np.random.default_rng(1)
n = 6
obs = {"third_person": rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8)}
instr = ["put the bowl on the plate"] * n
a, b = hf.act_now(obs, True, instr), vl.act_now(obs, True, instr)
s = vl.act_now(obs, False, instr, np.arange(n, dtype=np.uint64))
with torch.no_grad():
    ev = p.evaluate(to_torch_obs(obs), {k: torch.from_numpy(v) for k, v in s.forward_inputs.items()}, instr)
print(json.dumps({"greedy_same": bool(np.array_equal(a.forward_inputs["action_bins"], b.forward_inputs["action_bins"])),
                  "logp_diff": float((ev.log_probs - torch.from_numpy(s.log_probs)).abs().max()),
                  "max_bin": int(s.forward_inputs["action_bins"].max()), "shape": list(s.actions.shape)}))
for e in (hf, vl):
    e.stop()
'''


# the three check scripts run one after another in one process of the vLLM environment (vLLM's import and start-up
# take about 15 s there, paid once): each in its own namespace, each printing its one JSON line
RUN_ALL = r'''
import contextlib, io, json, sys
out = {}
for name, code in json.loads(sys.argv[1]).items():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, f"<{name} checks>", "exec"), {"__name__": f"{name}_checks"})
    out[name] = json.loads(buf.getvalue().strip().splitlines()[-1])
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def vllm_checks():
    blocks = {"decoder": DECODER_CHECKS, "lora": LORA_CHECKS, "layout": LAYOUT_CHECKS}
    code = "import sys; sys.argv[1:] = [" + repr(json.dumps(blocks)) + "]\n" + RUN_ALL
    return run_in_env("backend:vllm", code, timeout=800)


@pytest.mark.slow
def test_vllm_decodes_the_openvla_7b_layout_with_a_padded_vocabulary(vllm_checks):
    r = vllm_checks["layout"]
    assert r["greedy_same"] and r["logp_diff"] < 1e-3, r
    assert r["shape"] == [6, 1, 7] and 0 <= r["max_bin"] < 256, r

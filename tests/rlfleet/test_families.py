"""Policy families as one declarative entry each (rlfleet/policies/families.py): a toy family registered through one
entry only is accepted by config validation (its own size group, its nullable key, its options, did-you-mean), the
footprint, the inference backends' check, the export and evaluation tables and the inference server's defaults,
and it acts and trains a step; the built-in families' size YAMLs match their modules; the checkpoint module and the
family table import no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from rlfleet.config import ConfigError, load_config
from rlfleet.policies import build_policy, footprint
from rlfleet.policies.backends import BACKENDS, check_backend
from rlfleet.policies.families import FAMILIES
from rlfleet.wire.spaces import TensorSpace
from tests.fixtures.toy_policy import TOY, ToyPolicy

torch.set_num_threads(1)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(FAMILIES, "toy", TOY)  # the one registration
    return TOY


def test_a_new_family_is_one_entry(toy, tmp_path):
    cfg = load_config(None, ["actor.model.model_type=toy", "actor.model.toy.hidden=16", "actor.model.toy.width=null"])
    assert cfg.actor.model.toy.hidden == 16 and cfg.actor.model.toy.width is None
    assert load_config(None).actor.model.toy.hidden == 8  # the group's defaults from its YAML
    with pytest.raises(ConfigError, match="did you mean 'actor.model.toy.hidden'"):
        load_config(None, ["actor.model.model_type=toy", "actor.model.toy.hiden=3"])
    with pytest.raises(ConfigError, match="'actor.model.toy.width' = 'x' has the wrong type \\(expected int or null"):
        load_config(None, ["actor.model.toy.width=x"])
    with pytest.raises(
        ConfigError,
        match="'actor.model.is_lora': training LoRA adapters is for model_type openvla and "
        "openvla_oft; model_type is 'toy'",
    ):
        load_config(None, ["actor.model.model_type=toy", "actor.model.is_lora=true"])
    assert load_config(None, ["actor.model.model_type=toy", "actor.model.num_action_chunks=2"])  # in its options
    # the footprint: a family with a footprint function is checked before a run, by its function
    assert footprint.is_vla("toy") and footprint.activation_bytes(cfg.actor.model) == 16 * 4
    # the inference backends: the hf backend serves it, vllm refuses it with the entry's reason
    assert "toy" in BACKENDS["hf"].model_types and check_backend("hf", "toy") is None
    assert "a toy decodes no tokens" in check_backend("vllm", "toy")
    with pytest.raises(ConfigError, match="does not serve model_type 'toy' \\(a toy decodes no tokens\\)"):
        load_config(None, ["actor.model.model_type=toy", "rollout.backend=vllm"])
    # export: the layouts its entry names
    assert toy.export_refusal(cfg.actor.model, "rlfleet") is None
    assert "exports as rlfleet" in toy.export_refusal(cfg.actor.model, "upstream")
    # evaluation of a model folder: the config.json model types its loader takes
    from services.coordinator.offline_eval import EvalError, Target, check_weights

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy_v0"}))
    check_weights(cfg, Target(tmp_path, "model"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "openvla"}))
    with pytest.raises(EvalError, match="holds a model of type openvla"):
        check_weights(cfg, Target(tmp_path, "model"))
    from services.inference.server import batch_invariant_rows

    assert batch_invariant_rows(cfg) == 7
    # built from its module, it acts and trains one step
    torch.manual_seed(0)
    policy = build_policy(cfg.actor.model, {"state": TensorSpace((5,), "float32")}, 3, True)
    assert isinstance(policy, ToyPolicy)
    obs = {"state": torch.randn(4, 5)}
    out = policy.act(obs)
    assert out.actions.shape == (4, 1, 3) and out.log_probs.shape == (4, 1)
    ev = policy.evaluate(obs, out.forward_inputs)
    assert torch.allclose(ev.log_probs, out.log_probs, atol=1e-6)
    optim = torch.optim.Adam(policy.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in policy.parameters()]
    (-(ev.log_probs.sum()) + ev.values.pow(2).mean()).backward()
    optim.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))


@pytest.mark.parametrize(
    "config, overrides",
    [
        (None, []),
        ("pandapickcube_vision_ppo", []),
        ("pandapickcube_vision_ppo_openvla_tiny", []),
        ("metaworld_mt10_ppo_pi05_tiny", []),
        ("libero_spatial_grpo_openvla_oft", ["actor.model.image_key=third_person"]),  # the real size: 7.61B
        ("metaworld_mt50_ppo_pi0", []),  # the real size: 3.52B
    ],
)
def test_a_policy_is_made_on_the_device_it_is_built_for(config, overrides):
    """build_policy(device=...) makes and initialises every tensor there (the learner and the inference server pass
    their GPU): the real-size OpenVLA-OFT is never a 30 GB fp32 copy in the host's memory first. The meta device
    stands in for a GPU here: nothing is allocated, and a tensor made on the host would show up as one."""
    import resource

    cfg = load_config(config, overrides)
    vector = {"state": TensorSpace((8,), "float32")}
    images = {k: TensorSpace((224, 224, 3), "uint8") for k in ("third_person", "wrist")}
    specs = vector if cfg.actor.model.model_type == "mlp" else {**vector, **images}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    policy = build_policy(cfg.actor.model, specs, 7, True, device="meta")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    on = {t.device.type for t in [*policy.parameters(), *policy.buffers()]}
    assert on == {"meta"}, on
    params = sum(t.numel() for t in policy.parameters())
    assert grown_mib < 1024 + params * 4 / 2**20 / 20, (config, params, grown_mib)  # far below one fp32 copy


def test_unregistered_family_is_unknown():
    with pytest.raises(ConfigError, match="unknown model_type 'toy'"):
        load_config(None, ["actor.model.model_type=toy"])
    with pytest.raises(ConfigError, match="unknown config key 'actor.model.toy.hidden'"):
        load_config(None, ["actor.model.toy.hidden=3"])


@pytest.mark.parametrize(
    "group, module", [("vla", "rlfleet.policies.models.openvla"), ("openpi", "rlfleet.policies.models.openpi")]
)
def test_size_yaml_is_the_modules_defaults(group, module):
    """A family's size YAML is the one place its defaults are written: the config's group and its module's TINY
    (what a partial sizes dict falls back to) both read it."""
    import importlib

    family = next(f for f in FAMILIES.values() if f.sizes_group == group)
    tiny = importlib.import_module(module).TINY
    defaults = family.defaults()
    assert set(defaults) == set(tiny)
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in tiny.items()} == defaults


def test_default_config_carries_no_vla_sizes():
    from rlfleet.config import DEFAULT_CONFIG

    text = DEFAULT_CONFIG.read_text()
    assert "    vla:" not in text and "    openpi:" not in text
    cfg = load_config(None)
    assert cfg.actor.model.vla.image_size == 64 and cfg.actor.model.openpi.image_size == 32


@pytest.mark.parametrize(
    "module",
    ["rlfleet.data.checkpoint_files", "rlfleet.policies.families", "rlfleet.policies.backends", "rlfleet.config"],
)
def test_imports_no_torch(module):
    code = (
        f"import sys, {module}\n"
        "from rlfleet.data.checkpoint_files import find_checkpoint, latest_checkpoint, specs_from_json\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_find_checkpoint(tmp_path):
    from rlfleet.data.checkpoint_files import CheckpointNotFound, checkpoint_dir, find_checkpoint

    run = tmp_path / "run"
    for step in (2, 10, 3):
        checkpoint_dir(run, step).mkdir(parents=True)
        (checkpoint_dir(run, step) / "learner_state.json").write_text("{}")
    checkpoint_dir(run, 11).mkdir()  # incomplete: no learner_state.json
    (run / "checkpoints" / "global_step_x").mkdir()  # not a step name
    assert find_checkpoint(run) == (checkpoint_dir(run, 10), run)
    assert find_checkpoint(run, 3) == (checkpoint_dir(run, 3), run)
    assert find_checkpoint(checkpoint_dir(run, 2))[0] == checkpoint_dir(run, 2)
    with pytest.raises(
        CheckpointNotFound, match="--step 11: no complete checkpoint global_step_11 .*complete ones: 2, 3, 10"
    ):
        find_checkpoint(run, 11)
    with pytest.raises(CheckpointNotFound, match="is the checkpoint of another step"):
        find_checkpoint(checkpoint_dir(run, 2), 3)
    with pytest.raises(CheckpointNotFound, match="incomplete checkpoint"):
        find_checkpoint(checkpoint_dir(run, 11))
    with pytest.raises(CheckpointNotFound, match="no such folder"):
        find_checkpoint(tmp_path / "nothing")


def test_export_does_not_import_the_learner():
    """services/learner/export.py reads the checkpoint's spaces from the shared module, not learner.py (no circle)."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path("services/learner/export.py").read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "services.learner.learner" not in names


def test_a_learner_trains_the_toy_family(toy, tmp_path):
    """The learner builds the toy family from its entry, trains one PPO step on a rollout and checkpoints it."""
    from rlfleet.config.views import learner_view
    from services.learner.learner import Learner
    from tests.conftest import small_config
    from tests.services.learner.test_learner import SPECS, fake_rollout

    cfg = small_config("actor.model.model_type=toy", "runner.save_interval=1")
    le = Learner(learner_view(cfg), tmp_path / "run")
    try:
        le.setup(SPECS, 4)
        assert isinstance(le.model, ToyPolicy)
        tm, pe, eps = fake_rollout()
        le.rollouts.receive(0, 0, tm, pe, eps)
        metrics = le.train(0, [0])
        assert torch.isfinite(torch.tensor(metrics["train/loss"]))
        assert (tmp_path / "run" / "checkpoints" / "global_step_1" / "learner_state.json").is_file()
    finally:
        le.close()

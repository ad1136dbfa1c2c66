"""The shape of the code (docs/architecture.md): rlfleet's layers import only lower layers, no shared module names
env-side code (by import or by string), the services never import each other, and the coordinator process never
loads a simulator backend."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {"registry": 0, "untrusted": 0, "v1": 1, "wire": 1, "data": 2, "simulators": 3, "policies": 4, "config": 5, "configs": 5}


def _modules(folder: pathlib.Path):
    for path in sorted(folder.rglob("*.py")):
        if "v1" in path.relative_to(ROOT).parts[:2]:
            continue  # generated
        yield path, ast.parse(path.read_text(), str(path))


def _imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if parts[0] == "rlfleet" and len(parts) > 1 else None


def test_each_layer_imports_only_lower_layers():
    wrong = []
    for path, tree in _modules(ROOT / "rlfleet"):
        rel = path.relative_to(ROOT)
        own = LAYERS[rel.parts[1].removesuffix(".py")] if len(rel.parts) > 2 or rel.stem != "__init__" else -1
        for module in _imports(tree):
            if module.startswith("services"):
                wrong.append(f"{rel} imports {module}")
            layer = _layer(module)
            if layer is not None and own >= 0 and layer > own:
                wrong.append(f"{rel} (layer {own}) imports {module} (layer {layer})")
    assert not wrong, "\n".join(wrong)


def test_no_shared_module_names_env_side_code():
    """Not in an import, not in a string (a "module:Class" reference, a command line, a docstring)."""
    wrong = []
    for path, tree in _modules(ROOT / "rlfleet"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    ("services.env" in node.value or "services/env" in node.value):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.strip()[:80]!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("service", ["env", "inference", "learner", "coordinator"])
def test_services_never_import_each_other(service):
    wrong = []
    for path, tree in _modules(ROOT / "services" / service):
        for module in _imports(tree):
            if module.startswith("services.") and not module.startswith(f"services.{service}"):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


COORDINATOR_PREPARES = r"""
import json, sys
from rlfleet.config import ConfigError, load_config
from rlfleet.simulators import SIMULATORS
from services.coordinator.preflight import preflight_local
from services.coordinator.launcher import simulator_python
out = {}
for name, config in [("gym", "pandapickcube_ppo"), ("metaworld", "metaworld_mt10_ppo_mlp"),
                     ("libero", "libero_spatial_ppo_cnn"), ("maniskill", "maniskill_pushcube_ppo_mlp"),
                     ("behavior", "behavior_ppo_cnn")]:
    try:
        preflight_local(load_config(config, []))
        out[name] = "ok"
    except ConfigError as exc:
        out[name] = str(exc)[:200]
assert set(out) == set(SIMULATORS), out
loaded = sorted(m for m in sys.modules if m.startswith("services.env") or m.split(".")[0] in
                ("metaworld", "mani_skill", "sapien", "robosuite", "libero", "omnigibson"))
print(json.dumps({"preflight": out, "loaded": loaded}))
"""


def test_the_coordinator_never_loads_env_code_for_any_simulator():
    """The coordinator's preflight of every built-in simulator (what `coordinatorctl start` checks before anything
    runs) asks the env side in a subprocess: its own process loads no env-side module and no simulator package."""
    import json

    proc = subprocess.run([sys.executable, "-c", COORDINATOR_PREPARES], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == [], result
    assert all(result["preflight"][s] == "ok" for s in ("gym", "metaworld", "libero", "maniskill")), result
    # behavior needs an RTX GPU this machine lacks: the env side's preflight says so (the coordinator relays it)
    assert "behavior cannot run on this machine" in result["preflight"]["behavior"], result


def test_every_simulator_has_its_env_side_entry_and_nothing_else():
    """The shared registry (data) and the env side's table (code) name the same simulators."""
    from rlfleet.simulators import SIMULATORS
    from services.env.backends import FINISH_STEPS, PREFLIGHTS, SIM_BACKENDS

    assert set(SIM_BACKENDS) == set(SIMULATORS)
    assert set(PREFLIGHTS) <= set(SIMULATORS) and set(FINISH_STEPS) <= set(SIMULATORS)

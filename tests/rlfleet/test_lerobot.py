"""A dataset rlfleet writes is LeRobot's: ``lerobot``'s own ``LeRobotDataset`` (0.4.4, in an environment of its own,
tests/simenv.py) loads it with the same frames, actions, tasks and episode bounds, and images close to the recorded
ones (AV1 video is lossy). The other direction, a dataset lerobot writes trained on by ``sft``, is in
tests/services/learner/test_sft.py."""

from __future__ import annotations

import numpy as np

from rlfleet.data.datasets import DatasetWriter, Episode
from tests.rlfleet.test_datasets import _image, assert_close_frames
from tests.simenv import run_lerobot

LOAD = r"""
import json, torch
torch.set_num_threads(1)
from lerobot.datasets.lerobot_dataset import LeRobotDataset
d = LeRobotDataset("rlfleet/demos", root=ROOT)
items = [d[i] for i in range(len(d))]
out = {"len": len(d), "episodes": d.num_episodes, "fps": d.fps, "cameras": d.meta.camera_keys,
       "tasks": [it["task"] for it in items], "episode_index": [int(it["episode_index"]) for it in items],
       "frame_index": [int(it["frame_index"]) for it in items],
       "action": [it["action"].tolist() for it in items], "state": [it["observation.state"].tolist() for it in items],
       "reward": [float(it["next.reward"]) for it in items], "success": [bool(it["next.success"]) for it in items],
       # lerobot's images: float CHW in [0, 1]
       "image": [(it["observation.images.wrist"].permute(1, 2, 0) * 255).round().to(torch.uint8).tolist()
                 for it in items],
       "stats_action_mean": d.meta.stats["action"]["mean"].tolist(),
       "episode_rows": [[int(e["dataset_from_index"]), int(e["dataset_to_index"]), int(e["rlfleet/seed"])]
                        for e in d.meta.episodes]}
print(json.dumps(out))
"""


def test_a_dataset_rlfleet_writes_loads_in_lerobot(tmp_path):
    rng = np.random.default_rng(0)
    eps = []
    w = DatasetWriter(tmp_path / "d", env_id="PandaPickCubeVision-v0", simulator="gym", fps=10, source="test")
    for e, T in enumerate((6, 9, 4)):
        ep = Episode(
            {"wrist": _image(T, e), "state": rng.normal(size=(T, 7)).astype(np.float32)},
            rng.uniform(-1, 1, (T, 4)).astype(np.float32),
            rng.normal(size=T).astype(np.float32),
            np.arange(T) == T - 1,
            f"pick the cube {e % 2}",
            500 + e,
            -1,
        )
        w.add(ep)
        eps.append(ep)
    w.close()
    out = run_lerobot(LOAD.replace("ROOT", repr(str(tmp_path / "d"))))
    assert (out["len"], out["episodes"], out["fps"], out["cameras"]) == (19, 3, 10, ["observation.images.wrist"])
    assert out["episode_index"] == [0] * 6 + [1] * 9 + [2] * 4
    assert out["frame_index"] == [*range(6), *range(9), *range(4)]
    assert out["tasks"] == ["pick the cube 0"] * 6 + ["pick the cube 1"] * 9 + ["pick the cube 0"] * 4
    np.testing.assert_array_equal(np.asarray(out["action"], np.float32), np.concatenate([e.actions for e in eps]))
    np.testing.assert_array_equal(
        np.asarray(out["state"], np.float32), np.concatenate([e.observations["state"] for e in eps])
    )
    np.testing.assert_array_equal(np.asarray(out["reward"], np.float32), np.concatenate([e.rewards for e in eps]))
    assert out["success"] == [bool(s) for e in eps for s in e.success]
    np.testing.assert_allclose(out["stats_action_mean"], np.concatenate([e.actions for e in eps]).mean(0), rtol=1e-5)
    assert out["episode_rows"] == [[0, 6, 500], [6, 15, 501], [15, 19, 502]]
    images = np.asarray(out["image"], np.uint8)  # decoded by lerobot (torchcodec), frame by timestamp
    bounds = np.cumsum([0] + [e.length for e in eps])
    for i, ep in enumerate(eps):
        assert_close_frames(images[bounds[i] : bounds[i + 1]], ep.observations["wrist"])

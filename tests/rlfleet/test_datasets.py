"""Demonstration datasets in LeRobot's v3.0 layout: round trip (video lossy, the rest exact), completeness marker,
statistics, the files lerobot expects, the key map, and clear errors (not a dataset, the old npz layout, a missing
feature)."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from rlfleet.data.datasets import Dataset, DatasetWriter, Episode


def _image(T: int, seed: int, size: int = 32) -> np.ndarray:
    """Frames of two blocks of soft colour that change every step: what video keeps nearly as it is."""
    img = np.zeros((T, size, size, 3), np.uint8)
    for t in range(T):
        img[t, : size // 2] = (80 + 16 * (t % 8), 164, 100 + 10 * seed % 50)
        img[t, size // 2 :] = (174, 80 + 14 * (t % 9), 124)
    return img


def assert_close_frames(got: np.ndarray, want: np.ndarray) -> None:
    """Decoded video frames: close to the recorded ones (AV1 is lossy), each nearest its own step's frame."""
    assert got.shape == want.shape and got.dtype == np.uint8
    diff = np.abs(got.astype(int) - want)
    assert diff.mean() < 4 and diff.max() < 40, (diff.mean(), diff.max())
    dist = np.abs(got[:, None].astype(int) - want[None]).mean(axis=(2, 3, 4))  # [decoded, recorded]
    assert (dist.argmin(1) == np.arange(len(got))).all(), dist.round(1)


def _episode(T: int, seed: int) -> Episode:
    rng = np.random.default_rng(seed)
    return Episode(
        {"image": _image(T, seed), "state": rng.normal(size=(T, 3)).astype(np.float32)},
        rng.uniform(-1, 1, (T, 4)).astype(np.float32),
        np.arange(T, dtype=np.float32),
        np.arange(T) == T - 1,
        f"do thing {seed % 2}",
        seed,
        3,
    )


def _write(root, eps, **kw) -> Dataset:
    w = DatasetWriter(root, env_id="X-v0", simulator="gym", fps=10, source="test", **kw)
    for ep in eps:
        w.add(ep)
    w.close()
    return Dataset(root)


def test_round_trip_and_statistics(tmp_path):
    eps = [_episode(5, 1), _episode(7, 2)]
    d = _write(tmp_path / "d", eps)
    assert len(d) == 2 and d.action_dim == 4 and d.meta["total_frames"] == 12 and d.meta["env_id"] == "X-v0"
    assert d.observation_features == {
        "image": {"dtype": "uint8", "shape": [32, 32, 3]},
        "state": {"dtype": "float32", "shape": [3]},
    }
    for i, ep in enumerate(eps):
        back = d.episode(i)
        np.testing.assert_array_equal(back.actions, ep.actions)
        np.testing.assert_array_equal(back.observations["state"], ep.observations["state"])
        np.testing.assert_array_equal(back.rewards, ep.rewards)
        np.testing.assert_array_equal(back.success, ep.success)
        assert_close_frames(back.observations["image"], ep.observations["image"])
        assert (back.instruction, back.seed, back.reset_state_id) == (ep.instruction, ep.seed, 3)
    assert d.episodes_meta[0]["success"] is True and d.episodes_meta[1]["length"] == 7
    stats = d.action_statistics()
    acts = np.concatenate([e.actions for e in eps])
    np.testing.assert_allclose(stats["q99"], np.quantile(acts, 0.99, axis=0), rtol=1e-6)
    np.testing.assert_allclose(
        d.observation_statistics("state")["mean"],
        np.concatenate([e.observations["state"] for e in eps]).mean(0),
        rtol=1e-5,
    )


def test_the_files_are_lerobots_v30_layout(tmp_path):
    """What lerobot 0.4's LeRobotDataset reads (tests/rlfleet/test_lerobot.py loads it with lerobot itself)."""
    eps = [_episode(5, 1), _episode(7, 2), _episode(3, 3)]
    _write(tmp_path / "d", eps)
    root = tmp_path / "d"
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == [
        "data/chunk-000/file-000.parquet",
        "meta/episodes/chunk-000/file-000.parquet",
        "meta/info.json",
        "meta/stats.json",
        "meta/tasks.parquet",
        "videos/observation.images.image/chunk-000/file-000.mp4",
    ]
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 10 and info["total_episodes"] == 3
    assert info["total_frames"] == 15 and info["total_tasks"] == 2 and info["splits"] == {"train": "0:3"}
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    feats = info["features"]
    assert (
        feats["observation.images.image"]["dtype"] == "video"
        and feats["observation.images.image"]["shape"] == [32, 32, 3]
        and feats["observation.images.image"]["info"]["video.codec"] == "av1"
    )
    assert feats["observation.state"] == {"dtype": "float32", "shape": [3], "names": None}
    assert {k: feats[k]["dtype"] for k in ("action", "next.reward", "next.success", "timestamp", "index")} == {
        "action": "float32",
        "next.reward": "float32",
        "next.success": "bool",
        "timestamp": "float32",
        "index": "int64",
    }
    assert info["rlfleet"]["env_id"] == "X-v0" and info["rlfleet"]["observations"] == {
        "image": "observation.images.image",
        "state": "observation.state",
    }
    frames = pq.read_table(root / "data/chunk-000/file-000.parquet").to_pydict()
    assert frames["index"] == list(range(15)) and frames["episode_index"] == [0] * 5 + [1] * 7 + [2] * 3
    assert frames["frame_index"][5:8] == [0, 1, 2] and frames["timestamp"][6] == pytest.approx(0.1)
    assert frames["task_index"] == [0] * 5 + [1] * 7 + [0] * 3  # "do thing 1" came first
    episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    e1 = episodes[1]
    assert (e1["dataset_from_index"], e1["dataset_to_index"], e1["length"], e1["tasks"]) == (5, 12, 7, ["do thing 0"])
    assert e1["videos/observation.images.image/from_timestamp"] == pytest.approx(0.5)
    assert e1["videos/observation.images.image/to_timestamp"] == pytest.approx(1.2)
    assert (e1["rlfleet/seed"], e1["rlfleet/reset_state_id"], e1["rlfleet/success"]) == (2, 3, True)
    np.testing.assert_allclose(e1["stats/action/mean"], eps[1].actions.mean(0), rtol=1e-5)
    assert np.asarray(e1["stats/observation.images.image/mean"]).shape == (3, 1, 1)
    stats = json.loads((root / "meta" / "stats.json").read_text())
    np.testing.assert_allclose(stats["action"]["mean"], np.concatenate([e.actions for e in eps]).mean(0), rtol=1e-5)
    np.testing.assert_allclose(stats["action"]["std"], np.concatenate([e.actions for e in eps]).std(0), rtol=1e-5)
    assert stats["action"]["count"] == [15]
    tasks = pq.read_table(root / "meta/tasks.parquet")
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["__index_level_0__"]
    assert tasks.to_pydict() == {"task_index": [0, 1], "__index_level_0__": ["do thing 1", "do thing 0"]}


def test_the_key_map_names_the_policy_inputs(tmp_path):
    _write(tmp_path / "d", [_episode(4, 1)])
    d = Dataset(tmp_path / "d", {"third_person": "observation.images.image", "action": "action"})
    assert d.observation_features == {"third_person": {"dtype": "uint8", "shape": [32, 32, 3]}}
    assert set(d.episode(0).observations) == {"third_person"}
    assert set(Dataset(tmp_path / "d", {"action": "action"}).observation_features) == {"image", "state"}  # defaults
    with pytest.raises(
        ValueError,
        match=r"'wrist' is mapped to the feature 'observation.images.wrist' "
        r"\(sft.dataset_keys\), which the dataset does not have; its features: "
        r"action, episode_index, .*observation.images.image, observation.state",
    ):
        Dataset(tmp_path / "d", {"wrist": "observation.images.wrist"})
    with pytest.raises(ValueError, match="'action' is mapped to the feature 'act'"):
        Dataset(tmp_path / "d", {"state": "observation.state", "action": "act"})
    with pytest.raises(KeyError, match="has no observation 'joints'"):
        d.observation_statistics("joints")


def test_incomplete_old_or_foreign_folders_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no meta/info.json.*collect-demos"):
        Dataset(tmp_path)
    w = DatasetWriter(tmp_path / "d", env_id="X-v0", simulator="gym", fps=10, source="test")
    w.add(_episode(3, 1))
    w.close(complete=False)  # a failed collection never reads as a dataset
    with pytest.raises(FileNotFoundError):
        Dataset(tmp_path / "d")
    (tmp_path / "d" / "meta" / "info.json").write_text(json.dumps({"codebase_version": "v2.1"}))
    with pytest.raises(ValueError, match="codebase_version 'v2.1'; rlfleet reads LeRobot datasets of v3.0"):
        Dataset(tmp_path / "d")
    with pytest.raises(FileExistsError):
        DatasetWriter(tmp_path / "d", env_id="X-v0", simulator="gym", fps=10, source="test")
    old = tmp_path / "old"  # the npz layout of rlfleet before LeRobot v3.0
    (old / "data" / "chunk-000").mkdir(parents=True)
    np.savez(old / "data" / "chunk-000" / "episode_000000.npz", action=np.zeros((2, 4)))
    (old / "meta").mkdir()
    (old / "meta" / "episodes.jsonl").write_text('{"episode_index": 0, "length": 2}\n')
    with pytest.raises(
        ValueError,
        match="npz demonstration folder of an older rlfleet.*re-collect it with `coordinatorctl collect-demos CONFIG`",
    ):
        Dataset(old)
    (old / "meta" / "info.json").write_text(json.dumps({"format": "rlfleet-episodes", "version": 1}))
    with pytest.raises(ValueError, match="npz demonstration folder.*re-collect"):
        Dataset(old)
    with pytest.raises(ValueError, match="fps must be a whole number"):
        DatasetWriter(tmp_path / "e", env_id="X-v0", simulator="gym", fps=0, source="test")


def test_mismatched_episodes_are_refused(tmp_path):
    w = DatasetWriter(tmp_path / "d", env_id="X-v0", simulator="gym", fps=10, source="test")
    w.add(_episode(3, 1))
    bad = _episode(3, 2)
    bad.observations["state"] = bad.observations["state"][:, :2]
    with pytest.raises(ValueError, match="differ from the dataset's"):
        w.add(bad)
    short = _episode(3, 3)
    short.rewards = short.rewards[:2]
    with pytest.raises(ValueError, match="'next.reward' has 2 steps"):
        w.add(short)
    w.close(complete=False)


def test_files_roll_over_past_their_size(tmp_path, monkeypatch):
    """Past data_files_size_in_mb / video_files_size_in_mb the next episode goes to file-001, as lerobot does."""
    import rlfleet.data.datasets as ds

    monkeypatch.setattr(ds, "DATA_FILE_MB", 1e-9)
    monkeypatch.setattr(ds, "VIDEO_FILE_MB", 1e-9)
    eps = [_episode(40, 1), _episode(30, 2), _episode(3, 3)]  # long enough that the encoder has written packets
    d = _write(tmp_path / "d", eps)
    root = tmp_path / "d"
    assert sorted(p.name for p in (root / "data" / "chunk-000").iterdir()) == [
        "file-000.parquet",
        "file-001.parquet",
        "file-002.parquet",
    ]
    assert len(list((root / "videos" / "observation.images.image" / "chunk-000").iterdir())) == 3
    for i, ep in enumerate(eps):
        back = d.episode(i)
        np.testing.assert_array_equal(back.actions, ep.actions)
        assert_close_frames(back.observations["image"], ep.observations["image"])


RAW_SVT = r"""
import os, numpy as np, av
c = av.open(os.environ["OUT"], "w")
s = c.add_stream("libsvtav1", rate=10)
s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
for i in range(4):
    for p in s.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")):
        c.mux(p)
for p in s.encode(None):
    c.mux(p)
c.close()
print(os.sched_getscheduler(0))
"""


def test_writing_a_video_leaves_the_writers_scheduling_as_it_was(tmp_path):
    """SVT-AV1 run as root switches the thread that drives it to SCHED_FIFO 99 (shown first with PyAV alone, in a
    subprocess); the dataset writer's video file puts the policy back after each call into the encoder."""
    import subprocess
    import sys

    from rlfleet.data.datasets import _VideoFile

    if os.geteuid() == 0:
        raw = subprocess.run(
            [sys.executable, "-c", RAW_SVT],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OUT": str(tmp_path / "raw.mp4"), "SVT_LOG": "1"},
        )
        assert raw.returncode == 0, raw.stderr[-2000:]
        assert int(raw.stdout.split()[-1]) == os.SCHED_FIFO  # the encoder's doing, without the writer's guard
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    video = _VideoFile(tmp_path / "v.mp4", 10, 32, 32, 3)
    assert (os.sched_getscheduler(0), os.sched_getparam(0)) == before
    video.add(np.zeros((4, 32, 32, 3), np.uint8))
    assert (os.sched_getscheduler(0), os.sched_getparam(0)) == before
    video.close()
    assert (os.sched_getscheduler(0), os.sched_getparam(0)) == before and video.frames == 4

"""Demonstration datasets: round trip, completeness marker, statistics, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlfleet.data.datasets import Dataset, DatasetWriter, Episode


def _episode(T: int, seed: int) -> Episode:
    rng = np.random.default_rng(seed)
    return Episode({"image": rng.integers(0, 255, (T, 8, 8, 3), dtype=np.uint8),
                    "state": rng.normal(size=(T, 3)).astype(np.float32)},
                   rng.uniform(-1, 1, (T, 4)).astype(np.float32), np.ones(T, np.float32),
                   np.arange(T) == T - 1, "do the thing", seed, 3)


def test_round_trip_and_statistics(tmp_path):
    w = DatasetWriter(tmp_path / "d", env_id="X-v0", simulator="gym", fps=10, source="test")
    eps = [_episode(5, 1), _episode(7, 2)]
    for ep in eps:
        w.add(ep)
    w.close()
    d = Dataset(tmp_path / "d")
    assert len(d) == 2 and d.action_dim == 4 and d.meta["total_frames"] == 12
    assert d.observation_features == {"image": {"dtype": "uint8", "shape": [8, 8, 3]},
                                      "state": {"dtype": "float32", "shape": [3]}}
    back = d.episode(1)
    np.testing.assert_array_equal(back.observations["image"], eps[1].observations["image"])
    np.testing.assert_array_equal(back.actions, eps[1].actions)
    assert (back.instruction, back.seed, back.reset_state_id) == ("do the thing", 2, 3)
    assert d.episodes_meta[0]["success"] is True
    stats = d.action_statistics()
    acts = np.concatenate([e.actions for e in eps])
    np.testing.assert_allclose(stats["q99"], np.quantile(acts, 0.99, axis=0), rtol=1e-6)


def test_incomplete_or_foreign_folders_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no meta/info.json.*collect-demos"):
        Dataset(tmp_path)
    w = DatasetWriter(tmp_path / "d", env_id="X-v0", simulator="gym", fps=10, source="test")
    w.add(_episode(3, 1))
    w.close(complete=False)  # a failed collection never reads as a dataset
    with pytest.raises(FileNotFoundError):
        Dataset(tmp_path / "d")
    (tmp_path / "d" / "meta" / "info.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="format 'other'"):
        Dataset(tmp_path / "d")
    with pytest.raises(FileExistsError):
        DatasetWriter(tmp_path / "d", env_id="X-v0", simulator="gym", fps=10, source="test")


def test_mismatched_episodes_are_refused(tmp_path):
    w = DatasetWriter(tmp_path / "d", env_id="X-v0", simulator="gym", fps=10, source="test")
    w.add(_episode(3, 1))
    bad = _episode(3, 2)
    bad.observations["state"] = bad.observations["state"][:, :2]
    with pytest.raises(ValueError, match="differ from the dataset's"):
        w.add(bad)
    short = _episode(3, 3)
    short.rewards = short.rewards[:2]
    with pytest.raises(ValueError, match="'reward' has 2 steps"):
        w.add(short)

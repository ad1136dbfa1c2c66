"""Demonstration datasets: episodes of observations, instructions and actions on disk, in a LeRobot-style layout.

::

    DATASET/
      meta/info.json          format, env id, simulator, fps, features (key -> dtype, shape), totals
      meta/episodes.jsonl     one line per episode: episode_index, length, instruction, success, seed, reset_state_id
      data/chunk-000/episode_000000.npz
                              observation.<key> [T, ...] (each observation entry, images uint8 HWC),
                              action [T, action_dim] float32, reward [T] float32, success [T] bool

Episode files are plain ``.npz`` arrays (read with ``allow_pickle=False``), a chunk folder per 1000 episodes as
LeRobot does. Written by the env side (its demo collector, torch-free, also inside simulator environments) and
read by the learner's supervised fine-tuning.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "rlfleet-episodes"
VERSION = 1
EPISODES_PER_CHUNK = 1000


@dataclass
class Episode:
    observations: dict[str, np.ndarray]  # key -> [T, ...]
    actions: np.ndarray                  # [T, action_dim]
    rewards: np.ndarray                  # [T]
    success: np.ndarray                  # [T] bool
    instruction: str = ""
    seed: int = -1
    reset_state_id: int = -1

    @property
    def length(self) -> int:
        return int(self.actions.shape[0])


def _episode_path(root: Path, index: int) -> Path:
    return root / "data" / f"chunk-{index // EPISODES_PER_CHUNK:03d}" / f"episode_{index:06d}.npz"


class DatasetWriter:
    """Appends episodes to a new dataset folder; ``close()`` writes ``meta/info.json`` (present = complete)."""

    def __init__(self, root: str | Path, *, env_id: str, simulator: str, fps: float, source: str,
                 overwrite: bool = False):
        self.root = Path(root)
        if (self.root / "meta" / "info.json").exists() and not overwrite:
            raise FileExistsError(f"{self.root} already holds a dataset (pass overwrite to replace it)")
        (self.root / "meta").mkdir(parents=True, exist_ok=True)
        for old in self.root.glob("data/chunk-*/episode_*.npz"):
            old.unlink()
        (self.root / "meta" / "info.json").unlink(missing_ok=True)
        self.meta = {"format": FORMAT, "version": VERSION, "env_id": env_id, "simulator": simulator, "fps": fps,
                     "source": source, "features": {}, "total_episodes": 0, "total_frames": 0}
        self._episodes = open(self.root / "meta" / "episodes.jsonl", "w")

    def add(self, ep: Episode) -> int:
        index = self.meta["total_episodes"]
        features = {f"observation.{k}": v for k, v in ep.observations.items()}
        features.update({"action": ep.actions.astype(np.float32), "reward": ep.rewards.astype(np.float32),
                         "success": ep.success.astype(bool)})
        for name, arr in features.items():
            if arr.shape[0] != ep.length:
                raise ValueError(f"episode {index}: '{name}' has {arr.shape[0]} steps, the actions {ep.length}")
        spec = {name: {"dtype": str(arr.dtype), "shape": list(arr.shape[1:])} for name, arr in features.items()}
        if self.meta["features"] and spec != self.meta["features"]:
            raise ValueError(f"episode {index}: features {spec} differ from the dataset's {self.meta['features']}")
        self.meta["features"] = spec
        path = _episode_path(self.root, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **features)
        self._episodes.write(json.dumps({"episode_index": index, "length": ep.length, "instruction": ep.instruction,
                                         "success": bool(ep.success.any()), "seed": ep.seed,
                                         "reset_state_id": ep.reset_state_id}) + "\n")
        self._episodes.flush()
        self.meta["total_episodes"] += 1
        self.meta["total_frames"] += ep.length
        return index

    def close(self, complete: bool = True) -> None:
        """Finish the dataset (``complete=False`` after a failure: no info.json, so it is never read as whole)."""
        self._episodes.close()
        if complete:
            (self.root / "meta" / "info.json").write_text(json.dumps(self.meta, indent=1))


class Dataset:
    """A dataset folder written by :class:`DatasetWriter`."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        info = self.root / "meta" / "info.json"
        if not info.is_file():
            raise FileNotFoundError(f"{self.root}: no meta/info.json - not a (complete) demonstration dataset; "
                                    f"collect one with `coordinatorctl collect-demos CONFIG`")
        self.meta = json.loads(info.read_text())
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{info}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        lines = (self.root / "meta" / "episodes.jsonl").read_text().splitlines()
        self.episodes_meta = [json.loads(line) for line in lines if line.strip()]

    def __len__(self) -> int:
        return len(self.episodes_meta)

    @property
    def observation_features(self) -> dict[str, Mapping]:
        return {k.split(".", 1)[1]: v for k, v in self.meta["features"].items() if k.startswith("observation.")}

    @property
    def action_dim(self) -> int:
        return int(np.prod(self.meta["features"]["action"]["shape"]))

    def episode(self, index: int) -> Episode:
        m = self.episodes_meta[index]
        with np.load(_episode_path(self.root, index), allow_pickle=False) as z:
            obs = {k.split(".", 1)[1]: z[k] for k in z.files if k.startswith("observation.")}
            return Episode(obs, z["action"], z["reward"], z["success"], m.get("instruction", ""),
                           int(m.get("seed", -1)), int(m.get("reset_state_id", -1)))

    def __iter__(self) -> Iterator[Episode]:
        for i in range(len(self)):
            yield self.episode(i)

    def action_statistics(self) -> dict[str, list[float]]:
        """Per-dimension q01/q99/mean/std of the actions (OpenVLA's ``dataset_statistics`` for un-normalising)."""
        return _statistics(np.concatenate([ep.actions.reshape(ep.length, -1) for ep in self]))

    def observation_statistics(self, key: str) -> dict[str, list[float]]:
        """The same statistics of an observation (``state``: OpenVLA-OFT's ``proprio`` statistics)."""
        if f"observation.{key}" not in self.meta["features"]:
            raise KeyError(f"the dataset {self.root} has no observation '{key}' (has: {sorted(self.observation_features)})")
        return _statistics(np.concatenate([ep.observations[key].reshape(ep.length, -1) for ep in self]))


def _statistics(values: np.ndarray) -> dict[str, list[float]]:
    """Per-column q01/q99/mean/std/min/max of [samples, dims]."""
    return {"q01": np.quantile(values, 0.01, axis=0).tolist(), "q99": np.quantile(values, 0.99, axis=0).tolist(),
            "mean": values.mean(0).tolist(), "std": values.std(0).tolist(), "min": values.min(0).tolist(),
            "max": values.max(0).tolist()}

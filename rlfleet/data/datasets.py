"""Demonstration datasets in LeRobot's format: LeRobotDataset v3.0, as the ``lerobot`` 0.4.x release writes and reads it.

::

    DATASET/
      meta/info.json                       codebase_version "v3.0", fps, features (name -> dtype, shape, names),
                                           totals, chunks_size, data_path / video_path templates, splits; rlfleet's
                                           own keys under "rlfleet" (env id, simulator, source), which lerobot ignores
      meta/tasks.parquet                   the instructions (pandas index) -> task_index
      meta/episodes/chunk-000/file-000.parquet
                                           a row per episode: tasks, length, the data and video files it lies in,
                                           dataset_from_index / to_index, from / to timestamps in each video,
                                           stats/<feature>/<stat> columns; rlfleet/seed, rlfleet/reset_state_id,
                                           rlfleet/success
      meta/stats.json                      statistics of every feature over the whole dataset
      data/chunk-000/file-000.parquet      a row per frame: index, episode_index, frame_index, timestamp,
                                           task_index, action, observation.<key> (vectors), next.reward,
                                           next.success
      videos/observation.images.<camera>/chunk-000/file-000.mp4
                                           each camera's frames, episode after episode (AV1, yuv420p, as lerobot
                                           encodes them), frame t of an episode at from_timestamp + t / fps

An observation ``k`` of rlfleet becomes the feature ``observation.images.k`` when it is an image (uint8 H x W x C,
stored as video) and ``observation.k`` otherwise (so ``state`` is LeRobot's ``observation.state``). Files roll over
to file-001, ... past 100 MB of frames or 200 MB of video, and to the next chunk after 1000 files, as lerobot does.

:class:`DatasetWriter` (torch-free: pyarrow, PyAV and numpy only, so it runs inside simulator environments) writes
what ``lerobot.datasets.lerobot_dataset.LeRobotDataset`` loads; :class:`Dataset` reads those and datasets written
by lerobot itself (video or image features), with a map of the policy's input names to the dataset's features
(``sft.dataset_keys``). Video is lossy: decoded images are close to, not equal to, the recorded ones.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

CODEBASE_VERSION = "v3.0"
CHUNKS_SIZE = 1000                 # files per chunk folder
DATA_FILE_MB = 100                 # a data file rolls over past this size
VIDEO_FILE_MB = 200                # ... a video file past this one
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
# lerobot 0.4's own encoding: AV1 by SVT-AV1, yuv420p, a key frame every 2 frames, crf 30
VIDEO_CODEC, VIDEO_CODEC_NAME, PIX_FMT, GOP, CRF = "libsvtav1", "av1", "yuv420p", 2, 30
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
IMAGE_PREFIX = "observation.images."
REWARD, SUCCESS = "next.reward", "next.success"
FRAME_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
RECOLLECT = "re-collect it with `coordinatorctl collect-demos CONFIG`"


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


def _is_image(v: np.ndarray) -> bool:
    """A camera: uint8 [T, H, W, C] (rlfleet's TensorSpace.is_image, per frame)."""
    return v.dtype == np.uint8 and v.ndim == 4


def feature_name(key: str, value: np.ndarray) -> str:
    """The LeRobot feature an rlfleet observation ``key`` ([T, ...]) is stored as."""
    return f"{IMAGE_PREFIX}{key}" if _is_image(value) else f"observation.{key}"


def _chunk_file(n: int) -> dict[str, int]:
    return {"chunk_index": n // CHUNKS_SIZE, "file_index": n % CHUNKS_SIZE}


# ---------------------------------------------------------------------------------------------------------- stats


def _stats(values: np.ndarray, image: bool = False) -> dict[str, np.ndarray]:
    """LeRobot's per-episode statistics of a feature: min/max/mean/std/count/q01..q99 over its frames (images:
    per channel, in [0, 1], shape [C, 1, 1], on at most 100 frames downsampled to about 150 pixels a side)."""
    if image:
        T, H, W = values.shape[:3]
        stride = max(1, math.ceil(max(H, W) / 150))
        rows = np.unique(np.linspace(0, T - 1, min(T, 100)).round().astype(int))
        v = values[rows, ::stride, ::stride].astype(np.float64) / 255.0  # [n, h, w, C]
        flat = v.reshape(-1, v.shape[-1])
        shape = lambda a: np.asarray(a).reshape(-1, 1, 1)  # noqa: E731
        count = len(rows)
    else:
        flat = values.reshape(len(values), -1).astype(np.float64)
        shape = lambda a: np.asarray(a).reshape(-1)  # noqa: E731
        count = len(values)
    out = {"min": shape(flat.min(0)), "max": shape(flat.max(0)), "mean": shape(flat.mean(0)),
           "std": shape(flat.std(0)), "count": np.asarray([count])}
    for name, q in QUANTILES.items():
        out[name] = shape(np.quantile(flat, q, axis=0))
    return out


def _aggregate(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The statistics of the union of episodes from theirs: weighted mean, pooled variance, min of mins, max of
    maxes, count-weighted quantiles (the approximation lerobot makes too)."""
    n = np.asarray([float(p["count"][0]) for p in parts])
    w = (n / n.sum()).reshape(-1, *([1] * np.ndim(parts[0]["mean"])))
    means = np.stack([p["mean"] for p in parts])
    mean = (w * means).sum(0)
    var = (w * (np.stack([p["std"] for p in parts]) ** 2 + (means - mean) ** 2)).sum(0)
    out = {"min": np.min([p["min"] for p in parts], 0), "max": np.max([p["max"] for p in parts], 0),
           "mean": mean, "std": np.sqrt(var), "count": np.asarray([int(n.sum())])}
    for name in QUANTILES:
        out[name] = (w * np.stack([p[name] for p in parts])).sum(0)
    return out


def _jsonable(stats: dict[str, np.ndarray]) -> dict[str, list]:
    return {k: np.asarray(v).tolist() for k, v in stats.items()}


# ---------------------------------------------------------------------------------------------------------- video


class _VideoFile:
    """One mp4 file of one camera, episodes appended frame after frame (PyAV, ``VIDEO_CODEC``)."""

    def __init__(self, path: Path, fps: int, height: int, width: int, channels: int):
        import av

        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its whole configuration per file otherwise
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.fps, self.frames, self.bytes = path, fps, 0, 0
        self.format = "rgb24" if channels == 3 else "gray"
        self.container = av.open(str(path), "w")
        self.stream = self.container.add_stream(VIDEO_CODEC, rate=fps)
        self.stream.width, self.stream.height, self.stream.pix_fmt = width, height, PIX_FMT
        self.stream.time_base = Fraction(1, fps)
        self.stream.options = {"g": str(GOP), "crf": str(CRF), "preset": "12"}

    def add(self, frames: np.ndarray) -> tuple[float, float]:
        """Append an episode's frames [T, H, W, C]; its (from, to) timestamps in this file."""
        import av

        start = self.frames
        for img in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(img if self.format == "rgb24" else img[..., 0]),
                                               format=self.format)
            frame.pts, frame.time_base = self.frames, Fraction(1, self.fps)
            for packet in self.stream.encode(frame):
                self.bytes += packet.size
                self.container.mux(packet)
            self.frames += 1
        return start / self.fps, self.frames / self.fps

    def size_mb(self) -> float:
        """What the encoder has produced so far (it holds back its last few frames until the file closes)."""
        return self.bytes / 2 ** 20

    def close(self) -> None:
        for packet in self.stream.encode(None):
            self.container.mux(packet)
        self.container.close()


def decode_video(path: Path, channels: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """All frames of a video file: (uint8 [N, H, W, C], their timestamps in seconds [N])."""
    import av

    fmt = "rgb24" if channels == 3 else "gray"
    frames, times = [], []
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        for frame in container.decode(stream):
            img = frame.to_ndarray(format=fmt)
            frames.append(img if channels == 3 else img[..., None])
            times.append(float(frame.pts * stream.time_base) if frame.pts is not None else float(frame.time))
    if not frames:
        raise ValueError(f"{path}: the video holds no frames")
    order = np.argsort(times, kind="stable")
    return np.stack(frames)[order], np.asarray(times)[order]


# --------------------------------------------------------------------------------------------------------- writer


class DatasetWriter:
    """Appends episodes to a new LeRobot v3.0 dataset folder; ``close()`` writes the episode index, tasks, stats and
    finally ``meta/info.json`` (present = complete)."""

    def __init__(self, root: str | Path, *, env_id: str, simulator: str, fps: int, source: str,
                 overwrite: bool = False, robot_type: str | None = None):
        import pyarrow  # noqa: F401 - fail here, before any episode is recorded, when it is missing

        self.root = Path(root)
        if (self.root / "meta" / "info.json").exists() and not overwrite:
            raise FileExistsError(f"{self.root} already holds a dataset (pass overwrite to replace it)")
        if int(fps) != fps or fps < 1:
            raise ValueError(f"fps must be a whole number >= 1 (LeRobot's fps), got {fps}")
        for sub in ("meta", "data", "videos"):  # only what a dataset consists of, never anything else there
            shutil.rmtree(self.root / sub, ignore_errors=True)
        (self.root / "meta").mkdir(parents=True, exist_ok=True)
        self.fps = int(fps)
        self.rlfleet = {"env_id": env_id, "simulator": simulator, "source": source, "observations": {}}
        self.robot_type = robot_type
        self.features: dict[str, dict] = {}
        self.total_episodes = self.total_frames = 0
        self._tasks: dict[str, int] = {}
        self._episodes: list[dict] = []
        self._stats: dict[str, list[dict]] = {}
        self._data_file, self._data_writer, self._data_frames = 0, None, 0
        self._videos: dict[str, _VideoFile] = {}
        self._video_file: dict[str, int] = {}

    @property
    def meta(self) -> dict:
        return {"env_id": self.rlfleet["env_id"], "simulator": self.rlfleet["simulator"], "fps": self.fps,
                "total_episodes": self.total_episodes, "total_frames": self.total_frames}

    def _spec(self, ep: Episode, index: int) -> tuple[dict[str, np.ndarray], dict[str, dict], dict[str, str]]:
        """The episode's features (name -> [T, ...]), their info.json entries, and its observation -> feature map."""
        arrays: dict[str, np.ndarray] = {}
        names: dict[str, str] = {}
        for k, v in ep.observations.items():
            v = np.asarray(v)
            names[k] = feature_name(k, v)
            arrays[names[k]] = v
        arrays.update({"action": np.asarray(ep.actions, np.float32), REWARD: np.asarray(ep.rewards, np.float32),
                       SUCCESS: np.asarray(ep.success, bool)})
        spec = {}
        for name, arr in arrays.items():
            if arr.shape[0] != ep.length:
                raise ValueError(f"episode {index}: '{name}' has {arr.shape[0]} steps, the actions {ep.length}")
            if name.startswith(IMAGE_PREFIX):
                H, W, C = arr.shape[1:]
                if C not in (1, 3):
                    raise ValueError(f"episode {index}: '{name}' has {C} channels; videos hold 1 or 3")
                spec[name] = {"dtype": "video", "shape": [H, W, C], "names": ["height", "width", "channels"],
                              "info": {"video.height": H, "video.width": W, "video.codec": VIDEO_CODEC_NAME,
                                       "video.pix_fmt": PIX_FMT, "video.is_depth_map": False, "video.fps": self.fps,
                                       "video.channels": C, "has_audio": False}}
            else:
                spec[name] = {"dtype": str(arr.dtype), "shape": [int(np.prod(arr.shape[1:], dtype=int))] or [1],
                              "names": None}
                if arr.ndim != 2 and name.startswith("observation."):  # flat in the parquet; its shape for rlfleet
                    spec[name]["rlfleet_shape"] = list(arr.shape[1:])
        return arrays, spec, names

    def add(self, ep: Episode) -> int:
        import pyarrow as pa
        import pyarrow.parquet as pq

        index = self.total_episodes
        if ep.length < 1:
            raise ValueError(f"episode {index}: no steps")
        arrays, spec, names = self._spec(ep, index)
        if self.features and spec != {k: v for k, v in self.features.items() if k not in FRAME_COLUMNS}:
            mine = {k: v for k, v in self.features.items() if k not in FRAME_COLUMNS}
            raise ValueError(f"episode {index}: features {spec} differ from the dataset's {mine}")
        if not self.features:
            self.features = {**spec, "timestamp": {"dtype": "float32", "shape": [1], "names": None},
                             **{c: {"dtype": "int64", "shape": [1], "names": None} for c in FRAME_COLUMNS[1:]}}
            self.rlfleet["observations"] = names
        T = ep.length
        task = self._tasks.setdefault(ep.instruction, len(self._tasks))
        frame = np.arange(T)
        columns = {"timestamp": (frame / self.fps).astype(np.float32), "frame_index": frame,
                   "episode_index": np.full(T, index), "index": self.total_frames + frame, "task_index": np.full(T, task)}
        row: dict = {"episode_index": index, "tasks": [ep.instruction], "length": T}
        stats: dict[str, dict] = {}
        if self._data_writer is not None and self._data_writer_mb() >= DATA_FILE_MB:
            self._close_data()
            self._data_file += 1
        table = {}
        for name, arr in arrays.items():
            if name.startswith(IMAGE_PREFIX):
                continue
            flat = arr.reshape(T, -1)
            table[name] = (pa.array(flat[:, 0]) if spec[name]["shape"] == [1] and arr.ndim <= 2 else
                           pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1]))
        table.update({k: pa.array(v) for k, v in columns.items()})
        table = pa.table(table)
        if self._data_writer is None:
            path = self.root / DATA_PATH.format(**_chunk_file(self._data_file))
            path.parent.mkdir(parents=True, exist_ok=True)
            self._data_writer = pq.ParquetWriter(str(path), table.schema)
            self._data_path = path
        self._data_writer.write_table(table)
        row.update({"data/chunk_index": _chunk_file(self._data_file)["chunk_index"],
                    "data/file_index": _chunk_file(self._data_file)["file_index"],
                    "dataset_from_index": self.total_frames, "dataset_to_index": self.total_frames + T})
        for name, arr in arrays.items():
            if not name.startswith(IMAGE_PREFIX):
                continue
            video = self._videos.get(name)
            if video is not None and video.size_mb() >= VIDEO_FILE_MB:
                video.close()
                self._video_file[name] += 1
                video = None
            if video is None:
                n = self._video_file.setdefault(name, 0)
                H, W, C = arr.shape[1:]
                video = self._videos[name] = _VideoFile(
                    self.root / VIDEO_PATH.format(video_key=name, **_chunk_file(n)), self.fps, H, W, C)
            start, end = video.add(arr)
            ids = _chunk_file(self._video_file[name])
            row.update({f"videos/{name}/chunk_index": ids["chunk_index"], f"videos/{name}/file_index": ids["file_index"],
                        f"videos/{name}/from_timestamp": start, f"videos/{name}/to_timestamp": end})
        for name, arr in {**arrays, **columns}.items():
            stats[name] = _stats(arr, image=name.startswith(IMAGE_PREFIX))
            self._stats.setdefault(name, []).append(stats[name])
        for name, st in stats.items():
            for stat, value in st.items():
                row[f"stats/{name}/{stat}"] = value.tolist()
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0, "rlfleet/seed": int(ep.seed),
                    "rlfleet/reset_state_id": int(ep.reset_state_id), "rlfleet/success": bool(np.any(ep.success))})
        self._episodes.append(row)
        self.total_episodes += 1
        self.total_frames += T
        return index

    def _data_writer_mb(self) -> float:
        return self._data_path.stat().st_size / 2 ** 20 if self._data_path.exists() else 0.0

    def _close_data(self) -> None:
        if self._data_writer is not None:
            self._data_writer.close()
            self._data_writer = None

    def close(self, complete: bool = True) -> None:
        """Finish the dataset (``complete=False`` after a failure: no info.json, so it is never read as whole)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._close_data()
        for video in self._videos.values():
            video.close()
        self._videos = {}
        if not complete:
            return
        if not self._episodes:
            raise ValueError(f"{self.root}: no episode was recorded")
        path = self.root / EPISODES_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self._episodes), str(path))
        _write_tasks(self.root / "meta" / "tasks.parquet", self._tasks)
        stats = {name: _jsonable(_aggregate(parts)) for name, parts in self._stats.items()}
        (self.root / "meta" / "stats.json").write_text(json.dumps(stats, indent=1))
        has_video = any(f["dtype"] == "video" for f in self.features.values())
        info = {"codebase_version": CODEBASE_VERSION, "robot_type": self.robot_type,
                "total_episodes": self.total_episodes, "total_frames": self.total_frames,
                "total_tasks": len(self._tasks), "chunks_size": CHUNKS_SIZE, "data_files_size_in_mb": DATA_FILE_MB,
                "video_files_size_in_mb": VIDEO_FILE_MB, "fps": self.fps,
                "splits": {"train": f"0:{self.total_episodes}"}, "data_path": DATA_PATH,
                "video_path": VIDEO_PATH if has_video else None,
                "features": {k: {kk: vv for kk, vv in v.items() if kk != "rlfleet_shape"}
                             for k, v in self.features.items()},
                "rlfleet": {**self.rlfleet, "shapes": {k: v["rlfleet_shape"] for k, v in self.features.items()
                                                       if "rlfleet_shape" in v}}}
        (self.root / "meta" / "info.json").write_text(json.dumps(info, indent=4))


def _write_tasks(path: Path, tasks: dict[str, int]) -> None:
    """meta/tasks.parquet as lerobot writes it with pandas: the instructions as the (unnamed) index, task_index as
    the column; the "pandas" schema metadata restores the index when pandas reads it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = sorted(tasks, key=tasks.get)
    pandas_meta = {"index_columns": ["__index_level_0__"],
                   "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode",
                                       "numpy_type": "object", "metadata": {"encoding": "UTF-8"}}],
                   "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                                "numpy_type": "int64", "metadata": None},
                               {"name": None, "field_name": "__index_level_0__", "pandas_type": "unicode",
                                "numpy_type": "object", "metadata": None}],
                   "attributes": {}, "creator": {"library": "pyarrow", "version": pa.__version__},
                   "pandas_version": "2.2.3"}
    table = pa.table({"task_index": pa.array([tasks[n] for n in names], pa.int64()),
                      "__index_level_0__": pa.array(names, pa.string())})
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)}), str(path))


def _read_tasks(path: Path) -> dict[int, str]:
    """task_index -> instruction of meta/tasks.parquet (the pandas index lerobot writes, or a "task" column)."""
    import pyarrow.parquet as pq

    table = pq.read_table(str(path))
    meta = json.loads((table.schema.metadata or {}).get(b"pandas", b"{}"))
    names = [c for c in meta.get("index_columns", []) if isinstance(c, str) and c in table.column_names]
    column = names[0] if names else ("task" if "task" in table.column_names else None)
    if column is None or "task_index" not in table.column_names:
        raise ValueError(f"{path}: no task names (expected a task_index column and the tasks as index or 'task')")
    return dict(zip(table.column("task_index").to_pylist(), table.column(column).to_pylist()))


# --------------------------------------------------------------------------------------------------------- reader


def default_keys(info: dict) -> dict[str, str]:
    """Policy input name -> feature when no map is given: rlfleet's own datasets map back to their observation
    keys; any other dataset's ``observation.images.<camera>`` to ``<camera>``, ``observation.<key>`` (e.g.
    ``observation.state``) to ``<key>``, and ``action`` to ``action``."""
    own = (info.get("rlfleet") or {}).get("observations")
    if own:
        return {**own, "action": "action"}
    out = {}
    for name, ft in info.get("features", {}).items():
        if name.startswith(IMAGE_PREFIX) and ft.get("dtype") in ("video", "image"):
            out[name[len(IMAGE_PREFIX):]] = name
        elif name.startswith("observation.") and not name.startswith(IMAGE_PREFIX) \
                and ft.get("dtype") not in ("video", "image", "string"):
            out[name[len("observation."):]] = name
    out["action"] = "action"
    return out


def _hwc(ft: dict) -> list[int]:
    """[H, W, C] of an image/video feature (lerobot's shapes are H, W, C, or C, H, W where names say so)."""
    shape = [int(s) for s in ft["shape"]]
    names = [str(n).lower() for n in (ft.get("names") or [])]
    if len(shape) == 3 and names and names[0] in ("channel", "channels", "c"):
        return [shape[1], shape[2], shape[0]]
    return shape


class Dataset:
    """A LeRobot v3.0 dataset folder (written by :class:`DatasetWriter`, or by ``lerobot``) read as rlfleet
    episodes. ``keys``: policy input name -> dataset feature (``action`` -> the action feature); the observations
    of :func:`default_keys` where it maps none. ``name``: what the dataset is called where it has no env id of rlfleet's (a hub id)."""

    def __init__(self, root: str | Path, keys: Mapping[str, str] | None = None, name: str | None = None):
        self.root = Path(root)
        info_path = self.root / "meta" / "info.json"
        old = (self.root / "meta" / "episodes.jsonl").exists() or any(self.root.glob("data/chunk-*/episode_*.npz"))
        if not info_path.is_file():
            if old:
                raise ValueError(f"{self.root}: an npz demonstration folder of an older rlfleet, which no longer "
                                 f"reads it (datasets are LeRobot v3.0 now); {RECOLLECT}")
            raise FileNotFoundError(f"{self.root}: no meta/info.json - not a (complete) LeRobot dataset; "
                                    f"collect one with `coordinatorctl collect-demos CONFIG`")
        info = json.loads(info_path.read_text())
        if info.get("format") == "rlfleet-episodes" or (old and "codebase_version" not in info):
            raise ValueError(f"{info_path}: an npz demonstration folder of an older rlfleet, which no longer reads "
                             f"it (datasets are LeRobot v3.0 now); {RECOLLECT}")
        version = info.get("codebase_version")
        if version != CODEBASE_VERSION:
            raise ValueError(f"{info_path}: codebase_version {version!r}; rlfleet reads LeRobot datasets of "
                             f"{CODEBASE_VERSION} (convert older ones with lerobot's "
                             f"`python -m lerobot.datasets.v30.convert_dataset_v21_to_v30`)")
        self.info = info
        self.features: dict[str, dict] = info.get("features", {})
        own = info.get("rlfleet") or {}
        keys = dict(keys or {})
        self.action_feature = keys.pop("action", "action")
        self.keys = keys or {k: v for k, v in default_keys(info).items() if k != "action"}  # only the action mapped
        for key, feature in [*keys.items(), ("action", self.action_feature)]:
            if feature not in self.features:
                raise ValueError(f"{self.root}: '{key}' is mapped to the feature '{feature}' (sft.dataset_keys), "
                                 f"which the dataset does not have; its features: {', '.join(sorted(self.features))}")
            if self.features[feature].get("dtype") == "string":
                raise ValueError(f"{self.root}: '{key}' is mapped to '{feature}', a string feature")
        self.meta = {"env_id": own.get("env_id") or name or self.root.name, "simulator": own.get("simulator"),
                     "source": own.get("source"), "fps": info.get("fps"), "total_episodes": info.get("total_episodes"),
                     "total_frames": info.get("total_frames"), "codebase_version": version,
                     "features": self.features}
        self._shapes = own.get("shapes") or {}
        self._tasks = _read_tasks(self.root / "meta" / "tasks.parquet")
        self._episodes = self._read_episodes()
        self.episodes_meta = [
            {"episode_index": int(r["episode_index"]), "length": int(r["length"]),
             "instruction": (r.get("tasks") or [""])[0], "success": bool(r.get("rlfleet/success", False)),
             "seed": int(r.get("rlfleet/seed", -1)), "reset_state_id": int(r.get("rlfleet/reset_state_id", -1))}
            for r in self._episodes]
        self._frames: dict[str, np.ndarray] | None = None
        self._videos: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}

    # ------------------------------------------------------------------------------------------- metadata

    def _read_episodes(self) -> list[dict]:
        import pyarrow.parquet as pq

        paths = sorted((self.root / "meta" / "episodes").glob("*/*.parquet"))
        if not paths:
            raise FileNotFoundError(f"{self.root}: no meta/episodes/chunk-*/file-*.parquet - not a complete LeRobot "
                                    f"v3.0 dataset")
        rows = []
        for path in paths:
            cols = [c for c in pq.read_schema(str(path)).names if not c.startswith("stats/")]
            rows += pq.read_table(str(path), columns=cols).to_pylist()
        return sorted(rows, key=lambda r: r["episode_index"])

    def __len__(self) -> int:
        return len(self._episodes)

    def _spec(self, feature: str) -> dict:
        ft = self.features[feature]
        if ft["dtype"] in ("video", "image"):
            return {"dtype": "uint8", "shape": _hwc(ft)}
        shape = self._shapes.get(feature) or [int(s) for s in ft["shape"]]
        return {"dtype": ft["dtype"], "shape": list(shape)}

    @property
    def observation_features(self) -> dict[str, Mapping]:
        """Policy input name -> {dtype, shape} (images uint8 [H, W, C])."""
        return {k: self._spec(f) for k, f in self.keys.items()}

    @property
    def action_dim(self) -> int:
        return int(np.prod(self.features[self.action_feature]["shape"]))

    # ----------------------------------------------------------------------------------------------- frames

    def _load_frames(self) -> dict[str, np.ndarray]:
        """Every frame's columns this reader needs (sorted by global index), from all data files."""
        if self._frames is not None:
            return self._frames
        import pyarrow as pa
        import pyarrow.parquet as pq

        paths = sorted((self.root / "data").glob("*/*.parquet"))
        if not paths:
            raise FileNotFoundError(f"{self.root}: no data/chunk-*/file-*.parquet")
        wanted = {"index", "episode_index", "frame_index", "timestamp", "task_index", self.action_feature, REWARD,
                  SUCCESS, *(f for f in self.keys.values() if self.features[f]["dtype"] != "video")}
        tables = []
        for path in paths:
            names = pq.read_schema(str(path)).names
            tables.append(pq.read_table(str(path), columns=[c for c in names if c in wanted]))
        table = pa.concat_tables(tables, promote_options="default")
        out = {}
        for name in table.column_names:
            out[name] = self._column(name, table.column(name).combine_chunks())
        order = np.argsort(out["index"], kind="stable")
        self._frames = {k: v[order] for k, v in out.items()}
        return self._frames

    def _column(self, name: str, col) -> np.ndarray:
        import pyarrow as pa

        ft = self.features.get(name, {})
        if ft.get("dtype") == "image":  # PNG/JPEG bytes in a {bytes, path} struct, as lerobot stores images
            import io

            from PIL import Image

            channels = _hwc(ft)[2]
            mode = "RGB" if channels == 3 else "L"
            imgs = []
            for item in col.to_pylist():
                data = item["bytes"] if item.get("bytes") else (self.root / item["path"]).read_bytes()
                img = np.asarray(Image.open(io.BytesIO(data)).convert(mode))
                imgs.append(img if channels == 3 else img[..., None])
            return np.stack(imgs)
        if pa.types.is_fixed_size_list(col.type) or pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            n = len(col)
            values = col.flatten()
            while pa.types.is_fixed_size_list(values.type) or pa.types.is_list(values.type):
                values = values.flatten()
            arr = values.to_numpy(zero_copy_only=False)
            return arr.reshape(n, -1) if n else arr.reshape(0, 1)
        return col.to_numpy(zero_copy_only=False)

    def _video_frames(self, feature: str, ep: dict, timestamps: np.ndarray) -> np.ndarray:
        """The frames of one episode in one camera's video: those nearest its frames' timestamps."""
        ids = {"chunk_index": int(ep[f"videos/{feature}/chunk_index"]),
               "file_index": int(ep[f"videos/{feature}/file_index"])}
        template = self.info.get("video_path") or VIDEO_PATH
        path = self.root / template.format(video_key=feature, **ids)
        if (feature, str(path)) not in self._videos:
            if not path.is_file():
                raise FileNotFoundError(f"{self.root}: episode {ep['episode_index']}'s video {path} is missing")
            self._videos[(feature, str(path))] = decode_video(path, _hwc(self.features[feature])[2])
        frames, times = self._videos[(feature, str(path))]
        want = float(ep[f"videos/{feature}/from_timestamp"]) + timestamps
        pos = np.clip(np.searchsorted(times, want), 1, len(times) - 1) if len(times) > 1 else np.zeros(len(want), int)
        if len(times) > 1:
            pos = np.where(np.abs(times[pos - 1] - want) <= np.abs(times[pos] - want), pos - 1, pos)
        fps = float(self.info.get("fps") or 1)
        off = np.abs(times[pos] - want).max()
        if off > 0.5 / fps:
            raise ValueError(f"{path}: no frame within half a frame of {want[np.argmax(np.abs(times[pos] - want))]:.4f}"
                             f" s (episode {ep['episode_index']}; the video's frames end at {times[-1]:.4f} s)")
        return frames[pos]

    def episode(self, index: int) -> Episode:
        ep = self._episodes[index]
        frames = self._load_frames()
        lo, hi = np.searchsorted(frames["index"], [int(ep["dataset_from_index"]), int(ep["dataset_to_index"])])
        rows = slice(int(lo), int(hi))
        T = hi - lo
        if T != int(ep["length"]):
            raise ValueError(f"{self.root}: episode {ep['episode_index']} has {T} frames in data/, its index says "
                             f"{ep['length']}")
        obs = {}
        for key, feature in self.keys.items():
            if self.features[feature]["dtype"] == "video":
                obs[key] = self._video_frames(feature, ep, frames["timestamp"][rows].astype(np.float64))
            else:
                obs[key] = frames[feature][rows].reshape(T, *self._spec(feature)["shape"])
        actions = frames[self.action_feature][rows].reshape(T, -1).astype(np.float32)
        rewards = frames[REWARD][rows].reshape(T).astype(np.float32) if REWARD in frames else np.zeros(T, np.float32)
        success = frames[SUCCESS][rows].reshape(T).astype(bool) if SUCCESS in frames else np.zeros(T, bool)
        task = int(frames["task_index"][lo]) if "task_index" in frames else -1
        m = self.episodes_meta[index]
        return Episode(obs, actions, rewards, success, self._tasks.get(task, m["instruction"]), m["seed"],
                       m["reset_state_id"])

    def __iter__(self) -> Iterator[Episode]:
        for i in range(len(self)):
            yield self.episode(i)

    def action_statistics(self) -> dict[str, list[float]]:
        """Per-dimension q01/q99/mean/std of the actions (OpenVLA's ``dataset_statistics`` for un-normalising)."""
        return _statistics(self._load_frames()[self.action_feature].reshape(-1, self.action_dim).astype(np.float64))

    def observation_statistics(self, key: str) -> dict[str, list[float]]:
        """The same statistics of an observation (``state``: OpenVLA-OFT's ``proprio`` statistics)."""
        if key not in self.keys:
            raise KeyError(f"the dataset {self.root} has no observation '{key}' (has: {sorted(self.keys)})")
        if self.features[self.keys[key]]["dtype"] in ("video", "image"):
            values = np.concatenate([ep.observations[key].reshape(ep.length, -1) for ep in self])
        else:
            values = self._load_frames()[self.keys[key]]
        return _statistics(values.reshape(len(values), -1).astype(np.float64))


def _statistics(values: np.ndarray) -> dict[str, list[float]]:
    """Per-column q01/q99/mean/std/min/max of [samples, dims]."""
    return {"q01": np.quantile(values, 0.01, axis=0).tolist(), "q99": np.quantile(values, 0.99, axis=0).tolist(),
            "mean": values.mean(0).tolist(), "std": values.std(0).tolist(), "min": values.min(0).tolist(),
            "max": values.max(0).tolist()}

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

import contextlib
import json
import math
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from rlfleet.untrusted import (
    BadFile,
    GiB,
    MiB,
    OutsideRoot,
    TooLarge,
    check_count,
    folder_root,
    in_folder,
    parse_json,
    read_json,
    regular_file,
)

CODEBASE_VERSION = "v3.0"
CHUNKS_SIZE = 1000  # files per chunk folder
DATA_FILE_MB = 100  # a data file rolls over past this size
VIDEO_FILE_MB = 200  # ... a video file past this one
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
# what a dataset's own files may claim, checked before anything is allocated for it
MAX_INFO_BYTES = 16 * MiB  # meta/info.json (lerobot's are a few KB)
MAX_PARQUET_BYTES = 4 * GiB  # one parquet file (lerobot rolls data files over at 100 MB)
MAX_PARQUET_ROWS = 1 << 26  # rows of one parquet file
MAX_TABLE_BYTES = 8 * GiB  # uncompressed bytes of one parquet file, as its footer states them
MAX_EPISODES = 10_000_000
MAX_FRAMES = 1 << 36
MAX_DIM = 1 << 16  # one dimension of a feature's shape
MAX_FEATURE_ELEMENTS = 1 << 26  # elements of one feature in one frame (a 4K RGB image is 25M)
MAX_DECODED_VIDEO_BYTES = 16 * GiB  # the frames decoded from one video file
MAX_IMAGE_BYTES = 256 * MiB  # one image file an image feature names
MAX_FPS = 10_000
NUMERIC_DTYPES = (
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
)
FEATURE_DTYPES = (*NUMERIC_DTYPES, "video", "image", "string")
DATA_FIELDS, VIDEO_FIELDS = ("chunk_index", "file_index"), ("video_key", "chunk_index", "file_index")


@dataclass
class Episode:
    observations: dict[str, np.ndarray]  # key -> [T, ...]
    actions: np.ndarray  # [T, action_dim]
    rewards: np.ndarray  # [T]
    success: np.ndarray  # [T] bool
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
    out = {
        "min": shape(flat.min(0)),
        "max": shape(flat.max(0)),
        "mean": shape(flat.mean(0)),
        "std": shape(flat.std(0)),
        "count": np.asarray([count]),
    }
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
    out = {
        "min": np.min([p["min"] for p in parts], 0),
        "max": np.max([p["max"] for p in parts], 0),
        "mean": mean,
        "std": np.sqrt(var),
        "count": np.asarray([int(n.sum())]),
    }
    for name in QUANTILES:
        out[name] = (w * np.stack([p[name] for p in parts])).sum(0)
    return out


def _jsonable(stats: dict[str, np.ndarray]) -> dict[str, list]:
    return {k: np.asarray(v).tolist() for k, v in stats.items()}


# ---------------------------------------------------------------------------------------------------------- video


@contextlib.contextmanager
def _keep_scheduling():
    """SVT-AV1 (``VIDEO_CODEC``), run as root, switches the thread that drives it to real-time scheduling (SCHED_FIFO,
    priority 99) and keeps it there after the encoder is gone: a process that wrote a dataset then outranks everything
    else on its cores, and any busy wait of its own starves the other processes (on 2 cores, the whole machine).
    This puts the calling thread's policy back as it was around each call into the encoder."""
    try:
        before = os.sched_getscheduler(0), os.sched_getparam(0)
    except (AttributeError, OSError):  # no POSIX scheduling here: nothing to keep
        yield
        return
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0)) != before:
            os.sched_setscheduler(0, *before)


class _VideoFile:
    """One mp4 file of one camera, episodes appended frame after frame (PyAV, ``VIDEO_CODEC``). Every call into the
    encoder runs under :func:`_keep_scheduling`."""

    def __init__(self, path: Path, fps: int, height: int, width: int, channels: int):
        with _keep_scheduling():
            self._open(path, fps, height, width, channels)

    def _open(self, path: Path, fps: int, height: int, width: int, channels: int) -> None:
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
        with _keep_scheduling():
            return self._add(frames)

    def _add(self, frames: np.ndarray) -> tuple[float, float]:
        import av

        start = self.frames
        for img in frames:
            frame = av.VideoFrame.from_ndarray(
                np.ascontiguousarray(img if self.format == "rgb24" else img[..., 0]), format=self.format
            )
            frame.pts, frame.time_base = self.frames, Fraction(1, self.fps)
            for packet in self.stream.encode(frame):
                self.bytes += packet.size
                self.container.mux(packet)
            self.frames += 1
        return start / self.fps, self.frames / self.fps

    def size_mb(self) -> float:
        """What the encoder has produced so far (it holds back its last few frames until the file closes)."""
        return self.bytes / 2**20

    def close(self) -> None:
        with _keep_scheduling():
            for packet in self.stream.encode(None):
                self.container.mux(packet)
            self.container.close()


def decode_video(
    path: Path,
    channels: int = 3,
    *,
    size: tuple[int, int] | None = None,
    until: float | None = None,
    max_frames: int | None = None,
    name: str | os.PathLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """All frames of an mp4 video file: (uint8 [N, H, W, C], their timestamps in seconds [N]). The file is read
    through a file object with the mp4 demuxer forced (no probing into playlists or other formats that open further
    files, no external data references). ``size`` (H, W): what every frame must measure (checked on the container's
    stream before anything is decoded, and on each frame); ``until``: decoding stops past this time (plus a second);
    ``max_frames``: more frames than this is :class:`TooLarge`. ``name``: how messages call the file."""
    import av

    name = name or path
    fmt = "rgb24" if channels == 3 else "gray"
    frames, times = [], []
    with open(path, "rb") as f:
        try:
            container = av.open(f, format="mp4", options={"enable_drefs": "0", "use_absolute_path": "0"})
        except (av.FFmpegError, ValueError, OSError) as exc:
            raise BadFile(name, "video", "an mp4 video file", f"{type(exc).__name__}: {str(exc)[:120]}") from None
        with container:
            if not container.streams.video:
                raise BadFile(name, "video stream", "one", "none")
            stream = container.streams.video[0]
            got = (stream.codec_context.height, stream.codec_context.width)
            if size is not None and got != tuple(size):
                raise BadFile(
                    name, "frame size", f"{size[0]} x {size[1]} (meta/info.json features)", f"{got[0]} x {got[1]}"
                )
            try:
                for frame in container.decode(stream):
                    if size is not None and (frame.height, frame.width) != tuple(size):
                        raise BadFile(
                            name,
                            f"frame {len(frames)}",
                            f"{size[0]} x {size[1]} pixels",
                            f"{frame.height} x {frame.width}",
                        )
                    if max_frames is not None and len(frames) >= max_frames:
                        raise TooLarge(name, "frames", f"at most {max_frames:,} (what its episodes span)", "more")
                    t = float(frame.pts * stream.time_base) if frame.pts is not None else float(frame.time or 0.0)
                    if until is not None and t > until + 1.0:
                        break
                    img = frame.to_ndarray(format=fmt)
                    frames.append(img if channels == 3 else img[..., None])
                    times.append(t)
            except av.FFmpegError as exc:
                raise BadFile(
                    name, f"frame {len(frames)}", "a decodable frame", f"{type(exc).__name__}: {str(exc)[:120]}"
                ) from None
    if not frames:
        raise BadFile(name, "frames", "at least one decodable frame", "none")
    order = np.argsort(times, kind="stable")
    return np.stack(frames)[order], np.asarray(times)[order]


# --------------------------------------------------------------------------------------------------------- writer


class DatasetWriter:
    """Appends episodes to a new LeRobot v3.0 dataset folder; ``close()`` writes the episode index, tasks, stats and
    finally ``meta/info.json`` (present = complete)."""

    def __init__(
        self,
        root: str | Path,
        *,
        env_id: str,
        simulator: str,
        fps: int,
        source: str,
        overwrite: bool = False,
        robot_type: str | None = None,
    ):
        import pyarrow  # noqa: F401 - fail here, before any episode is recorded, when it is missing

        self.root = Path(root)
        if (self.root / "meta" / "info.json").exists() and not overwrite:
            raise FileExistsError(f"{self.root} already holds a dataset (pass overwrite to replace it)")
        if int(fps) != fps or fps < 1:
            raise ValueError(f"fps must be a whole number >= 1 (LeRobot's fps), got {fps}")
        self._check_target()
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

    def _check_target(self) -> None:
        """The folder to write into (``coordinatorctl collect-demos``' output, ``sft.dataset_path``): a folder (or
        none yet) whose meta/, data/ and videos/ are real folders of an earlier dataset (never links, which the
        writer would follow out of it), and no data/ or videos/ without meta/ (someone else's, not to be removed)."""
        if os.path.lexists(self.root) and not self.root.is_dir():
            raise BadFile(self.root, "dataset folder", "a folder (or none yet)", "a file")
        for sub in ("meta", "data", "videos"):
            p = self.root / sub
            if os.path.islink(p) or (os.path.lexists(p) and not p.is_dir()):
                raise OutsideRoot(
                    p,
                    "dataset folder",
                    f"a real folder {sub}/ of the dataset (or none)",
                    f"a link to {os.readlink(p)}" if os.path.islink(p) else "a file",
                )
        if not (self.root / "meta").is_dir() and any((self.root / s).exists() for s in ("data", "videos")):
            raise BadFile(
                self.root,
                "dataset folder",
                "an empty folder or an earlier dataset (meta/) to write into",
                "data/ or videos/ of something else",
            )

    @property
    def meta(self) -> dict:
        return {
            "env_id": self.rlfleet["env_id"],
            "simulator": self.rlfleet["simulator"],
            "fps": self.fps,
            "total_episodes": self.total_episodes,
            "total_frames": self.total_frames,
        }

    def _spec(self, ep: Episode, index: int) -> tuple[dict[str, np.ndarray], dict[str, dict], dict[str, str]]:
        """The episode's features (name -> [T, ...]), their info.json entries, and its observation -> feature map."""
        arrays: dict[str, np.ndarray] = {}
        names: dict[str, str] = {}
        for k, v in ep.observations.items():
            v = np.asarray(v)
            names[k] = feature_name(k, v)
            arrays[names[k]] = v
        arrays.update(
            {
                "action": np.asarray(ep.actions, np.float32),
                REWARD: np.asarray(ep.rewards, np.float32),
                SUCCESS: np.asarray(ep.success, bool),
            }
        )
        spec = {}
        for name, arr in arrays.items():
            if arr.shape[0] != ep.length:
                raise ValueError(f"episode {index}: '{name}' has {arr.shape[0]} steps, the actions {ep.length}")
            if name.startswith(IMAGE_PREFIX):
                H, W, C = arr.shape[1:]
                if C not in (1, 3):
                    raise ValueError(f"episode {index}: '{name}' has {C} channels; videos hold 1 or 3")
                spec[name] = {
                    "dtype": "video",
                    "shape": [H, W, C],
                    "names": ["height", "width", "channels"],
                    "info": {
                        "video.height": H,
                        "video.width": W,
                        "video.codec": VIDEO_CODEC_NAME,
                        "video.pix_fmt": PIX_FMT,
                        "video.is_depth_map": False,
                        "video.fps": self.fps,
                        "video.channels": C,
                        "has_audio": False,
                    },
                }
            else:
                spec[name] = {
                    "dtype": str(arr.dtype),
                    "shape": [int(np.prod(arr.shape[1:], dtype=int))] or [1],
                    "names": None,
                }
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
            self.features = {
                **spec,
                "timestamp": {"dtype": "float32", "shape": [1], "names": None},
                **{c: {"dtype": "int64", "shape": [1], "names": None} for c in FRAME_COLUMNS[1:]},
            }
            self.rlfleet["observations"] = names
        T = ep.length
        task = self._tasks.setdefault(ep.instruction, len(self._tasks))
        frame = np.arange(T)
        columns = {
            "timestamp": (frame / self.fps).astype(np.float32),
            "frame_index": frame,
            "episode_index": np.full(T, index),
            "index": self.total_frames + frame,
            "task_index": np.full(T, task),
        }
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
            table[name] = (
                pa.array(flat[:, 0])
                if spec[name]["shape"] == [1] and arr.ndim <= 2
                else pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
            )
        table.update({k: pa.array(v) for k, v in columns.items()})
        table = pa.table(table)
        if self._data_writer is None:
            path = self.root / DATA_PATH.format(**_chunk_file(self._data_file))
            path.parent.mkdir(parents=True, exist_ok=True)
            self._data_writer = pq.ParquetWriter(str(path), table.schema)
            self._data_path = path
        self._data_writer.write_table(table)
        row.update(
            {
                "data/chunk_index": _chunk_file(self._data_file)["chunk_index"],
                "data/file_index": _chunk_file(self._data_file)["file_index"],
                "dataset_from_index": self.total_frames,
                "dataset_to_index": self.total_frames + T,
            }
        )
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
                    self.root / VIDEO_PATH.format(video_key=name, **_chunk_file(n)), self.fps, H, W, C
                )
            start, end = video.add(arr)
            ids = _chunk_file(self._video_file[name])
            row.update(
                {
                    f"videos/{name}/chunk_index": ids["chunk_index"],
                    f"videos/{name}/file_index": ids["file_index"],
                    f"videos/{name}/from_timestamp": start,
                    f"videos/{name}/to_timestamp": end,
                }
            )
        for name, arr in {**arrays, **columns}.items():
            stats[name] = _stats(arr, image=name.startswith(IMAGE_PREFIX))
            self._stats.setdefault(name, []).append(stats[name])
        for name, st in stats.items():
            for stat, value in st.items():
                row[f"stats/{name}/{stat}"] = value.tolist()
        row.update(
            {
                "meta/episodes/chunk_index": 0,
                "meta/episodes/file_index": 0,
                "rlfleet/seed": int(ep.seed),
                "rlfleet/reset_state_id": int(ep.reset_state_id),
                "rlfleet/success": bool(np.any(ep.success)),
            }
        )
        self._episodes.append(row)
        self.total_episodes += 1
        self.total_frames += T
        return index

    def _data_writer_mb(self) -> float:
        return self._data_path.stat().st_size / 2**20 if self._data_path.exists() else 0.0

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
        info = {
            "codebase_version": CODEBASE_VERSION,
            "robot_type": self.robot_type,
            "total_episodes": self.total_episodes,
            "total_frames": self.total_frames,
            "total_tasks": len(self._tasks),
            "chunks_size": CHUNKS_SIZE,
            "data_files_size_in_mb": DATA_FILE_MB,
            "video_files_size_in_mb": VIDEO_FILE_MB,
            "fps": self.fps,
            "splits": {"train": f"0:{self.total_episodes}"},
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if has_video else None,
            "features": {
                k: {kk: vv for kk, vv in v.items() if kk != "rlfleet_shape"} for k, v in self.features.items()
            },
            "rlfleet": {
                **self.rlfleet,
                "shapes": {k: v["rlfleet_shape"] for k, v in self.features.items() if "rlfleet_shape" in v},
            },
        }
        (self.root / "meta" / "info.json").write_text(json.dumps(info, indent=4))


def _write_tasks(path: Path, tasks: dict[str, int]) -> None:
    """meta/tasks.parquet as lerobot writes it with pandas: the instructions as the (unnamed) index, task_index as
    the column; the "pandas" schema metadata restores the index when pandas reads it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = sorted(tasks, key=tasks.get)
    pandas_meta = {
        "index_columns": ["__index_level_0__"],
        "column_indexes": [
            {
                "name": None,
                "field_name": None,
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": {"encoding": "UTF-8"},
            }
        ],
        "columns": [
            {
                "name": "task_index",
                "field_name": "task_index",
                "pandas_type": "int64",
                "numpy_type": "int64",
                "metadata": None,
            },
            {
                "name": None,
                "field_name": "__index_level_0__",
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": None,
            },
        ],
        "attributes": {},
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.3",
    }
    table = pa.table(
        {
            "task_index": pa.array([tasks[n] for n in names], pa.int64()),
            "__index_level_0__": pa.array(names, pa.string()),
        }
    )
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)}), str(path))


# --------------------------------------------------------------------------------------------------------- reader
# Every file a dataset names is read as hostile until checked (rlfleet.untrusted): it stays inside the dataset
# (a path a template of meta/info.json formats, a file an image feature names, a link: in_folder), JSON is bounded,
# info.json's fields have their types and bounded shapes, a parquet file's footer (rows, row groups, uncompressed
# size) is checked before a table is read, each column has the width its feature declares, and a video's frames
# have the size the feature declares and no more of them are decoded than its episodes span. A bad file is one
# BadFile line naming the file, the field and what was expected.


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _template(info: dict, key: str, fields: tuple[str, ...], source: Path) -> str | None:
    """info.json's path template ``key``: a string whose only fields are ``fields`` (no attribute or index access,
    no conversion, a format spec no wider than 2 digits); None when absent."""
    import re
    import string

    value = info.get(key)
    if value is None:
        return None
    expected = f"a path template whose fields are {', '.join('{' + f + '}' for f in fields)}"
    if not isinstance(value, str) or not value or len(value) > 1024:
        raise BadFile(source, key, expected, _short(value))
    try:
        parts = list(string.Formatter().parse(value))
    except ValueError as exc:
        raise BadFile(source, key, expected, f"{_short(value)} ({exc})") from None
    for _, field, spec, conversion in parts:
        if field is None:
            continue
        if field not in fields or conversion is not None or not re.fullmatch(r"0?\d{0,2}d?", spec or ""):
            raise BadFile(
                source,
                key,
                expected,
                f"the field {{{field}{'!' + conversion if conversion else ''}"
                f"{':' + spec if spec else ''}}} in {_short(value)}",
            )
    return value


def _check_info(info: dict, source: Path) -> None:
    """meta/info.json's fields rlfleet reads, with their types, and every shape bounded."""
    fps = info.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= MAX_FPS:
        raise BadFile(source, "fps", f"a number of frames per second in (0, {MAX_FPS}]", _short(fps))
    for key, limit in (
        ("total_episodes", MAX_EPISODES),
        ("total_frames", MAX_FRAMES),
        ("total_tasks", MAX_EPISODES),
        ("chunks_size", MAX_EPISODES),
    ):
        if info.get(key) is not None:
            check_count(key, info[key], limit, source=source, minimum=1 if key == "chunks_size" else 0)
    features = info.get("features")
    if not isinstance(features, dict) or not features:
        raise BadFile(source, "features", "a JSON object of features (name -> dtype, shape)", _short(features))
    check_count("features", len(features), 100_000, source=source)
    for name, ft in features.items():
        field = f"features['{name[:60]}']"
        if not isinstance(ft, dict):
            raise BadFile(source, field, "a JSON object with dtype and shape", _short(ft))
        if ft.get("dtype") not in FEATURE_DTYPES:
            raise BadFile(source, f"{field}.dtype", f"one of {', '.join(FEATURE_DTYPES)}", _short(ft.get("dtype")))
        shape = ft.get("shape")
        if not isinstance(shape, list) or not 0 < len(shape) <= 8:
            raise BadFile(source, f"{field}.shape", "a list of 1 to 8 sizes", _short(shape))
        n = 1
        for d in shape:
            n *= check_count(f"{field}.shape", d, MAX_DIM, source=source, minimum=1)
        check_count(f"{field}.shape (elements per frame)", n, MAX_FEATURE_ELEMENTS, source=source)
        names = ft.get("names")
        if names is not None and not isinstance(names, (list, dict)):
            raise BadFile(source, f"{field}.names", "a list, a JSON object or null", _short(names))
        if ft["dtype"] in ("video", "image"):
            if len(shape) != 3 or _hwc(ft)[2] not in (1, 3):
                raise BadFile(source, f"{field}.shape", "[height, width, channels] with 1 or 3 channels", _short(shape))
    _template(info, "data_path", DATA_FIELDS, source)
    _template(info, "video_path", VIDEO_FIELDS, source)
    own = info.get("rlfleet")
    if own is None:
        return
    if not isinstance(own, dict):
        raise BadFile(source, "rlfleet", "a JSON object", _short(own))
    for key in ("env_id", "simulator", "source"):
        if own.get(key) is not None and not isinstance(own[key], str):
            raise BadFile(source, f"rlfleet.{key}", "a string", _short(own[key]))
    obs = own.get("observations") or {}
    if not isinstance(obs, dict) or not all(isinstance(k, str) and v in features for k, v in obs.items()):
        raise BadFile(
            source, "rlfleet.observations", "a map of observation names to features of this dataset", _short(obs)
        )
    shapes = own.get("shapes") or {}
    if not isinstance(shapes, dict):
        raise BadFile(source, "rlfleet.shapes", "a map of features to shapes", _short(shapes))
    for feature, shape in shapes.items():
        field = f"rlfleet.shapes['{str(feature)[:60]}']"
        if feature not in features or not isinstance(shape, list) or not shape:
            raise BadFile(source, field, "the shape of a feature of this dataset", _short(shape))
        n = 1
        for d in shape:
            n *= check_count(field, d, MAX_DIM, source=source, minimum=1)
        want = int(np.prod(features[feature]["shape"]))
        if n != want:
            raise BadFile(source, field, f"{want} elements (features['{feature}'].shape)", f"{shape} ({n})")


def _read_tasks(path: Path, table) -> dict[int, str]:
    """task_index -> instruction of meta/tasks.parquet (the pandas index lerobot writes, or a "task" column)."""
    meta = parse_json((table.schema.metadata or {}).get(b"pandas", b"{}"), path, what="pandas metadata")
    names = [c for c in meta.get("index_columns", []) if isinstance(c, str) and c in table.column_names]
    column = names[0] if names else ("task" if "task" in table.column_names else None)
    if column is None or "task_index" not in table.column_names:
        raise BadFile(
            path, "columns", "a task_index column and the tasks as index or 'task'", ", ".join(table.column_names)[:120]
        )
    index, tasks = table.column("task_index").to_pylist(), table.column(column).to_pylist()
    if not all(isinstance(i, int) for i in index) or not all(isinstance(t, str) for t in tasks):
        raise BadFile(path, f"columns 'task_index', '{column}'", "integers and strings")
    return dict(zip(index, tasks))


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
            out[name[len(IMAGE_PREFIX) :]] = name
        elif (
            name.startswith("observation.")
            and not name.startswith(IMAGE_PREFIX)
            and ft.get("dtype") not in ("video", "image", "string")
        ):
            out[name[len("observation.") :]] = name
    out["action"] = "action"
    return out


def _hwc(ft: dict) -> list[int]:
    """[H, W, C] of an image/video feature (lerobot's shapes are H, W, C, or C, H, W where names say so)."""
    shape = [int(s) for s in ft["shape"]]
    names = [str(n).lower() for n in (ft.get("names") or [])] if isinstance(ft.get("names"), list) else []
    if len(shape) == 3 and names and names[0] in ("channel", "channels", "c"):
        return [shape[1], shape[2], shape[0]]
    return shape


def _number(
    row: dict, key: str, source, *, integer: bool = True, minimum: float = 0, limit: float = MAX_FRAMES, default=None
):
    """An episode row's ``key``: an int (or a finite float) in [minimum, limit]."""
    value = row.get(key, default)
    if integer:
        return check_count(key, value, int(limit), source=source, minimum=int(minimum))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not minimum <= value <= limit:
        raise BadFile(source, key, f"a number in [{minimum}, {limit}]", _short(value))
    return float(value)


class Dataset:
    """A LeRobot v3.0 dataset folder (written by :class:`DatasetWriter`, or by ``lerobot``) read as rlfleet
    episodes. ``keys``: policy input name -> dataset feature (``action`` -> the action feature); the observations
    of :func:`default_keys` where it maps none. ``name``: what the dataset is called where it has no env id of rlfleet's (a hub id).
    Every file is read as hostile until checked (the section's comment above)."""

    def __init__(self, root: str | Path, keys: Mapping[str, str] | None = None, name: str | None = None):
        self.root = Path(root)
        info_path = self.root / "meta" / "info.json"
        old = (self.root / "meta" / "episodes.jsonl").exists() or any(self.root.glob("data/chunk-*/episode_*.npz"))
        if not os.path.lexists(info_path):
            if old:
                raise ValueError(
                    f"{self.root}: an npz demonstration folder of an older rlfleet, which no longer "
                    f"reads it (datasets are LeRobot v3.0 now); {RECOLLECT}"
                )
            raise FileNotFoundError(
                f"{self.root}: no meta/info.json - not a (complete) LeRobot dataset; "
                f"collect one with `coordinatorctl collect-demos CONFIG`"
            )
        info = read_json(info_path, max_bytes=MAX_INFO_BYTES, root=folder_root(self.root), what="meta/info.json")
        if info.get("format") == "rlfleet-episodes" or (old and "codebase_version" not in info):
            raise ValueError(
                f"{info_path}: an npz demonstration folder of an older rlfleet, which no longer reads "
                f"it (datasets are LeRobot v3.0 now); {RECOLLECT}"
            )
        version = info.get("codebase_version")
        if version != CODEBASE_VERSION:
            raise ValueError(
                f"{info_path}: codebase_version {_short(version)}; rlfleet reads LeRobot datasets of "
                f"{CODEBASE_VERSION} (convert older ones with lerobot's "
                f"`python -m lerobot.datasets.v30.convert_dataset_v21_to_v30`)"
            )
        _check_info(info, info_path)
        self.info, self.info_path = info, info_path
        self.features: dict[str, dict] = info["features"]
        own = info.get("rlfleet") or {}
        keys = dict(keys or {})
        self.action_feature = keys.pop("action", "action")
        self.keys = keys or {k: v for k, v in default_keys(info).items() if k != "action"}  # only the action mapped
        for key, feature in [*keys.items(), ("action", self.action_feature)]:
            if feature not in self.features:
                raise ValueError(
                    f"{self.root}: '{key}' is mapped to the feature '{feature}' (sft.dataset_keys), "
                    f"which the dataset does not have; its features: {', '.join(sorted(self.features))}"
                )
            if self.features[feature].get("dtype") == "string":
                raise ValueError(f"{self.root}: '{key}' is mapped to '{feature}', a string feature")
        if self.features[self.action_feature]["dtype"] not in NUMERIC_DTYPES:
            raise BadFile(
                info_path,
                f"features['{self.action_feature}'].dtype",
                "a numeric dtype for the actions",
                self.features[self.action_feature]["dtype"],
            )
        self.meta = {
            "env_id": own.get("env_id") or name or self.root.name,
            "simulator": own.get("simulator"),
            "source": own.get("source"),
            "fps": info.get("fps"),
            "total_episodes": info.get("total_episodes"),
            "total_frames": info.get("total_frames"),
            "codebase_version": version,
            "features": self.features,
        }
        self._shapes = own.get("shapes") or {}
        tasks_path = self.root / "meta" / "tasks.parquet"
        self._tasks = _read_tasks(tasks_path, self._parquet("meta/tasks.parquet"))
        self._episodes = self._read_episodes()
        self.episodes_meta = []
        for r in self._episodes:
            src = r["_source"]
            tasks = r.get("tasks") or [""]
            if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
                raise BadFile(src, f"episode {r['episode_index']}: tasks", "a list of strings", _short(tasks))
            self.episodes_meta.append(
                {
                    "episode_index": r["episode_index"],
                    "length": r["length"],
                    "instruction": tasks[0],
                    "success": bool(r.get("rlfleet/success", False)),
                    "seed": _number(r, "rlfleet/seed", src, minimum=-1, limit=1 << 63, default=-1),
                    "reset_state_id": _number(r, "rlfleet/reset_state_id", src, minimum=-1, limit=1 << 63, default=-1),
                }
            )
        self._frames: dict[str, np.ndarray] | None = None
        self._videos: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}

    # ------------------------------------------------------------------------------------------- files

    def _file(self, rel: str, what: str) -> Path:
        """``rel`` (a path the dataset's metadata formats, or one found in it) resolved inside the dataset."""
        return in_folder(
            self.root, rel, what=what, source=self.info_path if what.endswith("_path") else self.root / rel
        )

    def _parquet(self, rel: str, columns=None):
        """A parquet file of the dataset as a pyarrow table (``columns``: a predicate on the column names), its
        footer checked first: a parquet file, at most MAX_PARQUET_ROWS rows and MAX_TABLE_BYTES uncompressed."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.root / rel
        resolved = regular_file(self._file(rel, "parquet file"), what="parquet file", max_bytes=MAX_PARQUET_BYTES)
        try:
            pf = pq.ParquetFile(resolved)
            md = pf.metadata
        except (pa.ArrowException, OSError) as exc:
            raise BadFile(path, "parquet footer", "a parquet file", f"{type(exc).__name__}: {str(exc)[:120]}") from None
        check_count("num_rows (parquet footer)", md.num_rows, MAX_PARQUET_ROWS, source=path)
        check_count("row groups (parquet footer)", md.num_row_groups, 1 << 20, source=path)
        check_count("columns (parquet footer)", md.num_columns, 100_000, source=path)
        size = sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
        check_count("uncompressed bytes (parquet footer)", size, MAX_TABLE_BYTES, source=path)
        names = pf.schema_arrow.names
        wanted = [c for c in names if columns is None or columns(c)]
        try:
            table = pf.read(columns=wanted)
        except (pa.ArrowException, OSError) as exc:
            raise BadFile(
                path,
                "data",
                "a readable parquet file (the footer's row groups and pages)",
                f"{type(exc).__name__}: {str(exc)[:120]}",
            ) from None
        if table.num_rows != md.num_rows:
            raise BadFile(path, "rows", f"{md.num_rows} (parquet footer)", f"{table.num_rows}")
        return table

    # ------------------------------------------------------------------------------------------- metadata

    def _read_episodes(self) -> list[dict]:
        paths = sorted((self.root / "meta" / "episodes").glob("*/*.parquet"))
        if not paths:
            raise FileNotFoundError(
                f"{self.root}: no meta/episodes/chunk-*/file-*.parquet - not a complete LeRobot v3.0 dataset"
            )
        rows = []
        for path in paths:
            rel = str(path.relative_to(self.root))
            for r in self._parquet(rel, lambda c: not c.startswith("stats/")).to_pylist():
                r["_source"] = path
                rows.append(r)
                check_count("episodes", len(rows), MAX_EPISODES, source=path)
        for r in rows:
            src = r["_source"]
            r["episode_index"] = _number(r, "episode_index", src, limit=MAX_EPISODES)
            r["length"] = _number(r, "length", src, minimum=1)
            lo = _number(r, "dataset_from_index", src)
            if _number(r, "dataset_to_index", src) != lo + r["length"]:
                raise BadFile(
                    src,
                    f"episode {r['episode_index']}: dataset_to_index",
                    f"dataset_from_index + length = {lo + r['length']}",
                    str(r["dataset_to_index"]),
                )
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

    def _data_files(self) -> list[str]:
        """The data files, relative to the dataset: ``data_path`` formatted with the episodes' data/chunk_index and
        data/file_index (lerobot's way), else every data/*/*.parquet."""
        template = self.info.get("data_path")
        if template and all("data/chunk_index" in r and "data/file_index" in r for r in self._episodes):
            ids = sorted(
                {
                    (
                        _number(r, "data/chunk_index", r["_source"], limit=MAX_EPISODES),
                        _number(r, "data/file_index", r["_source"], limit=MAX_EPISODES),
                    )
                    for r in self._episodes
                }
            )
            return [template.format(chunk_index=c, file_index=f) for c, f in ids]
        return [str(p.relative_to(self.root)) for p in sorted((self.root / "data").glob("*/*.parquet"))]

    def _load_frames(self) -> dict[str, np.ndarray]:
        """Every frame's columns this reader needs (sorted by global index), from all data files, each column
        checked against its feature (numbers, as many per row as its shape holds)."""
        if self._frames is not None:
            return self._frames
        files = self._data_files()
        if not files:
            raise FileNotFoundError(f"{self.root}: no data/chunk-*/file-*.parquet")
        wanted = {
            "index",
            "episode_index",
            "frame_index",
            "timestamp",
            "task_index",
            self.action_feature,
            REWARD,
            SUCCESS,
            *(f for f in self.keys.values() if self.features[f]["dtype"] != "video"),
        }
        parts: dict[str, list[np.ndarray]] = {}
        for rel in files:
            self._file(rel, "data_path")
            table = self._parquet(rel, lambda c: c in wanted)
            for required in ("index", "timestamp"):
                if required not in table.column_names:
                    raise BadFile(
                        self.root / rel, f"column '{required}'", "present (every LeRobot frame has it)", "missing"
                    )
            for name in table.column_names:
                parts.setdefault(name, []).append(self._column(name, table.column(name).combine_chunks(), rel))
        out = {}
        for name, arrays in parts.items():
            if len(arrays) != len(files):
                raise BadFile(
                    self.root / "data", f"column '{name}'", "in every data file", f"in {len(arrays)} of {len(files)}"
                )
            out[name] = np.concatenate(arrays)
        order = np.argsort(out["index"], kind="stable")
        self._frames = {k: v[order] for k, v in out.items()}
        return self._frames

    def _column(self, name: str, col, rel: str) -> np.ndarray:
        """One column of a data file as numpy [rows, ...], checked against its feature in meta/info.json."""
        import pyarrow as pa

        path = self.root / rel
        ft = self.features.get(name, {})
        if ft.get("dtype") == "image":  # PNG/JPEG bytes in a {bytes, path} struct, as lerobot stores images
            return self._images(name, col, path)
        width = int(np.prod(ft["shape"])) if ft else 1
        kind = "numbers"
        if pa.types.is_fixed_size_list(col.type) or pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            import pyarrow.compute as pc

            n = len(col)
            lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
            values = col.flatten()
            while (
                pa.types.is_fixed_size_list(values.type)
                or pa.types.is_list(values.type)
                or pa.types.is_large_list(values.type)
            ):
                values = values.flatten()
            per_row = len(values) // n if n else width
            bad = np.flatnonzero(lengths != lengths[0]) if n else []
            if len(bad) or per_row != width or (n and len(values) != n * width):
                found = per_row if not len(bad) else f"{lengths[bad[0]]} in row {bad[0]}"
                raise BadFile(path, f"column '{name}'", f"{width} {kind} per row (meta/info.json features)", str(found))
        else:
            values, n = col, None
            if width != 1:
                raise BadFile(
                    path,
                    f"column '{name}'",
                    f"{width} {kind} per row (meta/info.json features)",
                    f"one {col.type} per row",
                )
        if not (
            pa.types.is_integer(values.type) or pa.types.is_floating(values.type) or pa.types.is_boolean(values.type)
        ):
            raise BadFile(path, f"column '{name}'", f"{kind} (meta/info.json features)", str(values.type))
        if values.null_count:
            raise BadFile(path, f"column '{name}'", "no missing values", f"{values.null_count} nulls")
        arr = values.to_numpy(zero_copy_only=False)
        if n is None:
            return arr
        return arr.reshape(n, -1) if n else arr.reshape(0, width)

    def _images(self, name: str, col, path: Path) -> np.ndarray:
        """An image feature's column (PNG/JPEG bytes, or a file of the dataset): each image's size checked against
        the feature's shape before it is decoded."""
        import io

        from PIL import Image

        H, W, C = _hwc(self.features[name])
        mode = "RGB" if C == 3 else "L"
        imgs = []
        for row, item in enumerate(col.to_pylist()):
            where = f"column '{name}' row {row}"
            if not isinstance(item, dict) or not (item.get("bytes") or item.get("path")):
                raise BadFile(path, where, "an image ({bytes, path})", _short(item))
            if item.get("bytes"):
                data = item["bytes"]
            else:
                if not isinstance(item["path"], str):
                    raise BadFile(path, f"{where} path", "a file of the dataset", _short(item["path"]))
                image_file = in_folder(self.root, item["path"], what=f"{where} path", source=path)
                data = regular_file(image_file, what=f"{where} path", max_bytes=MAX_IMAGE_BYTES).read_bytes()
            try:
                img = Image.open(io.BytesIO(data), formats=("PNG", "JPEG", "WEBP"))
                if img.size != (W, H):
                    raise BadFile(
                        path, where, f"a {W} x {H} image (meta/info.json features)", f"{img.size[0]} x {img.size[1]}"
                    )
                arr = np.asarray(img.convert(mode))
            except BadFile:
                raise
            except Exception as exc:  # noqa: BLE001 - not an image, truncated, a decompression bomb
                raise BadFile(path, where, "a PNG or JPEG image", f"{type(exc).__name__}: {str(exc)[:100]}") from None
            imgs.append(arr if C == 3 else arr[..., None])
        return np.stack(imgs) if imgs else np.zeros((0, H, W, C), np.uint8)

    def _video_frames(self, feature: str, ep: dict, timestamps: np.ndarray) -> np.ndarray:
        """The frames of one episode in one camera's video: those nearest its frames' timestamps."""
        src = ep["_source"]
        ids = {
            "chunk_index": _number(ep, f"videos/{feature}/chunk_index", src, limit=MAX_EPISODES),
            "file_index": _number(ep, f"videos/{feature}/file_index", src, limit=MAX_EPISODES),
        }
        template = self.info.get("video_path") or VIDEO_PATH
        rel = template.format(video_key=feature, **ids)
        path = self._file(rel, "video_path")  # inside the dataset, links followed: else OutsideRoot, never opened
        key = (feature, str(path))
        fps = float(self.info["fps"])
        if key not in self._videos:
            if not path.is_file():
                raise FileNotFoundError(
                    f"{self.root}: episode {ep['episode_index']}'s video {self.root / rel} is missing"
                )
            # the episodes in this file say how far into it they reach: no more frames than that are decoded
            until = max(
                _number(e, f"videos/{feature}/to_timestamp", e["_source"], integer=False, limit=1e9)
                for e in self._episodes
                if e.get(f"videos/{feature}/chunk_index") == ids["chunk_index"]
                and e.get(f"videos/{feature}/file_index") == ids["file_index"]
            )
            H, W, C = _hwc(self.features[feature])
            max_frames = int(math.ceil((until + 1.0) * fps)) + 16
            check_count(
                f"decoded frames of {rel} (bytes)",
                max_frames * H * W * C,
                MAX_DECODED_VIDEO_BYTES,
                source=self.root / rel,
            )
            self._videos[key] = decode_video(
                path, C, size=(H, W), until=until, max_frames=max_frames, name=self.root / rel
            )
        frames, times = self._videos[key]
        start = _number(ep, f"videos/{feature}/from_timestamp", src, integer=False, limit=1e9)
        want = start + timestamps
        pos = np.clip(np.searchsorted(times, want), 1, len(times) - 1) if len(times) > 1 else np.zeros(len(want), int)
        if len(times) > 1:
            pos = np.where(np.abs(times[pos - 1] - want) <= np.abs(times[pos] - want), pos - 1, pos)
        off = np.abs(times[pos] - want).max() if len(want) else 0.0
        if off > 0.5 / fps:
            raise ValueError(
                f"{self.root / rel}: no frame within half a frame of "
                f"{want[np.argmax(np.abs(times[pos] - want))]:.4f} s (episode {ep['episode_index']}; "
                f"the video's frames end at {times[-1]:.4f} s)"
            )
        return frames[pos]

    def episode(self, index: int) -> Episode:
        ep = self._episodes[index]
        frames = self._load_frames()
        lo, hi = np.searchsorted(frames["index"], [int(ep["dataset_from_index"]), int(ep["dataset_to_index"])])
        rows = slice(int(lo), int(hi))
        T = hi - lo
        if T != int(ep["length"]):
            raise BadFile(
                ep["_source"],
                f"episode {ep['episode_index']}: length",
                f"the {T} frames data/ holds for its index range",
                str(ep["length"]),
            )
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
        return Episode(
            obs, actions, rewards, success, self._tasks.get(task, m["instruction"]), m["seed"], m["reset_state_id"]
        )

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
    return {
        "q01": np.quantile(values, 0.01, axis=0).tolist(),
        "q99": np.quantile(values, 0.99, axis=0).tolist(),
        "mean": values.mean(0).tolist(),
        "std": values.std(0).tolist(),
        "min": values.min(0).tolist(),
        "max": values.max(0).tolist(),
    }

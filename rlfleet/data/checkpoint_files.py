"""Reading a learner checkpoint (``RUN/checkpoints/global_step_N/``) that may come from anywhere: nothing a file
supplies is run, nothing outside the run folder is read, and a bad file is named in one line before any tensor
is loaded.

A checkpoint holds (services/learner/checkpoint.py writes it):

- ``state/.metadata``: ``torch.distributed.checkpoint`` (DCP) metadata, a pickle. :func:`read_metadata` reads it
  with a restricted unpickler that admits exactly the plain classes DCP's metadata is made of
  (:data:`METADATA_GLOBALS`); any other global a file asks for is refused by name and nothing is called. What it
  got is then checked: a ``Metadata`` whose every tensor entry has its chunks inside its shape, whose every chunk
  and byte item is stored (``storage_data``) in a plain file name of ``state/`` (no ``/``, no ``..``, no symbolic
  link out), at non-negative offsets and lengths that lie inside that file (a truncated shard is named here, in
  seconds), with no stream transforms.
- ``state/__R_0.distcp``: each rank's shards. Tensors are read by DCP with ``torch.load(weights_only=True)``;
  the few non-tensor items (the optimizer's hyper-parameters: ``optim.param_groups.*``) are read by
  :class:`CheckedLoadPlanner` with ``weights_only=True`` as well (DCP's own planner unpickles them freely) and
  must be plain values (numbers, strings, booleans, None, lists and tuples of them).
- ``reward_rms.safetensors``: its header checked (:func:`rlfleet.untrusted.safetensors_header`) for the reward
  normaliser's names and shapes.
- ``learner_state.json``: bounded JSON, every field checked for its type and range (:func:`read_learner_state`).

:func:`verify_checkpoint` checks all of it without loading a tensor; :func:`load_state` is the one way rlfleet
loads ``state/`` (DCP with :class:`CheckedReader` and :class:`CheckedLoadPlanner`, a failure of any rank raised
as one :class:`~rlfleet.untrusted.BadFile`). :func:`latest_checkpoint` and :func:`complete_checkpoints` are the
one place a run folder's checkpoints are found.
"""

from __future__ import annotations

import io
import math
import os
import pathlib
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from rlfleet.untrusted import (MiB, BadFile, OutsideRoot, TooLarge, check_count, inside, read_json, regular_file,
                               safetensors_header)

STATE_DIR = "state"
METADATA_FILE = ".metadata"
LEARNER_STATE = "learner_state.json"
REWARD_RMS = "reward_rms.safetensors"
STEP_PREFIX = "global_step_"

MAX_METADATA_BYTES = 256 * MiB   # a 7B policy with its Adam state over 64 ranks writes ~20 MB
MAX_LEARNER_STATE_BYTES = 16 * MiB
MAX_ENTRIES = 1 << 24            # state dict entries, stored items, chunks of one tensor
MAX_BYTES_ITEM = 1 * MiB         # one non-tensor item (an optimizer hyper-parameter: a few hundred bytes)
MAX_TENSOR_DIMS = 16
MAX_SPACE_ELEMENTS = 1 << 31
MAX_OBS_ENTRIES = 256
MAX_ACTION_DIM = 1 << 16
MAX_ENVS = 1 << 24
MAX_WORKERS = 1 << 16
SPACE_DTYPES = ("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16",
                "float32", "float64")

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# every global a .metadata written by torch.distributed.checkpoint (2.x, FileSystemWriter) refers to, traced on
# real saves (one rank and two FSDP2 ranks, MLP and LoRA VLA policies): plain data classes whose unpickling runs
# no code of the file's choosing (dataclass __new__ + attribute updates, TensorProperties.__setstate__ unpacking a
# tuple, Enum/torch.Size/PosixPath from values, a torch dtype or layout looked up by name)
METADATA_GLOBALS = frozenset(
    {(_DCP_METADATA, name) for name in ("Metadata", "TensorStorageMetadata", "TensorProperties",
                                        "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                        "StorageMeta", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}
    | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)})


class _MetadataUnpickler(pickle.Unpickler):
    """pickle, admitting exactly :data:`METADATA_GLOBALS`: any other global is refused before it is looked up."""

    def __init__(self, file, source: pathlib.Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in METADATA_GLOBALS:
            raise BadFile(self.source, "pickled global", "only torch.distributed.checkpoint's metadata classes "
                          "(rlfleet reads .metadata with a restricted unpickler)", f"'{module}.{name}'"[:160])
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise BadFile(self.source, "pickled persistent id", "none (DCP metadata has none)", repr(pid)[:80])


# --- finding checkpoints -------------------------------------------------------------------------------------------
def step_of(path: str | os.PathLike) -> int | None:
    """N of a ``global_step_N`` folder name, else None."""
    name = pathlib.Path(path).name
    digits = name[len(STEP_PREFIX):] if name.startswith(STEP_PREFIX) else ""
    return int(digits) if digits.isdigit() and digits.isascii() else None


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, pathlib.Path]]:
    """(N, folder) of every complete checkpoint of a run folder (``checkpoints/global_step_N`` holding
    ``learner_state.json``, which the learner writes last), oldest first."""
    found = []
    folder = pathlib.Path(run_dir) / "checkpoints"
    if folder.is_dir():
        for p in folder.iterdir():
            n = step_of(p)
            if n is not None and (p / LEARNER_STATE).is_file():
                found.append((n, p))
    return sorted(found, key=lambda x: x[0])


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A complete checkpoint folder itself (it holds learner_state.json)."""
    return (pathlib.Path(path) / LEARNER_STATE).is_file()


def latest_checkpoint(path: str | os.PathLike) -> pathlib.Path | None:
    """The newest complete checkpoint of a run folder, or None; a complete checkpoint folder itself
    (``RUN/checkpoints/global_step_N``, what `coordinatorctl eval` and `export` may name) is its own newest."""
    if is_checkpoint(path):
        return pathlib.Path(path)
    done = complete_checkpoints(path)
    return done[-1][1] if done else None


def run_folder_of(ckpt: str | os.PathLike) -> pathlib.Path:
    """The folder nothing of checkpoint ``ckpt`` may leave: its run folder (``RUN`` of
    ``RUN/checkpoints/global_step_N``), or the checkpoint folder itself when it is not inside one."""
    p = pathlib.Path(os.path.abspath(ckpt))
    return p.parent.parent if p.parent.name == "checkpoints" else p


# --- .metadata -----------------------------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _size(v, src, what: str) -> tuple[int, ...]:
    if type(v) is not torch.Size or len(v) > MAX_TENSOR_DIMS or not all(_is_int(d) and d >= 0 for d in v):
        raise BadFile(src, what, f"a torch.Size of at most {MAX_TENSOR_DIMS} non-negative ints", repr(v)[:80])
    return tuple(v)


def _check_metadata(md: Any, src: pathlib.Path, state_dir: pathlib.Path) -> Metadata:
    """The unpickled object checked to be DCP metadata whose every stored item lies in a file of ``state_dir``."""
    if type(md) is not Metadata:
        raise BadFile(src, "top level", "a torch.distributed.checkpoint Metadata", type(md).__name__)
    sdm = getattr(md, "state_dict_metadata", None)
    if type(sdm) is not dict:
        raise BadFile(src, "state_dict_metadata", "a dict", type(sdm).__name__)
    check_count("state_dict_metadata entries", len(sdm), MAX_ENTRIES, source=src)
    chunks_of: dict[str, set] = {}
    for fqn, entry in sdm.items():
        if type(fqn) is not str:
            raise BadFile(src, "state_dict_metadata key", "a string", repr(fqn)[:80])
        where = f"state_dict_metadata['{fqn[:120]}']"
        if type(entry) is BytesStorageMetadata:
            chunks_of[fqn] = {None}
            continue
        if type(entry) is not TensorStorageMetadata:
            raise BadFile(src, where, "TensorStorageMetadata or BytesStorageMetadata", type(entry).__name__)
        props = getattr(entry, "properties", None)
        if type(props) is not TensorProperties or not isinstance(getattr(props, "dtype", None), torch.dtype):
            raise BadFile(src, f"{where}.properties", "TensorProperties with a torch dtype", repr(props)[:80])
        shape = _size(getattr(entry, "size", None), src, f"{where}.size")
        chunks = getattr(entry, "chunks", None)
        if type(chunks) is not list:
            raise BadFile(src, f"{where}.chunks", "a list", type(chunks).__name__)
        check_count(f"{where}.chunks", len(chunks), MAX_ENTRIES, source=src)
        offsets = set()
        for c in chunks:
            if type(c) is not ChunkStorageMetadata:
                raise BadFile(src, f"{where}.chunks", "ChunkStorageMetadata", type(c).__name__)
            off = _size(getattr(c, "offsets", None), src, f"{where}.chunks offsets")
            size = _size(getattr(c, "sizes", None), src, f"{where}.chunks sizes")
            if len(off) != len(shape) or len(size) != len(shape) or \
                    any(o + s > d for o, s, d in zip(off, size, shape)):
                raise BadFile(src, f"{where}.chunks", f"chunks inside the tensor's shape {list(shape)}",
                              f"offsets {list(off)} sizes {list(size)}")
            offsets.add(off)
        chunks_of[fqn] = offsets
    storage = getattr(md, "storage_data", None)
    if type(storage) is not dict:
        raise BadFile(src, "storage_data", "a dict of MetadataIndex -> _StorageInfo", type(storage).__name__)
    check_count("storage_data entries", len(storage), MAX_ENTRIES, source=src)
    files: dict[str, int] = {}
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(getattr(index, "fqn", None)) is not str:
            raise BadFile(src, "storage_data key", "a MetadataIndex", repr(index)[:80])
        name = f"storage_data['{index.fqn[:120]}']"
        offset = getattr(index, "offset", None)
        key = None if offset is None else _size(offset, src, f"{name} offset")
        if index.fqn not in chunks_of or key not in chunks_of[index.fqn]:
            raise BadFile(src, name, "an item of state_dict_metadata (a tensor chunk or a byte item)",
                          f"offset {list(key) if key is not None else None}")
        if type(info) is not _StorageInfo:
            raise BadFile(src, name, "a _StorageInfo", type(info).__name__)
        rel, start, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if type(rel) is not str or not rel or "/" in rel or "\\" in rel or rel in (".", "..") or \
                rel.startswith(".") or "\x00" in rel:
            raise OutsideRoot(src, f"{name}.relative_path", f"a plain file name in {state_dir}", repr(rel)[:120])
        if not (_is_int(start) and _is_int(length) and start >= 0 and length >= 0):
            raise BadFile(src, f"{name} offset/length", "non-negative integers", f"{start!r}, {length!r}"[:80])
        if getattr(info, "transform_descriptors", None):
            raise BadFile(src, f"{name}.transform_descriptors", "none (rlfleet writes no stream transforms)",
                          repr(info.transform_descriptors)[:80])
        if rel not in files:
            target = inside(state_dir, rel, what=f"{name}.relative_path", source=src)
            files[rel] = regular_file(target, what=f"{rel} (named by {src.name})").stat().st_size
        if start + length > files[rel]:
            raise TooLarge(state_dir / rel, f"bytes {start:,}..{start + length:,} of '{index.fqn[:120]}'",
                           f"inside the file's {files[rel]:,} bytes", "beyond its end (the file is truncated or "
                           f"{src.name} lies)")
    for fqn, keys in chunks_of.items():  # every chunk and byte item is stored somewhere
        for key in keys:
            if MetadataIndex(fqn, key) not in storage:
                raise BadFile(src, f"storage_data['{fqn[:120]}']", "an entry for every chunk of state_dict_metadata",
                              f"none for offset {list(key) if key is not None else None}")
    planner_data = getattr(md, "planner_data", None)
    if planner_data is not None and (type(planner_data) is not dict or not all(
            type(k) is str and type(v) is tuple and all(type(x) in (str, int) for x in v)
            for k, v in planner_data.items())):
        raise BadFile(src, "planner_data", "a dict of names to tuples of keys", type(planner_data).__name__)
    meta = getattr(md, "storage_meta", None)
    if meta is not None and (type(meta) is not StorageMeta or not isinstance(getattr(meta, "modules", []), list)
                             or not isinstance(getattr(meta, "checkpoint_id", None), (str, os.PathLike, type(None)))
                             or not all(isinstance(getattr(meta, a, None), (str, type(None)))
                                        for a in ("save_id", "load_id"))):
        raise BadFile(src, "storage_meta", "a StorageMeta of strings", repr(meta)[:80])
    if not isinstance(getattr(md, "version", None), (str, type(None))):
        raise BadFile(src, "version", "a string", repr(md.version)[:80])
    return md


def read_metadata(state_dir: str | os.PathLike, *, root: str | os.PathLike | None = None) -> Metadata:
    """``state_dir/.metadata`` through the restricted unpickler (bounded, inside ``root``), checked (module
    docstring); every problem is one :class:`BadFile`."""
    state_dir = pathlib.Path(state_dir)
    src = state_dir / METADATA_FILE
    path = regular_file(src, root=root, what="DCP metadata", max_bytes=MAX_METADATA_BYTES)
    with open(path, "rb") as f:
        data = f.read(MAX_METADATA_BYTES + 1)
    try:
        md = _MetadataUnpickler(io.BytesIO(data), src).load()
    except BadFile:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated, not a pickle, a class fed wrong state: all one line
        raise BadFile(src, "pickle", "DCP metadata (a pickle of Metadata)",
                      f"{type(exc).__name__}: {str(exc)[:120]}") from None
    try:
        return _check_metadata(md, src, pathlib.Path(os.path.abspath(state_dir)).resolve())
    except BadFile:
        raise
    except (AttributeError, TypeError, ValueError, RecursionError) as exc:  # e.g. an unhashable key's offset
        raise BadFile(src, "metadata", "DCP metadata", f"{type(exc).__name__}: {str(exc)[:120]}") from None


# --- non-tensor items ----------------------------------------------------------------------------------------------
def _plain(value, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return True
    if isinstance(value, (list, tuple)) and depth < 8 and len(value) <= MAX_ENTRIES:
        return all(_plain(v, depth + 1) for v in value)
    return False


def load_plain(data: bytes | io.BytesIO, source: str | os.PathLike, item: str) -> Any:
    """A non-tensor item DCP stored (``torch.save`` of a value): ``torch.load(weights_only=True)``, then a plain
    value (numbers, strings, booleans, None, lists and tuples of them), else :class:`BadFile`."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        value = torch.load(stream, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - UnpicklingError names the global it refused
        # the line naming what was refused ("... unsupported GLOBAL posix.system ..."), not torch's advice to
        # re-run with weights_only=False
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        text = next((ln for ln in lines if "GLOBAL" in ln or "global" in ln.split(" ", 3)[:3]), lines[0] if lines
                    else "")
        raise BadFile(source, f"item '{item[:120]}'", "a plain value torch.load(weights_only=True) reads",
                      f"{type(exc).__name__}: {text[:160]}") from None
    if not _plain(value):
        raise BadFile(source, f"item '{item[:120]}'", "a plain value (number, string, bool, None, list, tuple)",
                      type(value).__name__)
    return value


class CheckedReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` (restricted unpickler, checked) instead of ``pickle.load``.
    There is no per-rank metadata fallback (``read_metadata(rank=...)``: rlfleet writes one ``.metadata``)."""

    def __init__(self, state_dir: str | os.PathLike, root: str | os.PathLike | None = None):
        super().__init__(state_dir)
        self.root = root

    def read_metadata(self, *args) -> Metadata:  # noqa: D102 - no **kwargs: DCP then tries no rank-local file
        md = read_metadata(self.path, root=self.root)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def _slice_file(self, file, sinfo: _StorageInfo):
        self._reading = sinfo  # the item being read, for the message should it fail
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):  # noqa: D102 - DCP's, a failure named by file and item
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except BadFile:
            raise
        except Exception as exc:  # noqa: BLE001 - a record torch.load cannot read, a short read, a shape mismatch
            s = self._reading
            if s is None:
                raise BadFile(self.path, "shards", "records torch.load(weights_only=True) reads",
                              f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}") from None
            fqn = next((k.fqn for k, v in self.storage_data.items() if v is s), "?")
            raise BadFile(pathlib.Path(self.path) / s.relative_path,
                          f"item '{fqn[:120]}' (bytes {s.offset:,}..{s.offset + s.length:,})",
                          "a record torch.load(weights_only=True) reads",
                          f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}") from None


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner whose non-tensor items are read by :func:`load_plain` (``weights_only=True``)
    rather than ``torch.load(weights_only=False)``."""

    def __init__(self, source: str | os.PathLike = STATE_DIR, **kw):
        super().__init__(**kw)
        self.source = source

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        obj = load_plain(value, self.source, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load_state(state: dict, state_dir: str | os.PathLike, *, root: str | os.PathLike | None = None,
               allow_partial_load: bool = False) -> None:
    """``dcp.load(state)`` from ``state_dir`` through :class:`CheckedReader` and :class:`CheckedLoadPlanner`
    (collective when torch.distributed is initialised). A failure on any rank is raised on every rank as one
    :class:`BadFile` (DCP's own CheckpointException is a BaseException that escapes ``except Exception``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = CheckedReader(state_dir, root=root)
    planner = CheckedLoadPlanner(state_dir, allow_partial_load=allow_partial_load)
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except CheckpointException as exc:
        rank, (first, _trace) = min(exc.failures.items())
        if isinstance(first, BadFile):
            raise first from None
        text = " ".join(str(first).split())
        raise BadFile(state_dir, "shards", "tensors torch.distributed.checkpoint can read",
                      f"rank {rank}: {type(first).__name__}: {text[:200]}") from None


# --- the leader's files --------------------------------------------------------------------------------------------
def _number(state: dict, key: str, src, lo: float, hi: float) -> float:
    v = state.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise BadFile(src, key, f"a number in [{lo:g}, {hi:g}]", repr(v)[:80])
    return v


def _space(name: str, value: Any, src) -> None:
    what = f"obs_specs['{name[:60]}']"
    if isinstance(value, list):  # written before bounds were kept: [shape, dtype]
        if len(value) != 2:
            raise BadFile(src, what, "[shape, dtype] or {shape, dtype, low, high}", repr(value)[:80])
        value = {"shape": value[0], "dtype": value[1]}
    if not isinstance(value, dict) or not {"shape", "dtype"} <= set(value) <= {"shape", "dtype", "low", "high"}:
        raise BadFile(src, what, "{shape, dtype, low, high}", repr(value)[:80])
    shape = value["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS or \
            not all(_is_int(d) and d >= 0 for d in shape):
        raise BadFile(src, f"{what}.shape", f"at most {MAX_TENSOR_DIMS} non-negative integers", repr(shape)[:80])
    n = math.prod(shape)
    check_count(f"{what} elements", n, MAX_SPACE_ELEMENTS, source=src)
    if value["dtype"] not in SPACE_DTYPES:
        raise BadFile(src, f"{what}.dtype", f"one of {', '.join(SPACE_DTYPES)}", repr(value["dtype"])[:40])
    for b in ("low", "high"):
        bound = value.get(b)
        ok = bound is None or (isinstance(bound, (int, float)) and not isinstance(bound, bool)) or (
            isinstance(bound, list) and len(bound) == n and
            all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in bound))
        if not ok or (isinstance(bound, float) and math.isnan(bound)):
            raise BadFile(src, f"{what}.{b}", f"a number or {n} numbers", repr(bound)[:80])


def read_learner_state(ckpt: str | os.PathLike, *, root: str | os.PathLike | None = None) -> dict:
    """``learner_state.json`` of checkpoint ``ckpt`` (bounded JSON inside ``root``, default its run folder), every
    field checked against what the learner writes; -> the dict."""
    ckpt = pathlib.Path(ckpt)
    src = ckpt / LEARNER_STATE
    state = read_json(src, max_bytes=MAX_LEARNER_STATE_BYTES, root=root if root is not None else run_folder_of(ckpt),
                      what="learner state", allow_infinity=True)
    need = {"epoch", "weights_version", "env_steps", "elapsed_s", "action_dim", "obs_specs"}
    missing = sorted(need - set(state))
    if missing:
        raise BadFile(src, ", ".join(missing), "the learner's counters and spaces (what the learner writes)",
                      "missing")
    # a field a later version adds is ignored here (its zero value is what this version assumes), but not without end
    check_count("number of fields", len(state), 256, source=src)
    epoch = state["epoch"]
    check_count("epoch", epoch, 1 << 40, source=src, minimum=-1)
    step = step_of(ckpt)
    if step is not None and epoch != step - 1:
        raise BadFile(src, "epoch", f"{step - 1} (the checkpoint folder is {ckpt.name}: epoch + 1)", str(epoch))
    check_count("weights_version", state["weights_version"], 1 << 40, source=src)
    check_count("env_steps", state["env_steps"], 1 << 62, source=src)
    _number(state, "elapsed_s", src, 0.0, 1e12)
    check_count("action_dim", state["action_dim"], MAX_ACTION_DIM, source=src, minimum=1)
    check_count("world_size", state.get("world_size", 1), 1 << 20, source=src, minimum=1)
    specs = state["obs_specs"]
    if not isinstance(specs, dict) or not specs:
        raise BadFile(src, "obs_specs", "an object of observation spaces", repr(specs)[:80])
    check_count("obs_specs entries", len(specs), MAX_OBS_ENTRIES, source=src, minimum=1)
    for name, value in specs.items():
        _space(name, value, src)
    return state


def check_reward_rms(ckpt: str | os.PathLike, *, root: str | os.PathLike | None = None) -> dict[str, dict]:
    """``reward_rms.safetensors``'s header (bounded, inside ``root``): the reward normaliser's ``mean``, ``var``
    and ``count`` (scalars) and ``returns.W`` per worker W (one running return per env); -> its entries."""
    src = pathlib.Path(ckpt) / REWARD_RMS
    tensors = safetensors_header(src, root=root if root is not None else run_folder_of(ckpt))
    for name in ("mean", "var", "count"):
        if name not in tensors:
            raise BadFile(src, f"tensor '{name}'", "the reward normaliser's mean, var and count", "missing")
    for name, entry in tensors.items():
        if entry["dtype"] not in ("F32", "F64"):
            raise BadFile(src, f"tensor '{name[:60]}' dtype", "F32 or F64", entry["dtype"])
        if name in ("mean", "var", "count"):
            if entry["shape"] != []:
                raise BadFile(src, f"tensor '{name}' shape", "[] (a scalar)", str(entry["shape"]))
            continue
        worker = name[len("returns."):] if name.startswith("returns.") else ""
        if not (worker.isdigit() and worker.isascii() and int(worker) < MAX_WORKERS):
            raise BadFile(src, f"tensor '{name[:60]}'", f"mean, var, count or returns.W (W < {MAX_WORKERS})",
                          "another name")
        if len(entry["shape"]) != 1 or entry["shape"][0] > MAX_ENVS:
            raise BadFile(src, f"tensor '{name}' shape", f"[envs] (at most {MAX_ENVS:,})", str(entry["shape"]))
    return tensors


# --- the whole checkpoint ------------------------------------------------------------------------------------------
@dataclass
class CheckpointInfo:
    """What :func:`verify_checkpoint` read: the checkpoint folder, its step, learner_state.json, the DCP metadata
    and the model's tensors as the metadata declares them ({name: (shape, dtype)}, without the ``model.`` prefix)."""

    path: pathlib.Path
    step: int | None
    state: dict
    metadata: Metadata
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    items: dict[str, Any] = field(default_factory=dict)  # the non-tensor items (optimizer hyper-parameters)


def verify_checkpoint(ckpt: str | os.PathLike, *, root: str | os.PathLike | None = None) -> CheckpointInfo:
    """Check checkpoint folder ``ckpt`` whole, without loading a tensor: nothing of it leaves ``root`` (default
    its run folder), ``learner_state.json`` (:func:`read_learner_state`), ``reward_rms.safetensors``'s header
    (:func:`check_reward_rms`), ``state/.metadata`` (:func:`read_metadata`: every shard it names exists and is long
    enough) and its non-tensor items (:func:`load_plain`). Every problem is one :class:`BadFile` (FileNotFoundError
    for a missing file); -> what it read."""
    ckpt = pathlib.Path(ckpt)
    root = pathlib.Path(root) if root is not None else run_folder_of(ckpt)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"{ckpt}: no such checkpoint folder")
    rel = os.path.relpath(os.path.abspath(ckpt), os.path.abspath(root))
    inside(root, rel, what="checkpoint folder", source=ckpt)  # a link out of the run folder
    state = read_learner_state(ckpt, root=root)
    check_reward_rms(ckpt, root=root)
    state_dir = ckpt / STATE_DIR
    if not state_dir.is_dir():
        raise FileNotFoundError(f"{state_dir}: no such folder (a checkpoint's policy and optimizer are in "
                                f"{STATE_DIR}/; one from before sharded checkpoints cannot be read by this version)")
    inside(root, os.path.join(rel, STATE_DIR), what=f"{STATE_DIR}/ folder", source=state_dir)
    md = read_metadata(state_dir, root=root)
    info = CheckpointInfo(ckpt, step_of(ckpt), state, md)
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata) and fqn.startswith("model."):
            info.tensors[fqn[len("model."):]] = (tuple(entry.size), entry.properties.dtype)
    for index, sinfo in md.storage_data.items():
        if isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata):
            if sinfo.length > MAX_BYTES_ITEM:
                raise TooLarge(state_dir / sinfo.relative_path, f"item '{index.fqn[:120]}'",
                               f"at most {MAX_BYTES_ITEM:,} bytes (a hyper-parameter)", f"{sinfo.length:,}")
            with open(state_dir / sinfo.relative_path, "rb") as f:
                f.seek(sinfo.offset)
                data = f.read(sinfo.length)
            info.items[index.fqn] = load_plain(data, state_dir / sinfo.relative_path, index.fqn)
    return info


__all__ = ["CheckedLoadPlanner", "CheckedReader", "CheckpointInfo", "LEARNER_STATE", "METADATA_GLOBALS",
           "REWARD_RMS", "STATE_DIR", "check_reward_rms", "complete_checkpoints", "is_checkpoint",
           "latest_checkpoint", "load_plain", "load_state", "read_learner_state", "read_metadata", "run_folder_of",
           "step_of", "verify_checkpoint"]

"""The torch part of reading a learner checkpoint (:mod:`rlfleet.data.checkpoint_files` is the rest, torch-free, and
imports this module only inside the functions that need it): ``state/.metadata`` through a restricted unpickler
(:func:`read_metadata`), the non-tensor items with ``torch.load(weights_only=True)`` (:func:`load_plain`), and
:func:`load_state`, the one way rlfleet loads ``state/`` (DCP with :class:`CheckedReader` and
:class:`CheckedLoadPlanner`). What each checks: :mod:`rlfleet.data.checkpoint_files`' docstring.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from rlfleet.data.checkpoint_layout import (
    MAX_ENTRIES,
    MAX_METADATA_BYTES,
    MAX_TENSOR_DIMS,
    METADATA_FILE,
    STATE_DIR,
    is_int,
)
from rlfleet.untrusted import BadFile, OutsideRoot, TooLarge, check_count, inside, regular_file

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# every global a .metadata written by torch.distributed.checkpoint (2.x, FileSystemWriter) refers to, traced on
# real saves (one rank and two FSDP2 ranks, MLP and LoRA VLA policies): plain data classes whose unpickling runs
# no code of the file's choosing (dataclass __new__ + attribute updates, TensorProperties.__setstate__ unpacking a
# tuple, Enum/torch.Size/PosixPath from values, a torch dtype or layout looked up by name)
METADATA_GLOBALS = frozenset(
    {
        (_DCP_METADATA, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
    }
    | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
)


class _MetadataUnpickler(pickle.Unpickler):
    """pickle, admitting exactly :data:`METADATA_GLOBALS`: any other global is refused before it is looked up."""

    def __init__(self, file, source: pathlib.Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in METADATA_GLOBALS:
            raise BadFile(
                self.source,
                "pickled global",
                "only torch.distributed.checkpoint's metadata classes "
                "(rlfleet reads .metadata with a restricted unpickler)",
                f"'{module}.{name}'"[:160],
            )
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise BadFile(self.source, "pickled persistent id", "none (DCP metadata has none)", repr(pid)[:80])


# --- .metadata -----------------------------------------------------------------------------------------------------
def _size(v, src, what: str) -> tuple[int, ...]:
    if type(v) is not torch.Size or len(v) > MAX_TENSOR_DIMS or not all(is_int(d) and d >= 0 for d in v):
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
            if len(off) != len(shape) or len(size) != len(shape) or any(o + s > d for o, s, d in zip(off, size, shape)):
                raise BadFile(
                    src,
                    f"{where}.chunks",
                    f"chunks inside the tensor's shape {list(shape)}",
                    f"offsets {list(off)} sizes {list(size)}",
                )
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
            raise BadFile(
                src,
                name,
                "an item of state_dict_metadata (a tensor chunk or a byte item)",
                f"offset {list(key) if key is not None else None}",
            )
        if type(info) is not _StorageInfo:
            raise BadFile(src, name, "a _StorageInfo", type(info).__name__)
        rel, start, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if (
            type(rel) is not str
            or not rel
            or "/" in rel
            or "\\" in rel
            or rel in (".", "..")
            or rel.startswith(".")
            or "\x00" in rel
        ):
            raise OutsideRoot(src, f"{name}.relative_path", f"a plain file name in {state_dir}", repr(rel)[:120])
        if not (is_int(start) and is_int(length) and start >= 0 and length >= 0):
            raise BadFile(src, f"{name} offset/length", "non-negative integers", f"{start!r}, {length!r}"[:80])
        if getattr(info, "transform_descriptors", None):
            raise BadFile(
                src,
                f"{name}.transform_descriptors",
                "none (rlfleet writes no stream transforms)",
                repr(info.transform_descriptors)[:80],
            )
        if rel not in files:
            target = inside(state_dir, rel, what=f"{name}.relative_path", source=src)
            files[rel] = regular_file(target, what=f"{rel} (named by {src.name})").stat().st_size
        if start + length > files[rel]:
            raise TooLarge(
                state_dir / rel,
                f"bytes {start:,}..{start + length:,} of '{index.fqn[:120]}'",
                f"inside the file's {files[rel]:,} bytes",
                f"beyond its end (the file is truncated or {src.name} lies)",
            )
    for fqn, keys in chunks_of.items():  # every chunk and byte item is stored somewhere
        for key in keys:
            if MetadataIndex(fqn, key) not in storage:
                raise BadFile(
                    src,
                    f"storage_data['{fqn[:120]}']",
                    "an entry for every chunk of state_dict_metadata",
                    f"none for offset {list(key) if key is not None else None}",
                )
    planner_data = getattr(md, "planner_data", None)
    if planner_data is not None and (
        type(planner_data) is not dict
        or not all(
            type(k) is str and type(v) is tuple and all(type(x) in (str, int) for x in v)
            for k, v in planner_data.items()
        )
    ):
        raise BadFile(src, "planner_data", "a dict of names to tuples of keys", type(planner_data).__name__)
    meta = getattr(md, "storage_meta", None)
    if meta is not None and (
        type(meta) is not StorageMeta
        or not isinstance(getattr(meta, "modules", []), list)
        or not isinstance(getattr(meta, "checkpoint_id", None), (str, os.PathLike, type(None)))
        or not all(isinstance(getattr(meta, a, None), (str, type(None))) for a in ("save_id", "load_id"))
    ):
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
        raise BadFile(
            src, "pickle", "DCP metadata (a pickle of Metadata)", f"{type(exc).__name__}: {str(exc)[:120]}"
        ) from None
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
        text = next(
            (ln for ln in lines if "GLOBAL" in ln or "global" in ln.split(" ", 3)[:3]), lines[0] if lines else ""
        )
        raise BadFile(
            source,
            f"item '{item[:120]}'",
            "a plain value torch.load(weights_only=True) reads",
            f"{type(exc).__name__}: {text[:160]}",
        ) from None
    if not _plain(value):
        raise BadFile(
            source,
            f"item '{item[:120]}'",
            "a plain value (number, string, bool, None, list, tuple)",
            type(value).__name__,
        )
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
                raise BadFile(
                    self.path,
                    "shards",
                    "records torch.load(weights_only=True) reads",
                    f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}",
                ) from None
            fqn = next((k.fqn for k, v in self.storage_data.items() if v is s), "?")
            raise BadFile(
                pathlib.Path(self.path) / s.relative_path,
                f"item '{fqn[:120]}' (bytes {s.offset:,}..{s.offset + s.length:,})",
                "a record torch.load(weights_only=True) reads",
                f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}",
            ) from None


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


def load_state(
    state: dict,
    state_dir: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    allow_partial_load: bool = False,
) -> None:
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
        raise BadFile(
            state_dir,
            "shards",
            "tensors torch.distributed.checkpoint can read",
            f"rank {rank}: {type(first).__name__}: {text[:200]}",
        ) from None


__all__ = [
    "BytesStorageMetadata",
    "CheckedLoadPlanner",
    "CheckedReader",
    "METADATA_GLOBALS",
    "TensorStorageMetadata",
    "load_plain",
    "load_state",
    "read_metadata",
]

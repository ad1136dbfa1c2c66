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
as one :class:`~rlfleet.untrusted.BadFile`). :func:`find_checkpoint`, :func:`latest_checkpoint`,
:func:`complete_checkpoints` and :func:`checkpoint_dir` are the one place a run folder's checkpoints are found and
named (the learner, export, evaluation and the CLI), :func:`specs_from_json` the one reading of the spaces it records.

This module is torch-free (the coordinator's CLI imports it): the DCP part (.metadata, the shards) is
:mod:`rlfleet.data.dcp_files`, imported inside the functions that need it; its names are reachable from here too.
The folder's names and the limits of what it may hold, which both use, are :mod:`rlfleet.data.checkpoint_layout`.
"""

from __future__ import annotations

import math
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any

from rlfleet.data.checkpoint_layout import (
    LEARNER_STATE,
    MAX_ACTION_DIM,
    MAX_BYTES_ITEM,
    MAX_ENVS,
    MAX_LEARNER_STATE_BYTES,
    MAX_OBS_ENTRIES,
    MAX_SPACE_ELEMENTS,
    MAX_TENSOR_DIMS,
    MAX_WORKERS,
    REWARD_RMS,
    SPACE_DTYPES,
    STATE_DIR,
    STEP_PREFIX,
    is_int,
)
from rlfleet.untrusted import BadFile, TooLarge, check_count, inside, read_json, safetensors_header


# --- finding checkpoints -------------------------------------------------------------------------------------------
def step_of(path: str | os.PathLike) -> int | None:
    """N of a ``global_step_N`` folder name, else None."""
    name = pathlib.Path(path).name
    digits = name[len(STEP_PREFIX) :] if name.startswith(STEP_PREFIX) else ""
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


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> pathlib.Path:
    """The folder the learner saves step ``step``'s checkpoint in (``RUN/checkpoints/global_step_N``)."""
    return pathlib.Path(run_dir) / "checkpoints" / f"{STEP_PREFIX}{int(step)}"


class CheckpointNotFound(FileNotFoundError):
    """No (complete) checkpoint where one was asked for; ``str()`` is the one-line reason."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def find_checkpoint(path: str | os.PathLike, step: int | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """(checkpoint folder, run folder) that ``path`` names: a complete checkpoint folder itself
    (``RUN/checkpoints/global_step_N``), or a run folder's newest complete checkpoint, or with ``step`` its
    ``global_step_<step>``. Anything else: :class:`CheckpointNotFound` saying why, in one line."""
    run = pathlib.Path(path)
    if not run.is_dir():
        raise CheckpointNotFound(f"{run}: no such folder (give a run folder or RUN/checkpoints/{STEP_PREFIX}N)")
    if is_checkpoint(run):  # a checkpoint folder itself
        if step is not None and step_of(run) != step:
            raise CheckpointNotFound(f"--step {step}: {run} is the checkpoint of another step")
        return run, run.parent.parent
    done = complete_checkpoints(run)
    if step is not None:
        found = [p for n, p in done if n == step]
        if not found:
            raise CheckpointNotFound(
                f"--step {step}: no complete checkpoint {STEP_PREFIX}{step} in "
                f"{run / 'checkpoints'} (complete ones: "
                f"{', '.join(str(n) for n, _ in done) or 'none'})"
            )
        return found[0], run
    if not done:
        why = (
            f" ({run.name} is an incomplete checkpoint: no {LEARNER_STATE}, its run stopped while saving it)"
            if step_of(run) is not None
            else f" (a run folder holds checkpoints/{STEP_PREFIX}N/{LEARNER_STATE})"
        )
        raise CheckpointNotFound(f"{run}: no complete checkpoint in {run / 'checkpoints'}{why}")
    return done[-1][1], run


def specs_to_json(obs_specs: dict) -> dict:
    """Observation spaces as ``learner_state.json`` records them."""
    return {k: s.to_json() for k, s in obs_specs.items()}


def specs_from_json(data: dict) -> dict:
    """``learner_state.json``'s ``obs_specs`` -> {name: TensorSpace}: TensorSpace.to_json's form, or [shape, dtype]
    (checkpoints written before bounds were kept)."""
    from rlfleet.wire.spaces import TensorSpace

    return {
        k: TensorSpace(tuple(v[0]), v[1]) if isinstance(v, list) else TensorSpace.from_json(v) for k, v in data.items()
    }


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
    if not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS or not all(is_int(d) and d >= 0 for d in shape):
        raise BadFile(src, f"{what}.shape", f"at most {MAX_TENSOR_DIMS} non-negative integers", repr(shape)[:80])
    n = math.prod(shape)
    check_count(f"{what} elements", n, MAX_SPACE_ELEMENTS, source=src)
    if value["dtype"] not in SPACE_DTYPES:
        raise BadFile(src, f"{what}.dtype", f"one of {', '.join(SPACE_DTYPES)}", repr(value["dtype"])[:40])
    for b in ("low", "high"):
        bound = value.get(b)
        ok = (
            bound is None
            or (isinstance(bound, (int, float)) and not isinstance(bound, bool))
            or (
                isinstance(bound, list)
                and len(bound) == n
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in bound)
            )
        )
        if not ok or (isinstance(bound, float) and math.isnan(bound)):
            raise BadFile(src, f"{what}.{b}", f"a number or {n} numbers", repr(bound)[:80])


def read_learner_state(ckpt: str | os.PathLike, *, root: str | os.PathLike | None = None) -> dict:
    """``learner_state.json`` of checkpoint ``ckpt`` (bounded JSON inside ``root``, default its run folder), every
    field checked against what the learner writes; -> the dict."""
    ckpt = pathlib.Path(ckpt)
    src = ckpt / LEARNER_STATE
    state = read_json(
        src,
        max_bytes=MAX_LEARNER_STATE_BYTES,
        root=root if root is not None else run_folder_of(ckpt),
        what="learner state",
        allow_infinity=True,
    )
    need = {"epoch", "weights_version", "env_steps", "elapsed_s", "action_dim", "obs_specs"}
    missing = sorted(need - set(state))
    if missing:
        raise BadFile(src, ", ".join(missing), "the learner's counters and spaces (what the learner writes)", "missing")
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
    and ``count`` (scalars) and ``returns.W`` per worker W (one running return per env), or no tensor at all (an
    algorithm without one); -> its entries."""
    src = pathlib.Path(ckpt) / REWARD_RMS
    tensors = safetensors_header(src, root=root if root is not None else run_folder_of(ckpt))
    if not tensors:  # an algorithm without a reward normaliser (SAC) writes the file empty
        return tensors
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
        worker = name[len("returns.") :] if name.startswith("returns.") else ""
        if not (worker.isdigit() and worker.isascii() and int(worker) < MAX_WORKERS):
            raise BadFile(
                src, f"tensor '{name[:60]}'", f"mean, var, count or returns.W (W < {MAX_WORKERS})", "another name"
            )
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
    metadata: Any  # torch.distributed.checkpoint's Metadata
    tensors: dict[str, tuple[tuple[int, ...], Any]] = field(default_factory=dict)  # (shape, torch dtype)
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
        raise FileNotFoundError(
            f"{state_dir}: no such folder (a checkpoint's policy and optimizer are in "
            f"{STATE_DIR}/; one from before sharded checkpoints cannot be read by this version)"
        )
    inside(root, os.path.join(rel, STATE_DIR), what=f"{STATE_DIR}/ folder", source=state_dir)
    from rlfleet.data.dcp_files import BytesStorageMetadata, TensorStorageMetadata, load_plain, read_metadata

    md = read_metadata(state_dir, root=root)
    info = CheckpointInfo(ckpt, step_of(ckpt), state, md)
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata) and fqn.startswith("model."):
            info.tensors[fqn[len("model.") :]] = (tuple(entry.size), entry.properties.dtype)
    for index, sinfo in md.storage_data.items():
        if isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata):
            if sinfo.length > MAX_BYTES_ITEM:
                raise TooLarge(
                    state_dir / sinfo.relative_path,
                    f"item '{index.fqn[:120]}'",
                    f"at most {MAX_BYTES_ITEM:,} bytes (a hyper-parameter)",
                    f"{sinfo.length:,}",
                )
            with open(state_dir / sinfo.relative_path, "rb") as f:
                f.seek(sinfo.offset)
                data = f.read(sinfo.length)
            info.items[index.fqn] = load_plain(data, state_dir / sinfo.relative_path, index.fqn)
    return info


# the DCP part, imported when first named (rlfleet.data.dcp_files imports torch)
_DCP_NAMES = ("CheckedLoadPlanner", "CheckedReader", "METADATA_GLOBALS", "load_plain", "load_state", "read_metadata")


def __getattr__(name: str):
    if name in _DCP_NAMES:
        from rlfleet.data import dcp_files

        return getattr(dcp_files, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointInfo",
    "CheckpointNotFound",
    "LEARNER_STATE",
    "REWARD_RMS",
    "STATE_DIR",
    "check_reward_rms",
    "checkpoint_dir",
    "complete_checkpoints",
    "find_checkpoint",
    "is_checkpoint",
    "latest_checkpoint",
    "read_learner_state",
    "run_folder_of",
    "specs_from_json",
    "specs_to_json",
    "step_of",
    "verify_checkpoint",
]  # (and the DCP part's names, through __getattr__)

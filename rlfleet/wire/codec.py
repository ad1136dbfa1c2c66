"""The data that crosses the wire, and its protobuf form (``rlfleet.v1`` messages), with validation of everything
received. In sections, in this order:

- Tensors: numpy arrays <-> ``Tensor`` / ``TensorMap`` messages (:func:`encode`, :func:`decode`, :func:`encode_map`,
  :func:`decode_map`). Decoding never trusts the sender: dtype, shape, byte size, expected shape and finiteness are
  checked and a ``CodecError`` names the offending field. Servers turn it into INVALID_ARGUMENT.
- The rollout schema: one schema for what an env server pushes (``PushRollout``) and what the learner takes (below).
- Episodes: :class:`EpisodeStat` <-> the ``EpisodeStats`` message.
- The policy's output per step (:class:`PolicyOutput`, the one policy-output type).
- The Act's per-row noise keys (:func:`row_keys`, :class:`RowNoise`): reproducible sampling noise, keyed per env and
  step.

A worker's epoch is a :class:`Rollout`: time-major tensors ``[T, N, ...]`` (T steps of N envs) and its tail, plus
the episodes that ended (:class:`EpisodeStat`, the ``EpisodeStats`` message on the wire). It is algorithm-neutral:
what the envs saw and did, and what the acting policy answered; nothing in it is computed for one algorithm. Its
tensors, by name:

- the fixed fields of :data:`TIME_MAJOR` (dtype, and the shape after ``[T, N]``): actions, the acting policy's
  log-probs and values, rewards, terminations and truncations as separate flags, the loss mask, weights versions;
- ``obs.<key>``: each observation entry, as the env's observation space says;
- ``fi.<key>``: the forward inputs the learner needs to recompute the log-probs (the policy's ``forward_inputs``);
- the tail, in the last chunk of the stream: ``next_obs.<key>`` ``[N, ...]``, each env's observation after the last
  step, and ``final_obs.<key>`` ``[M, ...]`` at rows ``final_index`` ``[M]`` (t * N + n), the final observation of
  each episode that ended in the rollout (every truncated one at least). The learner bootstraps from them.

Bounds: a float field's ``bound`` (and :data:`OBS_BOUND`, :data:`FI_BOUND` for the prefixed tensors) is the largest
magnitude a value may have. They are far above anything a simulator or policy here produces (rewards are at most
~10 per step, actions and observations are O(1) to O(100)), and far below what breaks the learner: a finite value
of 3e38 overflows the advantages, the losses and the reward normaliser's variance (9e76, after which every reward
scales to ~1e-38), so such a rollout is refused, naming the field, instead of poisoning every later update.

The env side builds its buffers with :func:`empty_buffers`; the learner checks a pushed rollout with :func:`check_rollout`,
which names the first field that breaks the schema. numpy and the generated protobuf code only (torch only where a
caller hands tensors over): env servers run in simulator environments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlfleet.v1 import tensor_pb2
from rlfleet.wire import limits

# --- Tensors: numpy arrays <-> Tensor / TensorMap messages, every received one checked --------------------------------
Tensor = tensor_pb2.Tensor
TensorMap = tensor_pb2.TensorMap
TensorSpec = tensor_pb2.TensorSpec
DType = tensor_pb2.DType

_NP_BY_DTYPE: dict[int, np.dtype] = {
    DType.FLOAT32: np.dtype("<f4"),
    DType.FLOAT64: np.dtype("<f8"),
    DType.FLOAT16: np.dtype("<f2"),
    DType.BFLOAT16: np.dtype("<u2"),  # raw bits; use torch helpers to view as bfloat16
    DType.INT64: np.dtype("<i8"),
    DType.INT32: np.dtype("<i4"),
    DType.INT8: np.dtype("i1"),
    DType.UINT8: np.dtype("u1"),
    DType.BOOL: np.dtype("?"),
}
_DTYPE_BY_NP: dict[np.dtype, int] = {
    np.dtype(v).newbyteorder("="): k for k, v in _NP_BY_DTYPE.items() if k != DType.BFLOAT16
}

MAX_ELEMENTS = limits.MAX_TENSOR_ELEMENTS  # of one received tensor (rlfleet/wire/limits.py)
MAX_DIMS = limits.MAX_DIMS


class CodecError(ValueError):
    """A received tensor is malformed or not what was expected; the message names the field."""


def check_shape(dims: Sequence[int], name: str) -> int:
    """A received shape: at most MAX_DIMS dimensions (counted before they are copied), none negative, at most
    MAX_ELEMENTS elements (counted without overflow); -> the element count."""
    if len(dims) > MAX_DIMS:
        raise CodecError(f"{name}: {len(dims):,} dimensions; at most {MAX_DIMS}")
    dims = list(dims)
    if any(d < 0 for d in dims):
        raise CodecError(f"{name}: negative dimension in shape {dims}")
    count = math.prod(dims)
    if count > MAX_ELEMENTS:
        raise CodecError(f"{name}: shape {dims} has {count} elements, more than the limit {MAX_ELEMENTS}")
    return count


def dtype_of(array: np.ndarray) -> int:
    try:
        return _DTYPE_BY_NP[array.dtype.newbyteorder("=")]
    except KeyError:
        raise CodecError(
            f"unsupported dtype {array.dtype}; supported: {sorted(str(d) for d in _DTYPE_BY_NP)}"
        ) from None


def numpy_dtype(dtype: int, name: str = "dtype") -> np.dtype:
    try:
        return _NP_BY_DTYPE[dtype]
    except (KeyError, TypeError):
        raise CodecError(
            f"{name}: unknown or unset dtype {dtype} (expected one of {[DType.Name(d) for d in _NP_BY_DTYPE]})"
        ) from None


def _wire_array(array) -> tuple[int, np.ndarray]:
    """An array-like -> (its DType, a C-contiguous little-endian array of its values)."""
    if hasattr(array, "detach"):  # torch.Tensor
        array = array.detach().cpu().numpy()
    array = np.asarray(array)
    dtype = dtype_of(array)
    # (ascontiguousarray makes a 0-d array 1-d: the shape stays the caller's)
    return dtype, np.ascontiguousarray(array, dtype=_NP_BY_DTYPE[dtype]).reshape(array.shape)


def _fill(msg: Tensor, dtype: int, array: np.ndarray, ref=None) -> Tensor:
    msg.dtype = dtype
    msg.shape[:] = array.shape
    if ref is None:
        msg.data = array.tobytes()
        msg.ClearField("shared")
    else:
        msg.data = b""
        msg.shared.CopyFrom(ref)
    return msg


def encode(array, out: Tensor | None = None, *, arena=None) -> Tensor:
    """Encode an array-like (numpy, torch on CPU, python scalars/lists) into a Tensor message. ``arena`` (an
    ``rlfleet.wire.shm.Arena``, given only toward a receiver that accepted shared memory): an array of at least
    ``arena.min_bytes`` goes into shared memory and the message carries its handle (``shared``)."""
    dtype, array = _wire_array(array)
    msg = out if out is not None else Tensor()
    ref = None
    if arena is not None and array.nbytes >= arena.min_bytes:
        ref = arena.pack([array])[1][0]
    return _fill(msg, dtype, array, ref)


def decode(
    msg: Tensor,
    name: str = "tensor",
    *,
    shape: Sequence[int | None] | None = None,
    dtype: int | np.dtype | str | None = None,
    finite: bool = False,
    writable: bool = False,
    shm=None,
) -> np.ndarray:
    """Decode and validate a Tensor message.

    shape: expected shape; ``None`` entries are free (e.g. the batch dimension).
    dtype: expected dtype (DType enum value or numpy dtype).
    finite: reject NaN/inf (float dtypes only).
    writable: return a private, writable copy instead of a read-only view of the message bytes.
    shm: an ``rlfleet.wire.shm.Reader`` where this call takes shared-memory handles (``shared``): the bytes are
    checked and copied out of the sender's segment (a private array); without one a handle is refused.
    """
    if msg.dtype not in _NP_BY_DTYPE:
        raise CodecError(
            f"{name}: unknown or unset dtype {msg.dtype} (expected one of {[DType.Name(d) for d in _NP_BY_DTYPE]})"
        )
    count = check_shape(msg.shape, name)  # Python ints: [2**32, 2**32] must not wrap to 0
    dims = list(msg.shape)
    np_dtype = _NP_BY_DTYPE[msg.dtype]
    shared = msg.HasField("shared")
    data = b"" if shared else msg.data  # once: each access of a bytes field copies it
    if shared:
        if msg.data:
            raise CodecError(f"{name}: both data and a shared-memory handle (shared); a tensor has one or the other")
        if shm is None:
            raise CodecError(
                f"{name}.shared: a shared-memory handle where inline bytes (data) are expected (no "
                f"shared-memory handshake for this call, or cluster.shared_memory: inline)"
            )
    elif len(data) != count * np_dtype.itemsize:  # before anything is allocated for the claimed shape
        raise CodecError(
            f"{name}: {len(data)} data bytes do not match shape {dims} of "
            f"{DType.Name(msg.dtype)} ({count * np_dtype.itemsize} bytes expected)"
        )
    if dtype is not None:
        want = (
            dtype
            if isinstance(dtype, int) and not isinstance(dtype, bool)
            else _DTYPE_BY_NP.get(np.dtype(dtype).newbyteorder("="))
        )
        if want != msg.dtype:
            want_name = DType.Name(want) if want in _NP_BY_DTYPE else str(dtype)
            raise CodecError(f"{name}: dtype {DType.Name(msg.dtype)} where {want_name} was expected")
    if shape is not None:
        if len(shape) != len(dims) or any(s is not None and s != d for s, d in zip(shape, dims)):
            want = ["N" if s is None else s for s in shape]
            raise CodecError(f"{name}: shape {dims} where {want} was expected")
    if shared:  # a private copy, read only once every check of the handle passed
        array = shm.read(msg.shared, np_dtype, count, name).reshape(dims)
        writable = False
    else:
        array = np.frombuffer(data, dtype=np_dtype).reshape(dims)
    if finite and np_dtype.kind == "f" and not np.isfinite(array).all():
        bad = np.argwhere(~np.isfinite(array))[0].tolist()
        raise CodecError(f"{name}: non-finite value {array[tuple(bad)]} at index {bad}")
    return array.copy() if writable else array


def encode_map(arrays: Mapping[str, object], out: TensorMap | None = None, *, arena=None) -> TensorMap:
    """Encode named arrays; with ``arena`` (see :func:`encode`) those of at least ``arena.min_bytes`` go into one
    shared-memory message together."""
    msg = out if out is not None else TensorMap()
    wire = {key: _wire_array(value) for key, value in arrays.items()}
    refs: dict[str, object] = {}
    if arena is not None:
        big = [k for k, (_, a) in wire.items() if a.nbytes >= arena.min_bytes]
        if big:
            refs = dict(zip(big, arena.pack([wire[k][1] for k in big])[1]))
    for key, (dtype, array) in wire.items():
        _fill(msg.tensors[key], dtype, array, refs.get(key))
    return msg


def shared_bytes(msg: TensorMap) -> int:
    """Bytes a TensorMap's tensors carry by shared-memory handle."""
    return sum(t.shared.length for t in msg.tensors.values() if t.HasField("shared"))


def decode_map(
    msg: TensorMap,
    name: str = "tensors",
    *,
    specs: Mapping[str, TensorSpec] | None = None,
    batch: int | None = None,
    finite: bool = False,
    writable: bool = False,
    shm=None,
) -> dict[str, np.ndarray]:
    """Decode a TensorMap; with ``specs``, require exactly those keys, each shaped [batch, *spec.shape]. At most
    ``limits.MAX_TENSOR_MAP_ENTRIES`` entries (counted before any key is read)."""
    if len(msg.tensors) > limits.MAX_TENSOR_MAP_ENTRIES:
        raise CodecError(
            f"{name}: {len(msg.tensors):,} tensors; at most {limits.MAX_TENSOR_MAP_ENTRIES:,} "
            f"(rlfleet.wire.limits.MAX_TENSOR_MAP_ENTRIES)"
        )
    if specs is not None:
        missing = sorted(set(specs) - set(msg.tensors))
        extra = sorted(set(msg.tensors) - set(specs))
        if missing or extra:
            raise CodecError(
                f"{name}: keys {sorted(msg.tensors)} do not match the expected {sorted(specs)}"
                + (f" (missing {missing})" if missing else "")
                + (f" (unexpected {extra})" if extra else "")
            )
    out = {}
    for key, tensor in msg.tensors.items():
        kwargs = {}
        if specs is not None:
            spec = specs[key]
            kwargs = {"shape": [batch, *spec.shape], "dtype": spec.dtype}
        out[key] = decode(tensor, f"{name}[{key!r}]", finite=finite, writable=writable, shm=shm, **kwargs)
    return out


# --- The rollout schema: what an env server pushes (PushRollout) and what the learner takes ---------------------------
OBS = "obs."  # prefix of observation tensors
FI = "fi."  # prefix of forward-input tensors
NEXT_OBS = "next_obs."  # prefix of the observations after a rollout's last step, per env [N, ...]
FINAL_OBS = "final_obs."  # prefix of the final observations of the episodes that ended in the rollout [M, ...]
FINAL_INDEX = "final_index"  # [M] int64: the row t * N + n of each final observation, increasing


@dataclass(frozen=True)
class Field:
    dtype: type
    trailing: str  # the shape after [T, N]: "" none, "chunk,action_dim", "L" (log-prob width)
    required: bool = True
    doc: str = ""
    bound: float | None = None  # float fields: the largest magnitude accepted (|x| <= bound)


REWARD_BOUND = 1e4  # per step (a chunk's rewards summed): simulators here give at most ~10
VALUE_BOUND = 1e8  # critic outputs: returns of REWARD_BOUND rewards over 1 / (1 - gamma) = 1000 steps, x10
ACTION_BOUND = 1e6  # raw (unclipped) policy samples; envs clip to their O(1) bounds
LOG_PROB_BOUND = 1e6  # |log pi(a)| of one sample at any granularity
OBS_BOUND = 1e9  # float observation entries (obs.*): positions, velocities, forces in SI units
FI_BOUND = 1e6  # float forward inputs (fi.*): sampled actions, noise and denoising states

TIME_MAJOR: dict[str, Field] = {
    "actions": Field(np.float32, "chunk,action_dim", doc="the action chunk each env executed", bound=ACTION_BOUND),
    "log_probs": Field(
        np.float32, "L", doc="the behaviour policy's log-probs (algorithm.logprob_type)", bound=LOG_PROB_BOUND
    ),
    "values": Field(np.float32, "", doc="V(obs) at acting time (0 without a critic)", bound=VALUE_BOUND),
    "rewards": Field(np.float32, "", doc="reward of the step (a chunk's rewards summed)", bound=REWARD_BOUND),
    "terminated": Field(np.bool_, "", doc="the episode ended at this step"),
    "truncated": Field(np.bool_, "", doc="the episode was cut at this step (time limit)"),
    "loss_mask": Field(
        np.bool_,
        "",
        doc="the sample trains (false after an episode ended without auto-reset); at least one must be true",
    ),
    "weights_version": Field(np.int64, "", required=False, doc="the weights version the sample was acted with"),
}
# What the rollout carries beside its [T, N] rows, sent with its last chunk (the "tail"): the observations after the
# last step (``next_obs.<k>``, [N, ...]) and the final observation of every episode that ended during the rollout
# (``final_obs.<k>``, [M, ...], at rows ``final_index``). With them the learner has every transition's next
# observation (row t's is row t + 1's observation, or its final one where its episode ended, or next_obs after the
# last step): an algorithm bootstraps from them (PPO's V(final obs) of truncated episodes, SAC's targets) in the
# learner, with the weights it trains.


def is_tail(name: str) -> bool:
    """Whether rollout tensor ``name`` belongs to the tail (not [T, N, ...])."""
    return name == FINAL_INDEX or name.startswith((NEXT_OBS, FINAL_OBS))


def make_tail(
    next_obs: Mapping[str, np.ndarray], final_index=(), final_obs: Mapping[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """A rollout's tail from the observations after its last step ({key: [N, ...]}) and the final observations
    ({key: [M, ...]}) of the episodes that ended at rows ``final_index`` (t * N + n; none by default)."""
    tail = {FINAL_INDEX: np.asarray(final_index, np.int64).reshape(-1)}
    for k, v in next_obs.items():
        tail[f"{NEXT_OBS}{k}"] = np.asarray(v)
        tail[f"{FINAL_OBS}{k}"] = (
            np.asarray(final_obs[k]) if final_obs is not None else np.zeros((0, *np.shape(v)[1:]), np.asarray(v).dtype)
        )
    return tail


def bound_of(name: str) -> float | None:
    """The largest magnitude accepted in float tensor ``name`` (None: any finite value)."""
    f = TIME_MAJOR.get(name)
    if f is not None:
        return f.bound
    if name.startswith((OBS, NEXT_OBS, FINAL_OBS)):
        return OBS_BOUND
    if name.startswith(FI):
        return FI_BOUND
    return None


def _check_values(name: str, v: np.ndarray) -> None:
    """Float tensors: finite and within the field's bound, else a SchemaError naming the field and the place."""
    if v.dtype.kind != "f" or v.size == 0:
        return
    finite = np.isfinite(v)
    if not finite.all():
        where = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise SchemaError(f"rollout['{name}']: non-finite values (first: {v[where]} at index {list(where)})")
    bound = bound_of(name)
    if bound is None:
        return
    peak = float(np.abs(v).max())
    if peak > bound:
        where = tuple(int(i) for i in np.argwhere(np.abs(v) > bound)[0])
        raise SchemaError(
            f"rollout['{name}']: value {float(v[where]):.4g} at index {list(where)} is beyond the "
            f"schema's bound |x| <= {bound:g} (rlfleet/wire/codec.py)"
        )


@dataclass
class EpisodeStat:
    """The statistics of one ended episode: what env servers report (``EpisodeStats`` on the wire, converted by
    :func:`episode_to_proto`) and the learner logs. ``env_id`` is the env's index (in evaluation results: the
    episode's index)."""

    env_id: int
    episode_return: float
    length: int
    success_once: bool
    success_at_end: bool
    reset_state_id: int = -1
    instruction: str = ""


@dataclass
class Rollout:
    """One worker's epoch: time-major arrays [T, N, ...] plus its tail (next and final observations)."""

    time_major: dict[str, np.ndarray]
    tail: dict[str, np.ndarray]
    episodes: list = field(default_factory=list)  # EpisodeStat (env side) or EpisodeStats messages (learner)


def empty_buffers(T: int, n: int, observation_space: Mapping, alloc=None) -> dict[str, np.ndarray]:
    """The env side's buffers of an epoch: the observations and the fields whose shape the env alone decides
    (the policy's fields are added by :func:`add_policy_buffers` once its first answer shows their shapes).
    ``alloc``: {name: (shape, dtype)} -> {name: array}, where the observation buffers are to live (a shared-memory
    arena's :meth:`~rlfleet.wire.shm.Arena.buffers`; None: ordinary memory)."""
    layout = {f"{OBS}{k}": ((T, n, *sp.shape), np.dtype(sp.dtype)) for k, sp in observation_space.items()}
    buf = alloc(layout) if alloc is not None else {k: np.empty(s, dtype=d) for k, (s, d) in layout.items()}
    buf.update(
        values=np.zeros((T, n), np.float32),
        rewards=np.empty((T, n), np.float32),
        terminated=np.zeros((T, n), bool),
        truncated=np.zeros((T, n), bool),
        loss_mask=np.ones((T, n), bool),
        weights_version=np.full((T, n), -1, np.int64),
    )
    return buf


def add_policy_buffers(
    buf: dict[str, np.ndarray],
    T: int,
    n: int,
    actions: np.ndarray,
    log_probs: np.ndarray,
    forward_inputs: Mapping[str, np.ndarray],
) -> None:
    """Actions, log-probs and forward inputs, shaped like the policy's first answer (rows first)."""
    buf["actions"] = np.zeros((T, n, *actions.shape[1:]), np.float32)
    buf["log_probs"] = np.zeros((T, n, log_probs.shape[1]), np.float32)
    for k, v in forward_inputs.items():
        buf[f"{FI}{k}"] = np.zeros((T, n, *v.shape[1:]), v.dtype)


class SchemaError(ValueError):
    """A rollout breaks the schema; the message names the field."""


@dataclass(frozen=True)
class InputSpec:
    """The per-row shape and dtype of one forward input (what the policy's ``act`` returns for one row). A pushed
    forward input must have this shape and the same kind of dtype (float, integer, bool): the policy casts what it
    takes to its own precision (an fp64 learner takes fp32 inputs)."""

    shape: tuple[int, ...]
    dtype: str  # numpy dtype name


def _kind(dtype) -> str:
    return {"f": "float", "i": "integer", "u": "integer", "b": "bool"}.get(np.dtype(dtype).kind, np.dtype(dtype).name)


def check_rollout(
    time_major: Mapping[str, np.ndarray],
    tail: Mapping[str, np.ndarray],
    *,
    obs_specs: Mapping,
    chunk: int,
    action_dim: int,
    log_prob_width: int,
    logprob_type: str = "",
    fi_specs: Mapping[str, InputSpec] | None = None,
) -> tuple[int, int]:
    """Check a rollout against the schema and the policy's spaces -> (T, N). ``obs_specs``: {key: spec with
    ``shape`` and ``dtype``}; ``fi_specs``: {key: InputSpec}, the forward inputs the policy produces (None: any
    names and shapes)."""
    missing = [k for k, f in TIME_MAJOR.items() if f.required and k not in time_major]
    missing += [f"{OBS}{k}" for k in obs_specs if f"{OBS}{k}" not in time_major]
    missing += [f"{FI}{k}" for k in (fi_specs or {}) if f"{FI}{k}" not in time_major]
    missing += [f"{p}{k}" for p in (NEXT_OBS, FINAL_OBS) for k in obs_specs if f"{p}{k}" not in tail]
    missing += [FINAL_INDEX] if FINAL_INDEX not in tail else []
    if missing:
        raise SchemaError(f"rollout: missing tensors {missing}")
    unknown = [k for k in time_major if k not in TIME_MAJOR and not k.startswith((OBS, FI))]
    unknown += [f"{OBS}{k[len(OBS) :]}" for k in time_major if k.startswith(OBS) and k[len(OBS) :] not in obs_specs]
    if fi_specs is not None:
        unknown += [k for k in time_major if k.startswith(FI) and k[len(FI) :] not in fi_specs]
    unknown += [k for k in tail if not is_tail(k) or (k != FINAL_INDEX and k.split(".", 1)[1] not in obs_specs)]
    if unknown:
        raise SchemaError(
            f"rollout: unknown tensors {unknown} (the schema: {sorted(TIME_MAJOR)}, {OBS}*, {FI}*; its tail: "
            f"{NEXT_OBS}*, {FINAL_OBS}*, {FINAL_INDEX})"
        )
    if time_major["rewards"].ndim != 2:
        raise SchemaError(f"rollout['rewards']: shape {list(time_major['rewards'].shape)} where [T, N] was expected")
    T, N = time_major["rewards"].shape
    if T < 1 or N < 1:
        raise SchemaError(f"rollout: {T} time steps x {N} envs; a rollout needs at least one of each")
    trailing = {"": (), "chunk,action_dim": (chunk, action_dim), "L": (log_prob_width,)}
    for k, f in TIME_MAJOR.items():
        if k not in time_major:
            continue
        v = time_major[k]
        if v.dtype != f.dtype:
            raise SchemaError(f"rollout['{k}']: dtype {v.dtype.name} where {np.dtype(f.dtype).name} was expected")
        want = (T, N, *trailing[f.trailing])
        if v.shape != want:
            why = f" ({logprob_type})" if k == "log_probs" and logprob_type else ""
            raise SchemaError(f"rollout['{k}']: shape {list(v.shape)} where {list(want)} was expected{why}")
    for k, v in time_major.items():
        if v.shape[:2] != (T, N):
            raise SchemaError(f"rollout['{k}']: leading shape {list(v.shape[:2])} differs from rewards' {[T, N]}")
    if not any(k.startswith(FI) for k in time_major):
        raise SchemaError(f"rollout: no forward inputs ({FI}*): the learner cannot recompute log-probs")
    for k, spec in obs_specs.items():
        arr = time_major[f"{OBS}{k}"]
        if arr.shape[2:] != tuple(spec.shape) or arr.dtype.name != spec.dtype:
            raise SchemaError(
                f"rollout['{OBS}{k}']: {arr.dtype.name} {list(arr.shape)} where {spec.dtype} "
                f"[{T}, {N}, *{list(spec.shape)}] was expected"
            )
    for k, spec in (fi_specs or {}).items():
        arr = time_major[f"{FI}{k}"]
        if arr.shape[2:] != tuple(spec.shape) or _kind(arr.dtype) != _kind(spec.dtype):
            raise SchemaError(
                f"rollout['{FI}{k}']: {arr.dtype.name} {list(arr.shape)} where {_kind(spec.dtype)} "
                f"[{T}, {N}, *{list(spec.shape)}] was expected (the forward inputs this learner's "
                f"policy produces)"
            )
    for k, v in time_major.items():
        _check_values(k, v)
    if not time_major["loss_mask"].any():
        raise SchemaError(
            f"rollout['loss_mask']: all {T * N} samples are masked out; a rollout needs at least one sample that trains"
        )
    _check_tail(time_major, tail, obs_specs, T, N)
    return T, N


def _check_tail(time_major, tail, obs_specs, T: int, N: int) -> None:
    """The rollout's next and final observations: one per env after the last step, one per episode that ended."""
    index = tail[FINAL_INDEX]
    if index.dtype != np.int64 or index.ndim != 1:
        raise SchemaError(
            f"rollout['{FINAL_INDEX}']: {index.dtype.name} {list(index.shape)} where int64 [M] was expected"
        )
    M = len(index)
    if M and (index[0] < 0 or index[-1] >= T * N or (np.diff(index) <= 0).any()):
        raise SchemaError(
            f"rollout['{FINAL_INDEX}']: rows must increase within 0..{T * N - 1} (t * N + n); found {index[:8].tolist()}"
        )
    ended = (time_major["terminated"] | time_major["truncated"]).reshape(-1)
    if M and not ended[index].all():
        row = int(index[~ended[index]][0])
        raise SchemaError(
            f"rollout['{FINAL_INDEX}']: row {row} (t={row // N}, env {row % N}) has a final observation but its "
            f"episode did not end there"
        )
    cut = np.flatnonzero(time_major["truncated"].reshape(-1))
    if len(cut) and not np.isin(cut, index).all():
        row = int(cut[~np.isin(cut, index)][0])
        raise SchemaError(
            f"rollout['{FINAL_INDEX}']: the episode truncated at row {row} (t={row // N}, env {row % N}) has no final "
            f"observation; the learner bootstraps its value from it"
        )
    for k, spec in obs_specs.items():
        for name, lead in ((f"{NEXT_OBS}{k}", N), (f"{FINAL_OBS}{k}", M)):
            arr = tail[name]
            if arr.shape != (lead, *spec.shape) or arr.dtype.name != spec.dtype:
                raise SchemaError(
                    f"rollout['{name}']: {arr.dtype.name} {list(arr.shape)} where {spec.dtype} "
                    f"[{lead}, *{list(spec.shape)}] was expected"
                )
            _check_values(name, arr)


# --- Episodes: EpisodeStat <-> the EpisodeStats message ---------------------------------------------------------------
def episode_to_proto(ep) -> tensor_pb2.EpisodeStats:
    """:class:`EpisodeStat` -> EpisodeStats message."""
    return tensor_pb2.EpisodeStats(
        env_id=ep.env_id,
        length=ep.length,
        success_once=ep.success_once,
        success_at_end=ep.success_at_end,
        reset_state_id=ep.reset_state_id,
        instruction=ep.instruction,
        **{"return": ep.episode_return},
    )


def episode_from_proto(msg: tensor_pb2.EpisodeStats):
    """EpisodeStats message -> :class:`EpisodeStat` (as the message says it: the contract version's defaults are for
    the env side's bridge to external servers to apply)."""
    return EpisodeStat(
        msg.env_id,
        float(getattr(msg, "return")),
        msg.length,
        msg.success_once,
        msg.success_at_end,
        msg.reset_state_id,
        msg.instruction,
    )


def episode_return(ep) -> float:
    """Return of an EpisodeStats message (field 'return', a Python keyword) or an EpisodeStat."""
    return ep.episode_return if hasattr(ep, "episode_return") else getattr(ep, "return")


# --- The policy's output: PolicyOutput, what the policy's act returns for a batch of rows -----------------------------
@dataclass
class PolicyOutput:
    """One batch of ``n`` rows. Arrays are torch tensors where a policy produced them and numpy arrays once they
    leave the policy (``to_numpy``): what the inference server sends and the clients receive."""

    actions: Any  # [n, chunk, action_dim] float32
    log_probs: Any  # [n, L] float32, L by algorithm.logprob_type
    values: Any | None  # [n] float32, None when the policy has no critic
    forward_inputs: dict[str, Any] = field(default_factory=dict)  # [n, ...] each: what evaluate() needs
    weights_version: int = -1  # the weights that produced it (-1: not stamped, e.g. straight from a policy)

    def rows(self, start: int, end: int) -> PolicyOutput:
        """The output of rows [start, end) (one request's share of a batch)."""
        return PolicyOutput(
            self.actions[start:end],
            self.log_probs[start:end],
            None if self.values is None else self.values[start:end],
            {k: v[start:end] for k, v in self.forward_inputs.items()},
            self.weights_version,
        )

    def to_numpy(self, weights_version: int, rows: int | None = None) -> PolicyOutput:
        """A policy's (torch) output -> the numpy output of weights ``weights_version`` (actions, log-probs and
        values as float32), keeping the first ``rows`` rows (None: all of them; the rest is batch padding)."""

        def numpy(t):
            return t[:rows].detach().cpu().numpy()

        def floats(t):
            return numpy(t.float())

        return PolicyOutput(
            floats(self.actions),
            floats(self.log_probs),
            None if self.values is None else floats(self.values),
            {k: numpy(v) for k, v in self.forward_inputs.items()},
            weights_version,
        )


# --- The Act's per-row noise keys: reproducible sampling noise, keyed per env and step --------------------------------
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_U64 = (1 << 64) - 1
_GOLDEN_INT = int(_GOLDEN)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on a uint64 array (wrapping arithmetic: numpy's integer arrays wrap
    without a warning; a scalar or 0-d input goes through the warning-free path of a 1-element array). In place on
    one new array: a noise draw of an act runs this twice, and its temporaries and error-state switches were
    most of the draw's cost."""
    x = np.asarray(x, dtype=np.uint64)
    if x.ndim == 0:
        return _splitmix64(x.reshape(1))[0]
    z = x + _GOLDEN
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


def _mix(key: np.ndarray, value) -> np.ndarray:
    """Chain a value into a pseudorandom key. ``key + value`` (not a symmetric combination of two hashes, which
    would make (seed a, epoch b) collide with (seed b, epoch a)); splitmix64 is a bijection, so keys that differ
    before the finaliser differ after it. Counters step by the golden gamma, as in SplitMix64 itself."""
    if np.ndim(value) == 0:  # a scalar's step in Python's integers, modulo 2**64
        step = np.uint64((int(value) * _GOLDEN_INT) & _U64)
    else:
        step = np.asarray(value, dtype=np.uint64) * _GOLDEN
    key = np.asarray(key, dtype=np.uint64)
    if key.ndim == 0 and np.ndim(step) == 0:  # as a 1-element array: array arithmetic wraps without a warning
        return _splitmix64(key.reshape(1) + step)[0]
    return _splitmix64(key + step)


def row_keys(env_seeds: np.ndarray | Sequence[int], epoch: int, step: int) -> np.ndarray:
    """uint64 noise keys for rows whose envs have these seeds (one per env, unique in the run) at (epoch, step)."""
    seeds = np.asarray(env_seeds, dtype=np.int64).astype(np.uint64)
    return _mix(_mix(_splitmix64(seeds), np.uint64(epoch)), np.uint64(step))


class RowNoise:
    """Per-row noise streams: row i's draws are a function of ``keys[i]`` and of how many draws were made before.

    Each call to ``normal``/``uniform`` consumes the next block of the stream, so a policy that draws several
    times per act (a denoising chain) gets independent numbers each time, the same ones in every run."""

    def __init__(self, keys: np.ndarray | Sequence[int]):
        self.keys = np.asarray(keys, dtype=np.uint64).reshape(-1)
        self._calls = 0

    def __len__(self) -> int:
        return len(self.keys)

    def _bits(self, size: int) -> np.ndarray:
        """[n, size] uniform uint64 words for the next call."""
        self._calls += 1
        stream = _mix(self.keys, np.uint64(self._calls))[:, None]
        return _mix(stream, np.arange(size, dtype=np.uint64)[None, :])

    def uniform(self, shape: Sequence[int]) -> np.ndarray:
        """float64 [n, *shape] in the open interval (0, 1)."""
        size = int(np.prod(shape, dtype=np.int64))
        u = ((self._bits(size) >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
        return u.reshape(len(self.keys), *shape)

    def normal(self, shape: Sequence[int]) -> np.ndarray:
        """float32 [n, *shape] standard normal draws (Box-Muller on two uniform words per number)."""
        size = int(np.prod(shape, dtype=np.int64))
        u = self.uniform((2, size))
        z = np.sqrt(-2.0 * np.log(u[:, 0])) * np.cos(2.0 * np.pi * u[:, 1])
        return z.astype(np.float32).reshape(len(self.keys), *shape)

    def torch_normal(self, shape: Sequence[int], like):
        """``normal`` as a tensor on ``like``'s device and dtype."""
        import torch

        return torch.from_numpy(self.normal(shape)).to(device=like.device, dtype=like.dtype)

    def torch_uniform(self, shape: Sequence[int], like):
        import torch

        return torch.from_numpy(self.uniform(shape)).to(device=like.device, dtype=torch.float64)

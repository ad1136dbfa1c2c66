"""Tensor codec: numpy arrays <-> ``rlfleet.v1.Tensor`` messages, with validation of everything received.

Decoding never trusts the sender: dtype, shape, byte size, expected shape and finiteness are checked and a
``CodecError`` names the offending field. Servers turn it into INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from rlfleet.v1 import tensor_pb2

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
_DTYPE_BY_NP: dict[np.dtype, int] = {np.dtype(v).newbyteorder("="): k for k, v in _NP_BY_DTYPE.items()
                                     if k != DType.BFLOAT16}

MAX_ELEMENTS = 1 << 31


class CodecError(ValueError):
    """A received tensor is malformed or not what was expected; the message names the field."""


MAX_DIMS = 32


def check_shape(dims: Sequence[int], name: str) -> int:
    """A received shape: at most MAX_DIMS dimensions, none negative, at most MAX_ELEMENTS elements (counted
    without overflow); -> the element count."""
    dims = list(dims)
    if len(dims) > MAX_DIMS:
        raise CodecError(f"{name}: {len(dims)} dimensions; at most {MAX_DIMS}")
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
        raise CodecError(f"unsupported dtype {array.dtype}; supported: "
                         f"{sorted(str(d) for d in _DTYPE_BY_NP)}") from None


def numpy_dtype(dtype: int, name: str = "dtype") -> np.dtype:
    try:
        return _NP_BY_DTYPE[dtype]
    except (KeyError, TypeError):
        raise CodecError(f"{name}: unknown or unset dtype {dtype} "
                         f"(expected one of {[DType.Name(d) for d in _NP_BY_DTYPE]})") from None


def encode(array, out: Tensor | None = None) -> Tensor:
    """Encode an array-like (numpy, torch on CPU, python scalars/lists) into a Tensor message."""
    if hasattr(array, "detach"):  # torch.Tensor
        array = array.detach().cpu().numpy()
    array = np.asarray(array)
    dtype = dtype_of(array)
    msg = out if out is not None else Tensor()
    msg.dtype = dtype
    msg.shape[:] = array.shape
    msg.data = np.ascontiguousarray(array, dtype=_NP_BY_DTYPE[dtype]).tobytes()
    return msg


def decode(msg: Tensor, name: str = "tensor", *, shape: Sequence[int | None] | None = None,
           dtype: int | np.dtype | str | None = None, finite: bool = False, writable: bool = False) -> np.ndarray:
    """Decode and validate a Tensor message.

    shape: expected shape; ``None`` entries are free (e.g. the batch dimension).
    dtype: expected dtype (DType enum value or numpy dtype).
    finite: reject NaN/inf (float dtypes only).
    writable: return a private, writable copy instead of a read-only view of the message bytes.
    """
    if msg.dtype not in _NP_BY_DTYPE:
        raise CodecError(f"{name}: unknown or unset dtype {msg.dtype} "
                         f"(expected one of {[DType.Name(d) for d in _NP_BY_DTYPE]})")
    dims = list(msg.shape)
    check_shape(dims, name)
    count = math.prod(dims)  # Python ints: [2**32, 2**32] must not wrap to 0
    if count > MAX_ELEMENTS:
        raise CodecError(f"{name}: {count} elements is more than the limit {MAX_ELEMENTS}")
    np_dtype = _NP_BY_DTYPE[msg.dtype]
    if len(msg.data) != count * np_dtype.itemsize:
        raise CodecError(f"{name}: {len(msg.data)} data bytes do not match shape {dims} of "
                         f"{DType.Name(msg.dtype)} ({count * np_dtype.itemsize} bytes expected)")
    if dtype is not None:
        want = dtype if isinstance(dtype, int) and not isinstance(dtype, bool) else _DTYPE_BY_NP.get(
            np.dtype(dtype).newbyteorder("="))
        if want != msg.dtype:
            want_name = DType.Name(want) if want in _NP_BY_DTYPE else str(dtype)
            raise CodecError(f"{name}: dtype {DType.Name(msg.dtype)} where {want_name} was expected")
    if shape is not None:
        if len(shape) != len(dims) or any(s is not None and s != d for s, d in zip(shape, dims)):
            want = ["N" if s is None else s for s in shape]
            raise CodecError(f"{name}: shape {dims} where {want} was expected")
    array = np.frombuffer(msg.data, dtype=np_dtype).reshape(dims)
    if finite and np_dtype.kind == "f" and not np.isfinite(array).all():
        bad = np.argwhere(~np.isfinite(array))[0].tolist()
        raise CodecError(f"{name}: non-finite value {array[tuple(bad)]} at index {bad}")
    return array.copy() if writable else array


def encode_map(arrays: Mapping[str, object], out: TensorMap | None = None) -> TensorMap:
    msg = out if out is not None else TensorMap()
    for key, value in arrays.items():
        encode(value, msg.tensors[key])
    return msg


def decode_map(msg: TensorMap, name: str = "tensors", *, specs: Mapping[str, TensorSpec] | None = None,
               batch: int | None = None, finite: bool = False, writable: bool = False) -> dict[str, np.ndarray]:
    """Decode a TensorMap; with ``specs``, require exactly those keys, each shaped [batch, *spec.shape]."""
    if specs is not None:
        missing = sorted(set(specs) - set(msg.tensors))
        extra = sorted(set(msg.tensors) - set(specs))
        if missing or extra:
            raise CodecError(f"{name}: keys {sorted(msg.tensors)} do not match the expected {sorted(specs)}"
                             + (f" (missing {missing})" if missing else "") + (f" (unexpected {extra})" if extra else ""))
    out = {}
    for key, tensor in msg.tensors.items():
        kwargs = {}
        if specs is not None:
            spec = specs[key]
            kwargs = {"shape": [batch, *spec.shape], "dtype": spec.dtype}
        out[key] = decode(tensor, f"{name}[{key!r}]", finite=finite, writable=writable, **kwargs)
    return out


def episode_to_proto(ep) -> tensor_pb2.EpisodeStats:
    """rlfleet.wire.rollout_schema.EpisodeStat -> EpisodeStats message."""
    return tensor_pb2.EpisodeStats(env_id=ep.env_id, length=ep.length, success_once=ep.success_once,
                                   success_at_end=ep.success_at_end, reset_state_id=ep.reset_state_id,
                                   instruction=ep.instruction, **{"return": ep.episode_return})


def episode_from_proto(msg: tensor_pb2.EpisodeStats):
    """EpisodeStats message -> rlfleet.wire.rollout_schema.EpisodeStat (as the message says it: the contract
    version's defaults are for the env side's bridge to external servers to apply)."""
    from rlfleet.wire.rollout_schema import EpisodeStat

    return EpisodeStat(msg.env_id, float(getattr(msg, "return")), msg.length, msg.success_once, msg.success_at_end,
                       msg.reset_state_id, msg.instruction)


def episode_return(ep) -> float:
    """Return of an EpisodeStats message (field 'return', a Python keyword) or an EpisodeStat."""
    return ep.episode_return if hasattr(ep, "episode_return") else getattr(ep, "return")

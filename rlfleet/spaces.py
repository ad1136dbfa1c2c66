"""TensorSpace: rlfleet's one space type (shape, dtype, per-element bounds), like a gymnasium Box.

It converts to and from the wire's ``TensorSpec`` and from gymnasium spaces. Everything that describes an
observation entry or an action (env backends, VecEnv, EnvSpec, the conformance kit) uses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from rlfleet.v1 import tensor_pb2


@dataclass
class TensorSpace:
    shape: tuple[int, ...]
    dtype: np.dtype
    low: np.ndarray = field(default=None)   # per element, broadcast to shape
    high: np.ndarray = field(default=None)

    def __post_init__(self):
        self.shape = tuple(int(d) for d in self.shape)
        self.dtype = np.dtype(self.dtype)
        lo = -np.inf if self.low is None else self.low
        hi = np.inf if self.high is None else self.high
        self.low = np.broadcast_to(np.asarray(lo, np.float64), self.shape).copy()
        self.high = np.broadcast_to(np.asarray(hi, np.float64), self.shape).copy()
        if self.dtype == np.uint8:  # images: the dtype's own range
            self.low = np.maximum(self.low, 0)
            self.high = np.minimum(self.high, 255)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def bounded(self) -> bool:
        return bool(np.isfinite(self.low).all() and np.isfinite(self.high).all())

    def contains(self, batch: np.ndarray, atol: float = 1e-6) -> bool:
        """Every row of ``batch`` [n, *shape] within bounds (non-finite values are out)."""
        b = np.asarray(batch, np.float64)
        return bool(np.isfinite(b).all() and (b >= self.low - atol).all() and (b <= self.high + atol).all())

    # --- wire -------------------------------------------------------------------------------------------------
    def to_proto(self) -> tensor_pb2.TensorSpec:
        from rlfleet.codec import dtype_of

        spec = tensor_pb2.TensorSpec(dtype=dtype_of(np.zeros((), self.dtype)), shape=list(self.shape),
                                     low=float(self.low.min()) if self.size else 0.0,
                                     high=float(self.high.max()) if self.size else 0.0)
        if self.size and not (np.all(self.low == self.low.flat[0]) and np.all(self.high == self.high.flat[0])):
            spec.low_per_element.extend(self.low.ravel().tolist())
            spec.high_per_element.extend(self.high.ravel().tolist())
        return spec

    @classmethod
    def from_proto(cls, spec: tensor_pb2.TensorSpec) -> TensorSpace:
        from rlfleet.codec import numpy_dtype

        shape = tuple(int(d) for d in spec.shape)
        n = int(np.prod(shape, dtype=np.int64))
        if spec.low_per_element or spec.high_per_element:
            if len(spec.low_per_element) != n or len(spec.high_per_element) != n:
                raise ValueError(f"TensorSpec: low_per_element/high_per_element need {n} values for shape "
                                 f"{list(shape)}, got {len(spec.low_per_element)}/{len(spec.high_per_element)}")
            low = np.asarray(spec.low_per_element, np.float64).reshape(shape)
            high = np.asarray(spec.high_per_element, np.float64).reshape(shape)
        else:
            low, high = spec.low, spec.high
            if low == 0.0 and high == 0.0:  # unset bounds
                low, high = -np.inf, np.inf
        return cls(shape, numpy_dtype(spec.dtype), low, high)

    # --- gymnasium --------------------------------------------------------------------------------------------
    @classmethod
    def from_gym(cls, box) -> TensorSpace:
        return cls(tuple(box.shape), np.dtype(box.dtype), np.asarray(box.low, np.float64),
                   np.asarray(box.high, np.float64))


def spaces_from_gym(space) -> dict[str, TensorSpace]:
    """gymnasium Box or Dict(Box, ...) -> {name: TensorSpace}; a bare Box is named 'state'."""
    from gymnasium import spaces

    if isinstance(space, spaces.Dict):
        out = {}
        for key, sub in space.spaces.items():
            if not isinstance(sub, spaces.Box):
                raise TypeError(f"observation space {key!r}: only Box sub-spaces are supported, got {sub}")
            out[key] = TensorSpace.from_gym(sub)
        return out
    if isinstance(space, spaces.Box):
        return {"state": TensorSpace.from_gym(space)}
    raise TypeError(f"unsupported observation space {space}")


def spaces_to_proto(spaces: Mapping[str, TensorSpace]) -> dict[str, tensor_pb2.TensorSpec]:
    return {k: s.to_proto() for k, s in spaces.items()}


def spaces_from_proto(specs) -> dict[str, TensorSpace]:
    return {k: TensorSpace.from_proto(v) for k, v in specs.items()}

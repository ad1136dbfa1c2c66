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
    low: np.ndarray = field(default=None)  # per element, broadcast to shape
    high: np.ndarray = field(default=None)

    def __post_init__(self):
        self.shape = tuple(int(d) for d in self.shape)
        self.dtype = np.dtype(self.dtype)
        lo = np.asarray(-np.inf if self.low is None else self.low, np.float64)
        hi = np.asarray(np.inf if self.high is None else self.high, np.float64)
        if self.dtype == np.uint8:  # images: the dtype's own range
            lo, hi = np.maximum(lo, 0), np.minimum(hi, 255)
        # read-only views broadcast to the shape: a bound given once costs nothing, whatever the declared shape
        self.low, self.high = np.broadcast_to(lo, self.shape), np.broadcast_to(hi, self.shape)

    @property
    def is_image(self) -> bool:
        """A uint8 H x W x C entry (a camera)."""
        return self.dtype == np.uint8 and len(self.shape) == 3

    def _key(self) -> tuple:
        return (self.shape, self.dtype.str, _bound_key(self.low), _bound_key(self.high))

    def __eq__(self, other) -> bool:
        return isinstance(other, TensorSpace) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        lo, hi = _uniform(self.low), _uniform(self.high)
        if lo is None or hi is None:
            lo, hi = float(self.low.min()), float(self.high.max())
        bounds = "" if not self.size or not (np.isfinite(lo) or np.isfinite(hi)) else f", [{lo:g}, {hi:g}]"
        return f"TensorSpace({list(self.shape)}, {self.dtype.name}{bounds})"

    def to_json(self) -> dict:
        """A JSON form: a bound that is the same for every element once, else per element (infinities as JSON's
        Infinity)."""

        def bound(a):
            u = _uniform(a)
            return u if u is not None else a.ravel().tolist()

        return {"shape": list(self.shape), "dtype": self.dtype.name, "low": bound(self.low), "high": bound(self.high)}

    @classmethod
    def from_json(cls, data: Mapping) -> TensorSpace:
        shape = tuple(data["shape"])
        low, high = data.get("low"), data.get("high")

        def arr(b):
            a = np.asarray(b, np.float64)
            return a if a.ndim == 0 else a.reshape(shape)

        return cls(
            shape, np.dtype(data["dtype"]), None if low is None else arr(low), None if high is None else arr(high)
        )

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
        from rlfleet.wire.codec import dtype_of

        lo, hi = _uniform(self.low), _uniform(self.high)
        per_element = self.size and (lo is None or hi is None)
        if per_element:
            lo, hi = float(self.low.min()), float(self.high.max())
        spec = tensor_pb2.TensorSpec(
            dtype=dtype_of(np.zeros((), self.dtype)),
            shape=list(self.shape),
            low=lo if self.size else 0.0,
            high=hi if self.size else 0.0,
        )
        if per_element:
            spec.low_per_element.extend(self.low.ravel().tolist())
            spec.high_per_element.extend(self.high.ravel().tolist())
        return spec

    @classmethod
    def from_proto(cls, spec: tensor_pb2.TensorSpec, name: str = "TensorSpec") -> TensorSpace:
        """A TensorSpec received from a peer: its shape is checked (rank, sign, element count: codec.check_shape)
        before anything is built, and per-element bounds must have one value per element. The bounds are views
        (a bound given once costs nothing, whatever the shape). How large a space a consumer accepts is its own
        limit (rlfleet.wire.limits; the env contract's: env_contract.limit_problems)."""
        from rlfleet.wire.codec import check_shape, numpy_dtype

        n = check_shape(spec.shape, f"{name}.shape")
        shape = tuple(int(d) for d in spec.shape)
        if spec.low_per_element or spec.high_per_element:
            if len(spec.low_per_element) != n or len(spec.high_per_element) != n:
                raise ValueError(
                    f"TensorSpec: low_per_element/high_per_element need {n} values for shape "
                    f"{list(shape)}, got {len(spec.low_per_element)}/{len(spec.high_per_element)}"
                )
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
        return cls(
            tuple(box.shape), np.dtype(box.dtype), np.asarray(box.low, np.float64), np.asarray(box.high, np.float64)
        )


def _uniform(a: np.ndarray) -> float | None:
    """The one value of a bound that is the same for every element (a broadcast scalar: checked without reading
    the elements), else None."""
    if a.size == 0:
        return 0.0
    if all(st == 0 for st in a.strides) or (a.size <= 1 << 16 and bool(np.all(a == a.flat[0]))):
        return float(a.flat[0])
    return None


def _bound_key(a: np.ndarray):
    u = _uniform(a)
    return ("all", u) if u is not None else ("each", a.tobytes())


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


def spaces_from_proto(specs, field: str = "observation_space") -> dict[str, TensorSpace]:
    """{name: TensorSpec} (a protobuf map) -> {name: TensorSpace}; a bad shape or dtype is a CodecError naming
    ``field['name']``, and so are more than ``limits.MAX_OBS_ENTRIES`` entries (counted before any is read)."""
    from rlfleet.wire import limits
    from rlfleet.wire.codec import CodecError, check_shape, numpy_dtype

    if len(specs) > limits.MAX_OBS_ENTRIES:
        raise CodecError(
            f"{field}: {len(specs):,} entries; at most {limits.MAX_OBS_ENTRIES:,} ({limits.named('MAX_OBS_ENTRIES')})"
        )
    out = {}
    for k, v in specs.items():
        check_shape(v.shape, f"{field}['{k}']")
        numpy_dtype(v.dtype, f"{field}['{k}']")
        try:
            out[k] = TensorSpace.from_proto(v)
        except ValueError as exc:
            raise CodecError(f"{field}['{k}']: {exc}") from None
    return out


# --- runs whose env servers host different simulators ------------------------------------------------------------
def joint_spaces(
    named: Mapping[str, tuple[Mapping[str, TensorSpace], TensorSpace]],
) -> tuple[dict[str, TensorSpace], TensorSpace]:
    """The spaces one policy acts in when env servers host different simulators: ``named`` maps a label (e.g.
    ``env[1] libero:libero_spatial``) to that server's (observation space, action space).

    - observation entries: the union of the names; an entry several servers have must agree in dtype and rank,
      and images (rank 3) in shape; 1-D entries are zero-padded to the longest; a server without an entry sends
      zeros there;
    - actions: 1-D, one dtype, as long as the longest; a server with fewer dimensions executes the first ones
      and ignores the rest;
    - bounds: per element, the widest over the servers (and 0, where a server pads).

    Raises ValueError naming the entry and the servers that disagree."""
    labels = list(named)
    obs_out: dict[str, TensorSpace] = {}
    for key in sorted({k for obs, _ in named.values() for k in obs}):
        have = {lab: named[lab][0][key] for lab in labels if key in named[lab][0]}
        obs_out[key] = _joint_entry(f"observation '{key}'", have, padded=len(have) < len(labels))
    acts = {lab: named[lab][1] for lab in labels}
    bad = [lab for lab, sp in acts.items() if len(sp.shape) != 1]
    if bad:
        raise ValueError(
            f"action spaces: {bad[0]} has shape {list(acts[bad[0]].shape)}; servers hosting different "
            f"simulators need 1-D actions to share one policy"
        )
    return obs_out, _joint_entry("action", acts, padded=False)


def _joint_entry(what: str, have: Mapping[str, TensorSpace], padded: bool) -> TensorSpace:
    (first, sp0), *rest = have.items()
    for lab, sp in rest:
        if sp.dtype != sp0.dtype or len(sp.shape) != len(sp0.shape):
            raise ValueError(
                f"{what}: {first} has {sp0.dtype} {list(sp0.shape)} but {lab} has {sp.dtype} "
                f"{list(sp.shape)}; one policy needs one dtype and rank per entry"
            )
        if len(sp.shape) != 1 and sp.shape != sp0.shape:
            raise ValueError(
                f"{what}: {first} has shape {list(sp0.shape)} but {lab} has {list(sp.shape)}; only 1-D "
                f"entries are padded (give both simulators the same image size, e.g. "
                f"init_params.image_size)"
            )
    if len(sp0.shape) != 1:
        low = np.minimum.reduce([sp.low for sp in have.values()])
        high = np.maximum.reduce([sp.high for sp in have.values()])
        if padded:
            low, high = np.minimum(low, 0), np.maximum(high, 0)
        return TensorSpace(sp0.shape, sp0.dtype, low, high)
    n = max(sp.shape[0] for sp in have.values())
    low, high = np.full(n, np.inf), np.full(n, -np.inf)
    for sp in have.values():
        m = sp.shape[0]
        low[:m], high[:m] = np.minimum(low[:m], sp.low), np.maximum(high[:m], sp.high)
        if what != "action" and m < n:  # this server's rows are zero-padded there
            low[m:], high[m:] = np.minimum(low[m:], 0), np.maximum(high[m:], 0)
    if padded:
        low, high = np.minimum(low, 0), np.maximum(high, 0)
    return TensorSpace((n,), sp0.dtype, low, high)


def spaces_key(obs: Mapping[str, TensorSpace], action: TensorSpace) -> tuple:
    """A hashable identity of (observation spaces, action space): equal keys, equal spaces."""
    return (
        tuple((k, obs[k].to_proto().SerializeToString(deterministic=True)) for k in sorted(obs)),
        action.to_proto().SerializeToString(deterministic=True),
    )


def fit_check(
    own: Mapping[str, TensorSpace], own_action: TensorSpace, obs: Mapping[str, TensorSpace], action: TensorSpace
) -> None:
    """Raise ValueError unless an env with spaces (``own``, ``own_action``) can be seen in the policy's spaces
    (``obs``, ``action``) by padding: the inverse of what :func:`joint_spaces` allows."""
    for key, sp in own.items():
        want = obs.get(key)
        if want is None:
            raise ValueError(f"observation '{key}' is not among the policy's entries {sorted(obs)}")
        if (
            want.dtype != sp.dtype
            or len(want.shape) != len(sp.shape)
            or (len(sp.shape) != 1 and want.shape != sp.shape)
            or (len(sp.shape) == 1 and sp.shape[0] > want.shape[0])
        ):
            raise ValueError(
                f"observation '{key}': {sp.dtype} {list(sp.shape)} does not fit the policy's "
                f"{want.dtype} {list(want.shape)}"
            )
    if (
        len(own_action.shape) != 1
        or len(action.shape) != 1
        or own_action.shape[0] > action.shape[0]
        or own_action.dtype != action.dtype
    ):
        raise ValueError(
            f"action: {own_action.dtype} {list(own_action.shape)} does not fit the policy's "
            f"{action.dtype} {list(action.shape)}"
        )


def pad_observations(
    obs: Mapping[str, np.ndarray], spaces: Mapping[str, TensorSpace], rows: int
) -> dict[str, np.ndarray]:
    """Observation batches ``[rows, ...]`` in ``spaces``: 1-D entries zero-padded, missing entries zeros."""
    out = {}
    for key, sp in spaces.items():
        v = obs.get(key)
        if v is not None and v.shape[1:] == sp.shape:
            out[key] = v
            continue
        full = np.zeros((rows, *sp.shape), sp.dtype)
        if v is not None:
            full[:, : v.shape[1]] = v
        out[key] = full
    return out

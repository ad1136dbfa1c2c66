"""The rollout on the wire: one schema for what an env server pushes (``PushRollout``) and what the learner takes.

A worker's epoch is a :class:`Rollout`: time-major tensors ``[T, N, ...]`` (T steps of N envs) and per-env tensors
``[N]``, plus the episodes that ended. Its tensors, by name:

- the fixed fields of :data:`TIME_MAJOR` (dtype, and the shape after ``[T, N]``);
- ``obs.<key>``: each observation entry, as the env's observation space says;
- ``fi.<key>``: the forward inputs the learner needs to recompute the log-probs (the policy's ``forward_inputs``);
- ``last_values`` (:data:`PER_ENV`): V(obs after the last step) per env, in the last chunk of the stream.

The env side builds its buffers with :func:`empty_buffers`; the learner checks a pushed rollout with :func:`check`,
which names the first field that breaks the schema. numpy only: env servers run in simulator environments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

OBS = "obs."  # prefix of observation tensors
FI = "fi."    # prefix of forward-input tensors


@dataclass(frozen=True)
class Field:
    dtype: type
    trailing: str        # the shape after [T, N]: "" none, "chunk,action_dim", "L" (log-prob width)
    required: bool = True
    doc: str = ""


TIME_MAJOR: dict[str, Field] = {
    "actions": Field(np.float32, "chunk,action_dim", doc="the action chunk each env executed"),
    "log_probs": Field(np.float32, "L", doc="the behaviour policy's log-probs (algorithm.logprob_type)"),
    "values": Field(np.float32, "", doc="V(obs) at acting time (0 without a critic)"),
    "rewards": Field(np.float32, "", doc="reward of the step (a chunk's rewards summed)"),
    "terminated": Field(np.bool_, "", doc="the episode ended at this step"),
    "truncated": Field(np.bool_, "", doc="the episode was cut at this step (time limit)"),
    "bootstrap_values": Field(np.float32, "", doc="V(final obs) of a truncated episode's last step, else 0"),
    "loss_mask": Field(np.bool_, "", doc="the sample trains (false after an episode ended without auto-reset)"),
    "weights_version": Field(np.int64, "", required=False, doc="the weights version the sample was acted with"),
}
PER_ENV: dict[str, Field] = {"last_values": Field(np.float32, "", doc="V(obs after the last step)")}


@dataclass
class Rollout:
    """One worker's epoch: time-major arrays [T, N, ...] plus per-env arrays [N, ...]."""

    time_major: dict[str, np.ndarray]
    per_env: dict[str, np.ndarray]
    episodes: list = field(default_factory=list)


def empty_buffers(T: int, n: int, observation_space: Mapping) -> dict[str, np.ndarray]:
    """The env side's buffers of an epoch: the observations and the fields whose shape the env alone decides
    (the policy's fields are added by :func:`add_policy_buffers` once its first answer shows their shapes)."""
    buf = {f"{OBS}{k}": np.empty((T, n, *sp.shape), dtype=sp.dtype) for k, sp in observation_space.items()}
    buf.update(values=np.zeros((T, n), np.float32), rewards=np.empty((T, n), np.float32),
               terminated=np.zeros((T, n), bool), truncated=np.zeros((T, n), bool),
               bootstrap_values=np.zeros((T, n), np.float32), loss_mask=np.ones((T, n), bool),
               weights_version=np.full((T, n), -1, np.int64))
    return buf


def add_policy_buffers(buf: dict[str, np.ndarray], T: int, n: int, actions: np.ndarray, log_probs: np.ndarray,
                       forward_inputs: Mapping[str, np.ndarray]) -> None:
    """Actions, log-probs and forward inputs, shaped like the policy's first answer (rows first)."""
    buf["actions"] = np.zeros((T, n, *actions.shape[1:]), np.float32)
    buf["log_probs"] = np.zeros((T, n, log_probs.shape[1]), np.float32)
    for k, v in forward_inputs.items():
        buf[f"{FI}{k}"] = np.zeros((T, n, *v.shape[1:]), v.dtype)


class SchemaError(ValueError):
    """A rollout breaks the schema; the message names the field."""


def check(time_major: Mapping[str, np.ndarray], per_env: Mapping[str, np.ndarray], *, obs_specs: Mapping,
          chunk: int, action_dim: int, log_prob_width: int, logprob_type: str = "") -> tuple[int, int]:
    """Check a rollout against the schema and the policy's spaces -> (T, N). ``obs_specs``: {key: spec with
    ``shape`` and ``dtype``}."""
    missing = [k for k, f in TIME_MAJOR.items() if f.required and k not in time_major]
    missing += [f"{OBS}{k}" for k in obs_specs if f"{OBS}{k}" not in time_major]
    missing += [k for k in PER_ENV if k not in per_env]
    if missing:
        raise SchemaError(f"rollout: missing tensors {missing}")
    unknown = [k for k in time_major if k not in TIME_MAJOR and not k.startswith((OBS, FI))]
    unknown += [f"{OBS}{k[len(OBS):]}" for k in time_major if k.startswith(OBS) and k[len(OBS):] not in obs_specs]
    if unknown:
        raise SchemaError(f"rollout: unknown tensors {unknown} (the schema: {sorted(TIME_MAJOR)}, obs.*, fi.*)")
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
        if v.dtype.kind == "f" and not np.isfinite(v).all():
            raise SchemaError(f"rollout['{k}']: non-finite values")
    if not any(k.startswith(FI) for k in time_major):
        raise SchemaError(f"rollout: no forward inputs ({FI}*): the learner cannot recompute log-probs")
    for k, spec in obs_specs.items():
        arr = time_major[f"{OBS}{k}"]
        if arr.shape[2:] != tuple(spec.shape) or arr.dtype.name != spec.dtype:
            raise SchemaError(f"rollout['{OBS}{k}']: {arr.dtype.name} {list(arr.shape)} where {spec.dtype} "
                              f"[{T}, {N}, *{list(spec.shape)}] was expected")
    for k, f in PER_ENV.items():
        v = per_env[k]
        if v.dtype != f.dtype or not np.isfinite(v).all():
            raise SchemaError(f"rollout['{k}']: must be finite {np.dtype(f.dtype).name}")
        if v.shape != (N,):
            raise SchemaError(f"rollout['{k}']: shape {list(v.shape)} where [{N}] was expected")
    return T, N

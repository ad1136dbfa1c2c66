"""The off-policy algorithms' data store: a replay buffer of transitions, on every learner rank.

A transition is (obs, action, reward, next_obs, terminated, truncated) plus where it came from (the weights version
that acted, the env step it was collected at). Each field is one preallocated array of ``capacity`` rows in the
observation's own dtype (camera images stay uint8: 224x224x3 is 150 KB a row, not 600 KB), written as a ring: when
full, the oldest rows are overwritten.

On N learner ranks each rank holds its share: global transition i goes to rank i % N, so rank r keeps
``capacity // N`` rows and samples its part of each batch from them (its own generator, seeded by the run seed and
the rank). A checkpoint saves every rank's share as its own safetensors file with a JSON header (no pickle); a
resume loads them back, at the same world size, row for row (:meth:`digest` is the same hash before and after).

:func:`buffer_bytes` is what the start-up memory check counts before anything is allocated.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from collections.abc import Mapping

import numpy as np

from rlfleet.errors import InvalidRequest
from rlfleet.wire.spaces import TensorSpace

# the fields besides the observations: name -> (dtype, per-row shape given the action's dimension)
SCALARS = {
    "reward": np.float32,
    "terminated": np.bool_,  # the episode ended in a terminal state: no bootstrap from next_obs
    "truncated": np.bool_,  # the episode was cut off (time limit): next_obs is its final observation, bootstrapped
    "weights_version": np.int32,  # the policy version that chose the action (staleness = learner version - this)
}


def _fields(obs_specs: Mapping[str, TensorSpace], action_dim: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    out: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    for k, s in obs_specs.items():
        out[f"obs.{k}"] = (np.dtype(s.dtype), tuple(s.shape))
        out[f"next_obs.{k}"] = (np.dtype(s.dtype), tuple(s.shape))
    out["action"] = (np.dtype(np.float32), (int(action_dim),))
    for k, dt in SCALARS.items():
        out[k] = (np.dtype(dt), ())
    return out


def buffer_bytes(capacity: int, obs_specs: Mapping[str, TensorSpace], action_dim: int, world_size: int = 1) -> int:
    """Bytes one rank's share of a buffer of ``capacity`` transitions takes (the start-up memory check's figure)."""
    rows = max(1, int(capacity) // max(1, int(world_size)))
    return sum(
        rows * dt.itemsize * int(np.prod(shape, dtype=np.int64))
        for dt, shape in _fields(obs_specs, action_dim).values()
    )


class ReplayBuffer:
    """This rank's share of the run's replay buffer (see the module's doc)."""

    def __init__(
        self,
        capacity: int,
        obs_specs: Mapping[str, TensorSpace],
        action_dim: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if int(capacity) < world_size:
            raise InvalidRequest(
                f"algorithm.replay_capacity: {capacity} transitions cannot be shared by {world_size} ranks"
            )
        self.capacity = int(capacity) // world_size  # this rank's rows
        self.rank, self.world_size = int(rank), int(world_size)
        self.obs_specs, self.action_dim = dict(obs_specs), int(action_dim)
        self.fields = _fields(obs_specs, action_dim)
        self.data = {k: np.zeros((self.capacity, *shape), dtype=dt) for k, (dt, shape) in self.fields.items()}
        self.size = 0  # rows filled
        self.next_row = 0  # where the next row goes
        self.seen = 0  # transitions offered to the whole buffer (every rank's count alike): the global index
        self.seed = int(seed)
        self._rng = np.random.default_rng([self.seed, self.rank])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.data.values())

    def __len__(self) -> int:
        return self.size

    # --- writing ------------------------------------------------------------------------------------------------
    def add(self, batch: Mapping[str, np.ndarray]) -> int:
        """Offer ``batch`` (every field, rows first; the same batch on every rank): this rank keeps the rows whose
        global index falls to it. -> rows kept here. Shapes and dtypes are checked against the buffer's, naming the
        field."""
        n = None
        for k, (dt, shape) in self.fields.items():
            if k not in batch:
                raise InvalidRequest(f"replay: transition field '{k}' is missing (got {sorted(batch)})")
            a = np.asarray(batch[k])
            if n is None:
                n = len(a)
            if a.shape != (n, *shape):
                raise InvalidRequest(f"replay: field '{k}' has shape {list(a.shape)}, expected {[n, *shape]}")
            if a.dtype != dt and not np.can_cast(a.dtype, dt, "same_kind"):
                raise InvalidRequest(f"replay: field '{k}' has dtype {a.dtype}, expected {dt}")
        extra = sorted(set(batch) - set(self.fields))
        if extra:
            raise InvalidRequest(f"replay: unknown transition fields {extra}")
        if not np.isfinite(np.asarray(batch["reward"], np.float64)).all():
            raise InvalidRequest("replay: field 'reward' holds NaN or inf")
        if not np.isfinite(np.asarray(batch["action"], np.float64)).all():
            raise InvalidRequest("replay: field 'action' holds NaN or inf")
        n = int(n or 0)
        mine = np.nonzero((self.seen + np.arange(n)) % self.world_size == self.rank)[0]
        self.seen += n
        for i in range(0, len(mine), self.capacity):  # a batch larger than the share: only its last rows survive
            part = mine[i : i + self.capacity]
            rows = (self.next_row + np.arange(len(part))) % self.capacity
            for k, a in self.data.items():
                a[rows] = np.asarray(batch[k])[part]
            self.next_row = int((self.next_row + len(part)) % self.capacity)
            self.size = min(self.capacity, self.size + len(part))
        return len(mine)

    # --- reading ------------------------------------------------------------------------------------------------
    def sample(self, n: int) -> dict[str, np.ndarray]:
        """``n`` rows of this rank's share, uniformly with replacement (copies)."""
        if self.size == 0:
            raise InvalidRequest("replay: sampling from an empty buffer")
        idx = self._rng.integers(0, self.size, int(n))
        return {k: a[idx] for k, a in self.data.items()}

    def digest(self) -> str:
        """A hash of this rank's filled rows in storage order and its counters: equal before a save and after its
        load."""
        h = hashlib.sha256(json.dumps([self.size, self.next_row, self.seen, self.capacity]).encode())
        for k in sorted(self.data):
            h.update(k.encode())
            h.update(np.ascontiguousarray(self.data[k][: self.size]).tobytes())
        return h.hexdigest()

    def staleness(self, version: int) -> np.ndarray:
        """Per stored row: how many weights versions behind ``version`` its action's policy was."""
        return version - self.data["weights_version"][: self.size]

    # --- checkpoint ---------------------------------------------------------------------------------------------
    def file_name(self) -> str:
        return f"replay_rank{self.rank:03d}_of_{self.world_size:03d}.safetensors"

    def save(self, folder: str | pathlib.Path, extra: Mapping[str, int] | None = None) -> pathlib.Path:
        """This rank's share to ``folder`` (safetensors: the filled rows; the counters, the sampler's state and the
        caller's ``extra`` integers in its header)."""
        from safetensors.numpy import save_file

        path = pathlib.Path(folder) / self.file_name()
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "size": self.size,
            "next_row": self.next_row,
            "seen": self.seen,
            "capacity": self.capacity,
            "world_size": self.world_size,
            "rng": self._rng.bit_generator.state,
            "extra": {k: int(v) for k, v in (extra or {}).items()},
        }
        tensors = {k: np.ascontiguousarray(a[: self.size]) for k, a in self.data.items()}
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"rlfleet_replay": json.dumps(meta)})
        tmp.replace(path)
        return path

    def load(self, folder: str | pathlib.Path, root: str | pathlib.Path | None = None) -> dict[str, int]:
        """This rank's share back from ``folder`` (what :meth:`save` wrote at the same world size) -> the ``extra``
        integers saved with it. The file is hostile until checked: its header is read bounded and checked
        (rlfleet.untrusted.safetensors_header: nothing outside ``root``, default ``folder``), then every field's
        dtype and shape against this buffer's, the counters against its share; any mismatch is a BadFile naming the
        file and the field, before a row is copied."""
        from safetensors import safe_open

        from rlfleet.untrusted import BadFile, safetensors_header

        path = pathlib.Path(folder) / self.file_name()
        if not path.exists():
            raise BadFile(
                path, "file", f"this rank's share of the replay buffer (saved by {self.world_size} ranks)", "missing"
            )
        header = safetensors_header(path, root=root if root is not None else folder)
        with safe_open(str(path), framework="numpy") as f:
            try:
                meta = json.loads((f.metadata() or {})["rlfleet_replay"])
                size, next_row, seen = int(meta["size"]), int(meta["next_row"]), int(meta["seen"])
                extra = {str(k): int(v) for k, v in dict(meta.get("extra") or {}).items()}
            except (KeyError, ValueError, TypeError, AttributeError) as exc:
                raise BadFile(path, "header rlfleet_replay", "the replay buffer's counters", repr(exc)[:80]) from None
            if int(meta.get("capacity", -1)) != self.capacity or not 0 <= size <= self.capacity:
                raise BadFile(
                    path,
                    "capacity",
                    f"a share of {self.capacity} rows (algorithm.replay_capacity / learner ranks)",
                    f"{meta.get('capacity')} rows holding {size}",
                )
            if not 0 <= next_row < max(1, self.capacity) or seen < size:
                raise BadFile(
                    path, "counters", f"next row in [0, {self.capacity}), seen >= size", f"{next_row}, {seen}"
                )
            if sorted(header) != sorted(self.data):
                raise BadFile(path, "fields", str(sorted(self.data)), str(sorted(header))[:200])
            for k, a in self.data.items():
                want = [size, *a.shape[1:]]
                if header[k]["shape"] != want:
                    raise BadFile(path, f"field '{k}' shape", str(want), str(header[k]["shape"]))
                t = f.get_tensor(k)
                if t.dtype != a.dtype:
                    raise BadFile(path, f"field '{k}' dtype", str(a.dtype), str(t.dtype))
                a[:size] = t
        self.size, self.next_row, self.seen = size, next_row, seen
        rng = meta.get("rng")
        if isinstance(rng, dict):
            try:
                self._rng.bit_generator.state = rng
            except (KeyError, ValueError, TypeError) as exc:
                raise BadFile(path, "header rng", "the sampler's state", repr(exc)[:80]) from None
        return extra

"""Rollout intake: validate each worker's pushed rollout and hold it until its epoch trains (rank 0)."""

from __future__ import annotations

import threading

import numpy as np

from rlfleet.rpc import FailedPrecondition, InvalidRequest

REQUIRED = ("actions", "log_probs", "values", "rewards", "terminated", "truncated", "bootstrap_values", "loss_mask")
ROLLOUT_DTYPES = {"actions": np.float32, "log_probs": np.float32, "values": np.float32, "rewards": np.float32,
                  "bootstrap_values": np.float32, "terminated": np.bool_, "truncated": np.bool_, "loss_mask": np.bool_,
                  "weights_version": np.int64}  # optional: the weights version each sample was acted with


class RolloutStore:
    """Committed rollouts per (epoch, worker), checked against the policy's spaces before they are kept."""

    def __init__(self, alg):
        self.alg = alg
        self.epoch = -1          # last trained epoch (the learner moves it)
        self.obs_specs = None    # the policy's spaces (set once the policy exists)
        self.action_dim = None
        self.chunk = 1           # actions per sample (num_action_chunks)
        self.log_prob_width = 1  # log-probs per sample
        self.pending: dict[tuple[int, int], dict] = {}
        self.lock = threading.Lock()  # async mode: rollouts of epoch k+1 arrive while epoch k trains

    def check_rollout_epoch(self, epoch: int) -> None:
        """Rollouts are accepted for the next epochs only (the one being trained and those the envs may collect
        ahead of it, algorithm.max_staleness): nothing piles up for far-off ones."""
        ahead = max(2, self.alg.max_staleness + 1)
        if not self.epoch < epoch <= self.epoch + ahead:
            raise InvalidRequest(f"epoch: a rollout for epoch {epoch}; this learner trained epoch {self.epoch} and "
                                 f"accepts epochs {self.epoch + 1}..{self.epoch + ahead}")

    def receive(self, epoch: int, worker: int, time_major: dict[str, np.ndarray], per_env: dict[str, np.ndarray],
                episodes: list) -> tuple[int, int]:
        """Validate and store one worker's complete rollout for ``epoch`` (replaces an earlier one)."""
        if self.obs_specs is None:
            raise FailedPrecondition("the learner has no policy yet (PublishWeights with the env spec first)")
        self.check_rollout_epoch(epoch)
        missing = [k for k in REQUIRED if k not in time_major]
        missing += [f"obs.{k}" for k in self.obs_specs if f"obs.{k}" not in time_major]
        if missing or "last_values" not in per_env:
            raise InvalidRequest(f"rollout: missing tensors {missing or ['last_values']}")
        if time_major["rewards"].ndim != 2:
            raise InvalidRequest(f"rollout['rewards']: shape {list(time_major['rewards'].shape)} where [T, N] was expected")
        T, N = time_major["rewards"].shape
        if T < 1 or N < 1:
            raise InvalidRequest(f"rollout: {T} time steps x {N} envs; a rollout needs at least one of each")
        for k, want in ROLLOUT_DTYPES.items():
            if k in time_major and time_major[k].dtype != want:
                raise InvalidRequest(f"rollout['{k}']: dtype {time_major[k].dtype.name} where {np.dtype(want).name} "
                                     f"was expected")
        for k, v in time_major.items():
            if v.shape[:2] != (T, N):
                raise InvalidRequest(f"rollout['{k}']: leading shape {list(v.shape[:2])} differs from rewards' {[T, N]}")
            if v.dtype.kind == "f" and not np.isfinite(v).all():
                raise InvalidRequest(f"rollout['{k}']: non-finite values")
        chunk = self.chunk
        if time_major["actions"].shape[2:] != (chunk, self.action_dim):
            raise InvalidRequest(f"rollout['actions']: shape {list(time_major['actions'].shape)} where "
                                 f"[{T}, {N}, {chunk}, {self.action_dim}] was expected")
        L = self.log_prob_width
        if time_major["log_probs"].shape[2:] != (L,):
            raise InvalidRequest(f"rollout['log_probs']: shape {list(time_major['log_probs'].shape)} where "
                                 f"[{T}, {N}, {L}] was expected ({self.alg.logprob_type})")
        if not any(k.startswith("fi.") for k in time_major):
            raise InvalidRequest("rollout: no forward inputs (fi.*): the learner cannot recompute log-probs")
        for k, spec in self.obs_specs.items():
            arr = time_major[f"obs.{k}"]
            if arr.shape[2:] != spec.shape or arr.dtype.name != spec.dtype:
                raise InvalidRequest(f"rollout['obs.{k}']: {arr.dtype.name} {list(arr.shape)} where {spec.dtype} "
                                     f"[{T}, {N}, *{list(spec.shape)}] was expected")
        if per_env["last_values"].dtype != np.float32 or not np.isfinite(per_env["last_values"]).all():
            raise InvalidRequest("rollout['last_values']: must be finite float32")
        if per_env["last_values"].shape != (N,):
            raise InvalidRequest(f"rollout['last_values']: shape {list(per_env['last_values'].shape)} where [{N}] was expected")
        with self.lock:
            self.pending[(epoch, worker)] = {"time": time_major, "env": per_env, "episodes": episodes}
        return T, N

    def take(self, epoch: int, workers: list[int]) -> list[dict]:
        """The rollouts of ``epoch`` from ``workers`` (in worker order), removed; stale leftovers are dropped."""
        with self.lock:
            absent = [w for w in workers if (epoch, w) not in self.pending]
            if absent or not workers:
                raise FailedPrecondition(f"epoch {epoch}: no committed rollout from worker(s) {absent or workers}")
            parts = [self.pending.pop((epoch, w)) for w in sorted(workers)]
            self.pending = {k: v for k, v in self.pending.items() if k[0] > epoch}
        return parts

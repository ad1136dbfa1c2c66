"""Rollout intake: check each worker's pushed rollout against the rollout schema (rlfleet/rollout_schema.py) and
the policy's spaces, and hold it until its epoch trains (rank 0)."""

from __future__ import annotations

import threading

import numpy as np

from rlfleet import rollout_schema
from rlfleet.rpc import FailedPrecondition, InvalidRequest


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
        try:
            T, N = rollout_schema.check(time_major, per_env, obs_specs=self.obs_specs, chunk=self.chunk,
                                        action_dim=self.action_dim, log_prob_width=self.log_prob_width,
                                        logprob_type=self.alg.logprob_type)
        except rollout_schema.SchemaError as exc:
            raise InvalidRequest(str(exc)) from None
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

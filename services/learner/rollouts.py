"""Rollout intake: check each worker's pushed rollout against the rollout schema (rlfleet/wire/codec.py) and
the policy's spaces, and hold it until its epoch trains (rank 0).

Only the run's workers are buffered: worker indices 0..num_workers-1, where num_workers starts at the config's
``cluster.num_env_servers`` and follows the run's scale (``coordinatorctl scale env N``): every Train names the
current workers, and a push from an index beyond the known scale (a scale-up's new server, whose first rollout
arrives before the Train that names it) is checked with the coordinator, which the learner asks how many env
servers the run has (``scale_probe``; without a coordinator: refused).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from rlfleet.errors import FailedPrecondition, InvalidRequest, PermissionDenied
from rlfleet.wire import codec

log = logging.getLogger("rlfleet.learner")


def forward_input_specs(model, obs_specs, device="cpu") -> dict[str, codec.InputSpec] | None:
    """The forward inputs ``model`` produces per row (name -> shape, dtype), from one ``act`` on a dummy row (zero
    observations, an empty instruction). Runs outside torch's global random stream (forked), so it changes
    nothing that follows; call it on the whole (unsharded) policy."""
    import torch

    from rlfleet.policies.models.actor_critic import to_torch_obs

    obs = to_torch_obs({k: np.zeros((1, *s.shape), np.dtype(s.dtype)) for k, s in obs_specs.items()})
    dev = torch.device(device)
    try:
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.no_grad(), model.precision():
            out = model.act({k: v.to(dev) for k, v in obs.items()}, False, [""])
    except Exception as exc:  # noqa: BLE001 - a policy that cannot act on a dummy row: forward inputs unchecked
        log.warning(
            "forward inputs of %s unknown (a dummy act failed: %s); rollouts' fi.* shapes are not checked",
            type(model).__name__,
            exc,
        )
        return None
    specs = {}
    for k, v in out.forward_inputs.items():
        arr = v.detach()
        dtype = torch.float32 if arr.dtype in (torch.bfloat16, torch.float16) else arr.dtype
        specs[k] = codec.InputSpec(tuple(arr.shape[1:]), str(torch.empty((), dtype=dtype).numpy().dtype))
    return specs


def policy_inputs(rows: dict, idx) -> tuple[dict, dict]:
    """The policy's inputs of rows ``idx`` of flat rollout rows: (observations, forward inputs), prefixes removed."""
    obs = {k[len(codec.OBS) :]: v[idx] for k, v in rows.items() if k.startswith(codec.OBS)}
    fi = {k[len(codec.FI) :]: v[idx] for k, v in rows.items() if k.startswith(codec.FI)}
    return obs, fi


class RolloutStore:
    """Committed rollouts per (epoch, worker), checked against the policy's spaces before they are kept."""

    PROBE_INTERVAL_S = 1.0  # at most one question to the coordinator per second (an unknown index is refused)

    def __init__(self, alg, num_workers: int = 1):
        self.alg = alg
        self.epoch = -1  # last trained epoch (the learner moves it)
        self.obs_specs = None  # the policy's spaces (set once the policy exists)
        self.action_dim = None
        self.chunk = 1  # actions per sample (num_action_chunks)
        self.log_prob_width = 1  # log-probs per sample
        self.fi_specs: dict[str, codec.InputSpec] | None = None  # forward inputs the policy produces
        self.num_workers = max(1, int(num_workers))  # the run's env servers, as far as this learner knows
        self.scale_probe: Callable[[], int | None] | None = None  # -> the coordinator's env server count
        self._probed_at = -float("inf")
        self.pending: dict[tuple[int, int], dict] = {}
        self.lock = threading.Lock()  # async mode: rollouts of epoch k+1 arrive while epoch k trains
        self.refusal: str | None = None  # set: every rollout is refused with it (an evaluation's learner)

    def set_workers(self, workers: list[int]) -> None:
        """Train names the run's current workers: that is its scale from now on."""
        if workers:
            self.num_workers = max(workers) + 1

    @staticmethod
    def check_pusher(worker: int, caller) -> None:
        """A rollout is its worker's own: the env server that pushes it is the one whose index its credential
        proves (``caller``, rlfleet.wire.callers.caller_of; None: no credentials in this process). Every placement has
        one env server process per worker index (a bridge to an external simulator included: env server i bridges
        ``cluster.external_env_addresses[i]``), so no process pushes another's rollout."""
        if caller is not None and caller.index != worker:
            raise PermissionDenied(
                f"worker_index: {caller} pushed the rollout of worker {worker}; an env server "
                f"pushes only its own (worker {caller.index})"
            )

    def check_worker(self, worker: int) -> None:
        """Only the run's workers' rollouts are buffered (a rollout is tens of MB: made-up indices would pile
        them up until the next Train)."""
        if 0 <= worker < self.num_workers:
            return
        if worker > 0 and self.scale_probe is not None and time.monotonic() - self._probed_at >= self.PROBE_INTERVAL_S:
            self._probed_at = time.monotonic()
            try:
                count = self.scale_probe()
            except Exception as exc:  # noqa: BLE001 - the coordinator unreachable: keep the known scale
                log.warning("could not ask the coordinator for the run's env servers: %s", exc)
                count = None
            if count:
                self.num_workers = max(self.num_workers, int(count))
                if worker < self.num_workers:
                    return
        raise InvalidRequest(
            f"worker_index: {worker} is not one of this run's env servers "
            f"(0..{self.num_workers - 1}: cluster.num_env_servers, or the run's scale)"
        )

    def check_rollout_epoch(self, epoch: int) -> None:
        """Rollouts are accepted for the next epochs only (the one being trained and those the envs may collect
        ahead of it, algorithm.max_staleness): nothing piles up for far-off ones."""
        if self.refusal:
            raise FailedPrecondition(self.refusal)
        ahead = max(2, self.alg.max_staleness + 1)
        if not self.epoch < epoch <= self.epoch + ahead:
            raise InvalidRequest(
                f"epoch: a rollout for epoch {epoch}; this learner trained epoch {self.epoch} and "
                f"accepts epochs {self.epoch + 1}..{self.epoch + ahead}"
            )

    def receive(
        self, epoch: int, worker: int, time_major: dict[str, np.ndarray], tail: dict[str, np.ndarray], episodes: list
    ) -> tuple[int, int]:
        """Validate and store one worker's complete rollout for ``epoch`` (replaces an earlier one)."""
        if self.obs_specs is None:
            raise FailedPrecondition("the learner has no policy yet (PublishWeights with the env spec first)")
        self.check_rollout_epoch(epoch)
        self.check_worker(worker)
        try:
            T, N = codec.check_rollout(
                time_major,
                tail,
                obs_specs=self.obs_specs,
                chunk=self.chunk,
                action_dim=self.action_dim,
                log_prob_width=self.log_prob_width,
                logprob_type=self.alg.logprob_type,
                fi_specs=self.fi_specs,
            )
        except codec.SchemaError as exc:
            raise InvalidRequest(str(exc)) from None
        with self.lock:
            self.pending[(epoch, worker)] = {"time": time_major, "tail": tail, "episodes": episodes}
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

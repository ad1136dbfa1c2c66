"""PolicyRunner: runs a rollout worker's calls (Collect, Evaluate) with the policy clients they need, and recovers
from an external simulator that dies under them.

- The policy clients (Act streams to the inference servers) are kept open across calls while the inference
  addresses, the number of pipeline stages and the action width stay the same; any failure drops them, so the
  next call starts with clean streams (they may hold unanswered requests).
- An external simulator that is lost (``EnvConnectionLost``: it died, restarted, or answered as a failed simulator
  does) costs the episodes in flight: the runner waits for it to come back (``reconnect``), starts fresh episodes
  and runs the call again. A simulator that is up but answers as a failed one is handled this way
  MAX_SIMULATOR_FAULTS times in one call; the next one ends the call, and the run, with its reason
  (docs/env-contract.md#what-rlfleet-does-with-your-server).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from rlfleet.wire import rpc
from rlfleet.wire.clients.policy import make_policy_client
from services.env.remote import MAX_SIMULATOR_FAULTS, EnvConnectionLost
from services.env.rollout import RolloutWorker

T = TypeVar("T")


class PolicyRunner:
    def __init__(self, worker: RolloutWorker, index: int, *, act_timeout_s: float = 120.0,
                 reconnect_timeout_s: float = 120.0):
        self.worker, self.index = worker, index
        self.act_timeout_s, self.reconnect_timeout_s = act_timeout_s, reconnect_timeout_s
        self._policy = None  # Act streams kept open across calls: (addresses, stages, action width) -> client
        self._policy_key = None

    def policy_for(self, addresses: Sequence[str], stages: int):
        """The policy client for these inference servers and stages (the open one when they are the same)."""
        key = (tuple(addresses), stages, self.worker.action_dim)
        if self._policy_key != key:
            self.drop_policy()
            self._policy = make_policy_client(list(addresses), stages, self.worker.action_dim, self.act_timeout_s)
            self._policy_key = key
        return self._policy

    def drop_policy(self) -> None:
        if self._policy is not None:
            self._policy.close()
        self._policy = self._policy_key = None

    def run(self, addresses: Sequence[str], run: Callable[[object], T],
            after_loss: Callable[[], object] | None = None) -> tuple[T, int]:
        """``run(policy)`` with the policy client of ``addresses``; when an external simulator dies under it, wait
        for the simulator to come back (the episodes in flight are lost), call ``after_loss`` (fresh episodes) and
        run again. -> (result, episodes lost)."""
        lost = faults = 0
        restarting = False  # the episodes were lost: start fresh ones (after_loss) before running again
        while True:
            policy = self.policy_for(list(addresses), self.worker.num_stages)
            try:
                if restarting and after_loss is not None:
                    after_loss()
                restarting = False
                return run(policy), lost
            except EnvConnectionLost as exc:
                self.drop_policy()
                faults += exc.answered
                if faults > MAX_SIMULATOR_FAULTS:
                    raise rpc.InvalidRequest(f"{exc} (simulator failure {faults} in one call; after "
                                             f"{MAX_SIMULATOR_FAULTS} the run stops)") from None
                if not restarting:
                    print(f"env[{self.index}]: {exc}; its {exc.env.num_envs} episodes in flight are lost", flush=True)
                    lost += exc.env.num_envs
                else:
                    print(f"env[{self.index}]: {exc} (while starting fresh episodes)", flush=True)
                exc.env.reconnect(self.reconnect_timeout_s)
                restarting = True
            except BaseException:
                self.drop_policy()  # streams may hold unanswered requests: start clean next time
                raise

    def close(self) -> None:
        self.drop_policy()

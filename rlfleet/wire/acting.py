"""What a policy returns for a batch of observations: the one type for it, from the policy's ``act`` (torch tensors,
rlfleet.policies) through the inference engine (which stamps the weights version and turns it into numpy arrays) to
the policy clients (which receive it). It lives in the wire layer, so the policies, the inference server and the
clients share it and none of them imports another; it needs neither torch nor gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class PolicyOutput:
    """One batch of ``n`` rows. Arrays are torch tensors where a policy produced them and numpy arrays once they
    leave the policy (``to_numpy``): what the inference server sends and the clients receive."""

    actions: Any                  # [n, chunk, action_dim] float32
    log_probs: Any                # [n, L] float32, L by algorithm.logprob_type
    values: Any | None            # [n] float32, None when the policy has no critic
    forward_inputs: dict[str, Any] = field(default_factory=dict)  # [n, ...] each: what evaluate() needs
    weights_version: int = -1     # the weights that produced it (-1: not stamped, e.g. straight from a policy)

    def rows(self, start: int, end: int) -> PolicyOutput:
        """The output of rows [start, end) (one request's share of a batch)."""
        return PolicyOutput(self.actions[start:end], self.log_probs[start:end],
                            None if self.values is None else self.values[start:end],
                            {k: v[start:end] for k, v in self.forward_inputs.items()}, self.weights_version)

    def to_numpy(self, weights_version: int, rows: int | None = None) -> PolicyOutput:
        """A policy's (torch) output -> the numpy output of weights ``weights_version`` (actions, log-probs and
        values as float32), keeping the first ``rows`` rows (None: all of them; the rest is batch padding)."""
        def numpy(t):
            return t[:rows].detach().cpu().numpy()

        def floats(t):
            return numpy(t.float())

        return PolicyOutput(floats(self.actions), floats(self.log_probs),
                            None if self.values is None else floats(self.values),
                            {k: numpy(v) for k, v in self.forward_inputs.items()}, weights_version)

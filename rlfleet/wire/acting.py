"""What a policy returns for a batch of observations: shared by the inference engine (which produces it) and
the policy clients (which receive it), so neither imports the other and neither needs torch or gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class ActResult:
    actions: np.ndarray           # [n, chunk, action_dim] float32
    log_probs: np.ndarray         # [n, L] float32, L by algorithm.logprob_type
    values: np.ndarray | None     # [n] float32, None when the policy has no critic
    weights_version: int
    forward_inputs: dict[str, np.ndarray] = field(default_factory=dict)  # [n, ...] each

    def rows(self, start: int, end: int) -> ActResult:
        """The result of rows [start, end) (one request's share of a batch)."""
        return ActResult(self.actions[start:end], self.log_probs[start:end],
                         None if self.values is None else self.values[start:end], self.weights_version,
                         {k: v[start:end] for k, v in self.forward_inputs.items()})

"""What a policy returns for a batch of observations: shared by the inference engine (which produces it) and
the policy clients (which receive it), so neither imports the other and neither needs torch or gRPC."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ActResult:
    actions: np.ndarray    # [n, action_dim] float32
    log_probs: np.ndarray  # [n]
    values: np.ndarray     # [n]
    weights_version: int

"""Each service's client, in shared code: the env side (rollout worker) talks to inference and learner through
these modules, so ``services/env`` depends on ``rlfleet`` only, never on another service's package."""

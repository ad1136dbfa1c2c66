"""Model implementations. Policies are built through rlfleet.policies (the registry by model_type)."""

from rlfleet.policies.models.actor_critic import ActorCritic, ObsSpec, RunningMeanStd
from rlfleet.policies import build_policy

__all__ = ["ActorCritic", "ObsSpec", "RunningMeanStd", "build_policy"]

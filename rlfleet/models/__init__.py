"""Policies. One implementation of each: the inference server acts with it, the learner trains it."""

from rlfleet.models.actor_critic import ActorCritic, ObsSpec, RunningMeanStd, build_policy

__all__ = ["ActorCritic", "ObsSpec", "RunningMeanStd", "build_policy"]

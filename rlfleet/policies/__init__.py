"""Layer 4 (imports layers 0-3 only). Policies by ``actor.model.model_type``: the one registry the inference engine and the learner build from.

Each entry names the class implementing :mod:`rlfleet.policies.base` (``act`` / ``evaluate``).
"""

from __future__ import annotations

from collections.abc import Mapping

from rlfleet.policies.base import LOGPROB_TYPES, PolicyEval, PolicyOutput, log_prob_width, reduce_log_probs

POLICIES = {
    "mlp": "rlfleet.policies.models.actor_critic:ActorCritic",
    "cnn": "rlfleet.policies.models.actor_critic:ActorCritic",
    "openvla": "rlfleet.policies.models.openvla:OpenVLAPolicy",
    "openvla_oft": "rlfleet.policies.models.openvla:OpenVLAPolicy",
    "openpi": "rlfleet.policies.models.openpi:Pi0Policy",
}


def build_policy(model_cfg, obs_specs: Mapping, action_dim: int, normalize_obs: bool,
                 logprob_type: str = "action_level"):
    """Build the configured policy (``actor.model`` group) for an env's spaces."""
    from rlfleet.registry import UnknownName, load_object, lookup

    try:
        ref = lookup(POLICIES, model_cfg.model_type, "model_type")
    except UnknownName as exc:
        raise ValueError(str(exc)) from None
    policy = load_object(ref).from_config(model_cfg, obs_specs, action_dim, normalize_obs,
                                                          logprob_type)
    if model_cfg.get("precision", "fp32") == "bf16":
        import torch

        policy.autocast_dtype = torch.bfloat16
    return policy


__all__ = ["LOGPROB_TYPES", "POLICIES", "PolicyEval", "PolicyOutput", "build_policy", "log_prob_width",
           "reduce_log_probs"]

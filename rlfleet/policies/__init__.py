"""Layer 4 (imports layers 0-3 only). Policies by ``actor.model.model_type``: the one registry the inference engine and the learner build from.

Each family is one entry of :data:`rlfleet.policies.families.FAMILIES` (``POLICIES`` is that table): the class
implementing :mod:`rlfleet.policies.base` (``act`` / ``evaluate``), imported when a policy is built, and what the
config, the footprint, the inference backends, export and evaluation need to know of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from rlfleet.policies.base import LOGPROB_TYPES, PolicyEval, PolicyOutput, log_prob_width, reduce_log_probs
from rlfleet.policies.families import FAMILIES

POLICIES = FAMILIES


def build_policy(
    model_cfg,
    obs_specs: Mapping,
    action_dim: int,
    normalize_obs: bool,
    logprob_type: str = "action_level",
    device=None,
):
    """Build the configured policy (``actor.model`` group) for an env's spaces. ``device``: where its tensors are
    made and initialised (a GPU: a 7B policy's random init runs there in seconds, and no copy of it passes through
    the host's memory); None: the default device, the CPU."""
    import torch

    from rlfleet.registry import UnknownName, load_object, lookup

    try:
        family = lookup(FAMILIES, model_cfg.model_type, "model_type")
    except UnknownName as exc:
        raise ValueError(str(exc)) from None
    on = torch.device(device) if device is not None else None
    with on if on is not None and on.type != "cpu" else contextlib.nullcontext():  # the CPU: as it always was
        policy = load_object(family.module).from_config(model_cfg, obs_specs, action_dim, normalize_obs, logprob_type)
    if model_cfg.get("precision", "fp32") == "bf16":
        policy.autocast_dtype = torch.bfloat16
    return policy.to(on) if on is not None else policy


__all__ = [
    "FAMILIES",
    "LOGPROB_TYPES",
    "POLICIES",
    "PolicyEval",
    "PolicyOutput",
    "build_policy",
    "log_prob_width",
    "reduce_log_probs",
]

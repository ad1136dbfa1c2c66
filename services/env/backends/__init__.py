"""The env side's simulator table: for each simulator of the shared registry (rlfleet.simulators, data only), the
backend class that runs it, the preflight that fails fast on a host that cannot run it, and the steps that finish
its Python environment after pip; and the factory, ``make_sim_backend``, that builds the backend a simulator's name
picks. Only env-side processes import backends: the coordinator asks for a preflight or an environment through
``python -m services.env.environment`` (a subprocess), never by importing this code.

Each simulator's backend lives in its own module of this package (the interface: ``base.py``), with its host's side
(preflight, finishing its environment, assets) in ``<simulator>_setup.py`` where it has one; the table names them
by string, so this module imports none of them.
"""

from __future__ import annotations

from rlfleet.errors import InvalidRequest
from rlfleet.registry import load_object, lookup

# simulator -> "module:Class" implementing services.env.backends.base.SimBackend
SIM_BACKENDS = {
    "gym": "services.env.backends.gym_backend:GymBackend",
    "metaworld": "services.env.backends.metaworld:MetaWorldBackend",
    "libero": "services.env.backends.libero:LiberoBackend",
    "maniskill": "services.env.backends.maniskill:ManiSkillBackend",
    "behavior": "services.env.backends.behavior:BehaviorBackend",
}

# simulator -> "module:function(cfg)" raising BackendUnavailable on a host that cannot run it. A preflight imports
# no simulator package: it runs in the main environment, before the simulator's own is built.
PREFLIGHTS = {
    "libero": "services.env.backends.libero_setup:preflight",
    "maniskill": "services.env.backends.maniskill_setup:preflight",
    "behavior": "services.env.backends.behavior_setup:preflight",
}

# simulator -> "module:function()" steps run with its environment's python once pip and the registry's check pass
FINISH_STEPS = {
    "libero": ("services.env.backends.libero_setup:setup",),
    "maniskill": ("services.env.backends.maniskill_setup:check_install",),
}

# simulator -> "module:function(task, dry_run) -> exit code" fetching a task's assets (`coordinatorctl envs assets`)
ASSETS = {
    "maniskill": "services.env.backends.maniskill_setup:download_assets",
}


def backend_class(simulator: str):
    """The backend class of ``simulator`` (UnknownName, with the closest name, for one that is not registered)."""
    return load_object(lookup(SIM_BACKENDS, simulator, "simulator_type"))


def make_sim_backend(simulator: str, env_id: str, num_envs: int, params: dict | None = None):
    """The registered backend for ``simulator``, with ``num_envs`` slots (InvalidRequest for an unknown name)."""
    try:
        cls = backend_class(simulator)
    except KeyError as exc:
        raise InvalidRequest(str(exc.args[0])) from None
    return cls(env_id, num_envs, **dict(params or {}))

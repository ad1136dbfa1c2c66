"""gymnasium ids: rlfleet's built-in envs registered by entry point (the env classes are imported only when an env
is made), and ``make_gym_env``, which the gym backend and the coordinator's preflight check both use."""

from __future__ import annotations


from rlfleet.errors import InvalidRequest
from rlfleet.registry import did_you_mean

_ENTRY = "services.env.envs.panda_pick_cube"
BUILT_IN = {"PandaPickCube-v0": f"{_ENTRY}:PandaPickCubeEnv", "PandaPickCubeVision-v0": f"{_ENTRY}:PandaPickCubeVisionEnv"}


def register_built_in() -> None:
    from gymnasium.envs.registration import register, registry

    for env_id, entry in BUILT_IN.items():
        if env_id not in registry:
            register(id=env_id, entry_point=entry, max_episode_steps=50)


def make_gym_env(env_id: str, init_params: dict | None = None):
    """gym.make for a registered id, without gymnasium's wrappers (VecEnv enforces the time limit)."""
    import gymnasium as gym

    register_built_in()
    if env_id not in gym.registry:
        known = sorted(k for k in gym.registry if not k.startswith(("ALE/", "phys2d/", "tabular/")))
        raise InvalidRequest(f"unknown env id '{env_id}'{did_you_mean(env_id, known)} (gymnasium registry; for another simulator set "
                             f"env.train.simulator_type, see `coordinatorctl envs`)")
    try:
        return gym.make(env_id, disable_env_checker=True, **(init_params or {})).unwrapped
    except TypeError as exc:
        raise InvalidRequest(f"env '{env_id}' rejected init_params {dict(init_params or {})}: {exc}") from exc

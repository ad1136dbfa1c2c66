"""gymnasium ids: rlfleet's built-in envs registered by entry point (the env classes are imported only when an env
is made), and ``make_gym_env``, which the gym backend and the coordinator's preflight check both use.

Each env has an id in gymnasium's ``rlfleet`` namespace (``rlfleet/PandaPickCube-v0``, what a user of another RL
library writes) and its earlier plain id (``PandaPickCube-v0``, what rlfleet's configs say); both make the same
env. Registering imports only gymnasium, rlfleet.errors and rlfleet.registry (no gRPC, no torch, no protobuf), so
``import services.env.envs`` then ``gymnasium.make("rlfleet/PandaPickCube-v0")`` works in a Python environment
that holds gymnasium, mujoco and numpy (tests/rlfleet/test_environments.py checks the import closure)."""

from __future__ import annotations

from rlfleet.errors import InvalidRequest
from rlfleet.registry import did_you_mean

_ENTRY = "services.env.envs.panda_pick_cube"
NAMESPACE = "rlfleet"
_CLASSES = {"PandaPickCube-v0": "PandaPickCubeEnv", "PandaPickCubeVision-v0": "PandaPickCubeVisionEnv"}
# id -> entry point: each env under the namespace and under its plain id
BUILT_IN = {
    f"{prefix}{env_id}": f"{_ENTRY}:{cls}" for env_id, cls in _CLASSES.items() for prefix in (f"{NAMESPACE}/", "")
}


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
        raise InvalidRequest(
            f"unknown env id '{env_id}'{did_you_mean(env_id, known)} (gymnasium registry; for another simulator set "
            f"env.train.simulator_type, see `coordinatorctl envs`)"
        )
    try:
        return gym.make(env_id, disable_env_checker=True, **(init_params or {})).unwrapped
    except TypeError as exc:
        raise InvalidRequest(f"env '{env_id}' rejected init_params {dict(init_params or {})}: {exc}") from exc

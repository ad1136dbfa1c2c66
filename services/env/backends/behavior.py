"""BEHAVIOR-1K tasks on OmniGibson as a backend (``simulator_type: behavior``).

OmniGibson runs on NVIDIA Isaac Sim, which needs an RTX-class NVIDIA GPU (ray-tracing cores) and its own
packages; ``preflight`` (services.env.backends.behavior_setup, its host side) checks the host in about a second
so that ``coordinatorctl start behavior_...`` fails at once, naming what is missing, instead of building a large
environment that cannot run. Written against
OmniGibson 1.1's ``og.Environment`` (gymnasium-style 5-tuple ``step``, ``info['done']['success']`` from the
task's ``PredicateGoal``); it has not been run on this project's CPU machines.

- env_id: a BEHAVIOR activity name (e.g. ``putting_away_Halloween_decorations``), run as a ``BehaviorTask``
  in ``scene_model`` with the robot ``robot``.
- One OmniGibson environment per server (Isaac Sim allows one simulation per process): ``num_envs`` must be 1;
  scale with ``cluster.num_env_servers`` (one GPU each through ``cluster.component_placement``).
- Observations: the robot's RGB cameras (uint8, resized to ``image_size``) and its proprioception (float32).
"""

from __future__ import annotations

import numpy as np

from rlfleet.errors import InvalidRequest
from rlfleet.wire.spaces import TensorSpace
from services.env.backends.base import BackendUnavailable, SimBackend, StepResult
from services.env.backends.behavior_setup import preflight


def _flatten(prefix: str, node, out: dict) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = node.cpu().numpy() if hasattr(node, "cpu") else np.asarray(node)


class BehaviorBackend(SimBackend):
    name = "behavior"

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        *,
        scene_model: str = "Rs_int",
        robot: str = "R1",
        image_size: int = 128,
        action_frequency: int = 30,
        **unknown,
    ):
        super().__init__(env_id, num_envs)
        if unknown:
            raise InvalidRequest(
                f"behavior: unknown init_params {sorted(unknown)} (known: scene_model, robot, "
                f"image_size, action_frequency)"
            )
        if num_envs != 1:
            raise InvalidRequest(
                f"behavior: one OmniGibson simulation per env server (num_envs 1, got {num_envs}); "
                f"scale with cluster.num_env_servers"
            )
        preflight()
        try:
            import omnigibson as og
        except Exception as exc:  # noqa: BLE001 - Isaac Sim raises many kinds of import errors
            raise BackendUnavailable(
                f"omnigibson does not import here ({type(exc).__name__}: {exc}); it needs "
                f"Isaac Sim (NVIDIA's pip index) and numpy<2 in the behavior environment"
            ) from None
        self.image_size = int(image_size)
        config = {
            "env": {"action_frequency": action_frequency, "physics_frequency": 120},
            "scene": {"type": "InteractiveTraversableScene", "scene_model": scene_model},
            "robots": [
                {
                    "type": robot,
                    "obs_modalities": ["rgb", "proprio"],
                    "action_normalize": True,
                    "sensor_config": {
                        "VisionSensor": {
                            "sensor_kwargs": {"image_height": self.image_size, "image_width": self.image_size}
                        }
                    },
                }
            ],
            "task": {"type": "BehaviorTask", "activity_name": env_id, "online_object_sampling": False},
        }
        self.env = og.Environment(configs=config)
        obs, _ = self.env.reset()
        flat = self._obs(obs)
        space = {
            k: TensorSpace(
                v.shape, v.dtype, 0 if v.dtype == np.uint8 else -np.inf, 255 if v.dtype == np.uint8 else np.inf
            )
            for k, v in flat.items()
        }
        act = self.env.action_space
        if hasattr(act, "spaces"):  # one robot: its Box
            act = next(iter(act.spaces.values()))
        self.observation_space, self.action_space = space, TensorSpace.from_gym(act)
        self.max_episode_steps = int(getattr(self.env, "_max_steps", 0) or 2000)
        self.instruction = env_id.replace("_", " ")

    def _obs(self, obs) -> dict[str, np.ndarray]:
        flat: dict[str, np.ndarray] = {}
        _flatten("", obs, flat)
        out = {}
        for k, v in flat.items():
            if k.endswith("rgb"):
                out[k.replace(":", "_")] = np.ascontiguousarray(v[..., :3]).astype(np.uint8)
            elif k.endswith("proprio"):
                out[k.replace(":", "_")] = v.astype(np.float32)
        return out

    def reset(self, env_ids, seeds, state_ids):
        if seeds[0] is not None:
            np.random.seed(int(seeds[0]) % (2**32))
        obs, _ = self.env.reset()
        return {k: v[None] for k, v in self._obs(obs).items()}, [self.instruction]

    def step(self, env_ids, actions) -> StepResult:
        obs, reward, terminated, truncated, info = self.env.step(actions[0])
        success = bool(info.get("done", {}).get("success", False))
        return StepResult(
            {k: v[None] for k, v in self._obs(obs).items()},
            np.array([reward], np.float32),
            np.array([terminated], bool),
            np.array([truncated], bool),
            np.array([success]),
        )

    def close(self) -> None:
        import omnigibson as og

        og.shutdown()

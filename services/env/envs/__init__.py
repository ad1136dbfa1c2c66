"""Gymnasium environments. Importing this package registers:

- ``PandaPickCube-v0``        state observations (13,), see :mod:`.panda_pick_cube`
- ``PandaPickCubeVision-v0``  dict of third-person / wrist RGB images + 7-d proprio
"""
from gymnasium.envs.registration import register, registry

from .panda_pick_cube import (  # noqa: F401
    TASK_DESCRIPTION,
    PandaPickCubeEnv,
    PandaPickCubeVisionEnv,
    scripted_expert_action,
)

_ENTRY = "services.env.envs.panda_pick_cube"

if "PandaPickCube-v0" not in registry:
    register(id="PandaPickCube-v0", entry_point=f"{_ENTRY}:PandaPickCubeEnv", max_episode_steps=50)
if "PandaPickCubeVision-v0" not in registry:
    register(id="PandaPickCubeVision-v0", entry_point=f"{_ENTRY}:PandaPickCubeVisionEnv", max_episode_steps=50)

"""Gymnasium environments. Importing this package registers:

- ``PandaPickCube-v0``        state observations (13,), see :mod:`.panda_pick_cube`
- ``PandaPickCubeVision-v0``  dict of third-person / wrist RGB images + 7-d proprio
"""

from services.env.gym_envs import register_built_in

from .panda_pick_cube import (  # noqa: F401
    TASK_DESCRIPTION,
    PandaPickCubeEnv,
    PandaPickCubeVisionEnv,
    scripted_expert_action,
)

register_built_in()

"""The tiny default run the coordinator's end-to-end tests start through ``coordinatorctl`` (8 envs, 25 steps per
epoch, a 32x32 MLP, no env-step or wall-time budget) with an inference server (the default's ``rollout: auto``
would act in the env servers: the collocated cases add ``COLLOCATED``): each test file adds the keys its case needs."""

import sys

from tests.conftest import INFERENCE_SERVER

CTL = [sys.executable, "-m", "services.coordinator.cli"]
TINY = [
    "env.train.total_num_envs=8",
    "env.train.max_steps_per_rollout_epoch=25",
    "env.eval.total_num_envs=4",
    "env.eval.num_episodes=4",
    "actor.micro_batch_size=100",
    "actor.global_batch_size=100",
    "algorithm.update_epoch=2",
    "actor.model.hidden_dims=[32,32]",
    "runner.max_env_steps=null",
    "runner.max_wall_time_s=null",
    INFERENCE_SERVER,
]

"""SAC through the whole fleet (``coordinatorctl start pandapickcube_sac``): real env servers, inference server and
learner; the replay buffer rides in the checkpoint. kill -9 of the learner, then --resume: the buffer comes back with
the same number of transitions and the same contents (its digest), the gradient-step count with it, and the run goes
on training from it."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from rlfleet.data.metrics import read_metrics
from rlfleet.v1 import coordinator_pb2
from tests.services.coordinator.test_end_to_end import assert_no_orphans, finish, kill_and_wait_restart, wait_epoch
from tests.services.coordinator.tiny_run import CTL

pytestmark = pytest.mark.slow

SAC_TINY = [
    "env.train.total_num_envs=8",
    "env.train.max_steps_per_rollout_epoch=25",
    "env.eval.total_num_envs=4",
    "env.eval.num_episodes=4",
    "actor.model.hidden_dims=[32,32]",
    "actor.micro_batch_size=64",
    "actor.global_batch_size=64",
    "algorithm.learning_starts=100",
    "algorithm.utd_ratio=0.25",
    "runner.max_env_steps=null",
    "runner.max_wall_time_s=null",
    "cluster.heartbeat_timeout_s=8",
]


def test_sac_learner_killed_then_resume_restores_the_replay_buffer(tmp_path):
    from rlfleet.data.checkpoint_files import specs_from_json
    from services.learner.learner import latest_checkpoint
    from services.learner.replay import ReplayBuffer

    run = tmp_path / "sackill"
    cmd = [
        *CTL,
        "start",
        "pandapickcube_sac",
        *SAC_TINY,
        f"runner.logger.log_path={tmp_path}",
        "runner.experiment_name=sackill",
        "runner.max_epochs=1000",
        "runner.save_interval=1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    st = wait_epoch(run, 4, proc)
    pids = {s.role: s.pid for s in st.services}
    os.kill(pids[coordinator_pb2.LEARNER], signal.SIGKILL)
    code, out = finish(proc)
    assert code == 1 and "learner[0] died" in out, out
    assert_no_orphans(list(pids.values()))

    ckpt = latest_checkpoint(run)  # the kill may have hit a checkpoint being written: that one is skipped
    last = json.loads((ckpt / "learner_state.json").read_text())
    specs = specs_from_json(last["obs_specs"])
    from rlfleet.config import load_config

    capacity = load_config("pandapickcube_sac", []).algorithm.replay_capacity
    saved = ReplayBuffer(capacity, specs, last["action_dim"])
    saved.load(ckpt)
    # every env step of the checkpoint's epochs is one transition in the buffer (8 envs x 25 steps an epoch)
    assert saved.seen == len(saved) == last["env_steps"] == 200 * (last["epoch"] + 1)

    proc = subprocess.Popen(
        [*CTL, "start", "--resume", str(run)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    st = wait_epoch(run, last["epoch"] + 3, proc)
    pids2 = [s.pid for s in st.services]
    stop = subprocess.run([*CTL, "stop", str(run)], capture_output=True, text=True, timeout=30)
    assert stop.returncode == 0, stop.stderr
    code, out = finish(proc)
    assert code == 0, out
    assert_no_orphans(pids2)
    learner_log = (run / "logs" / "learner_0.log").read_text()
    assert (
        f"rank 0's replay share restored: {saved.seen:,} transitions seen, {len(saved):,} kept, "
        f"digest {saved.digest()[:16]}" in learner_log
    ), learner_log[-3000:]
    # the run goes on from the restored buffer: the first epoch after the checkpoint adds its 200 transitions to it
    sizes = {r["step"]: r["replay/size"] for r in read_metrics(run) if "replay/size" in r}
    assert sizes[last["epoch"] + 2] == saved.seen + 200, sizes
    trained = [r["step"] for r in read_metrics(run) if "train/critic/loss" in r]
    assert trained == sorted(set(trained)) and trained[-1] >= last["epoch"] + 2


def test_sac_collects_ahead_of_the_update_and_survives_an_env_server_kill(tmp_path):
    """Continuous collection (``algorithm.max_staleness: 2``): the env servers collect up to two epochs ahead with
    the newest published weights while the learner updates; every transition keeps the weights version that acted,
    so the buffer's staleness shows it; a kill -9 of the env server mid-rollout is restarted, its partial rollout
    dropped, and the run goes on adding transitions."""
    run = tmp_path / "sacahead"
    proc = subprocess.Popen(
        [
            *CTL,
            "start",
            "pandapickcube_sac",
            *SAC_TINY,
            f"runner.logger.log_path={tmp_path}",
            "runner.experiment_name=sacahead",
            "runner.max_epochs=10",
            "algorithm.max_staleness=2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids = kill_and_wait_restart(run, proc, coordinator_pb2.ENV, min_epoch=4)
    code, out = finish(proc)
    assert code == 0, out
    assert_no_orphans(pids)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] == {"env[0]": 1} and summary["epochs"] == 10
    records = read_metrics(run)
    stale = [r["rollout/staleness"] for r in records if "rollout/staleness" in r]
    # epochs trained from collections started ahead carry samples acted by older weights, never more than 2 behind
    assert max(stale) >= 1 and max(stale) <= 2, stale
    sizes = [r["replay/size"] for r in records if "replay/size" in r]
    assert sizes == sorted(sizes) and sizes[-1] >= 200 * 8, sizes  # every kept epoch added its transitions
    assert [r["step"] for r in records if "train/critic/loss" in r][-1] == 10


def test_rlpd_trains_from_collected_demonstrations_through_the_fleet(tmp_path):
    """`collect-demos` then `start` of the two-camera RLPD config, shortened: the learner reads the LeRobot dataset
    the first command wrote (video-decoded images, the next frames as next observations) and mixes it into every
    batch of the run's own transitions."""
    config = "pandapickcube_vision_rlpd_cnn"
    common = [
        f"runner.logger.log_path={tmp_path}",
        "env.train.max_episode_steps=16",
        "env.eval.max_episode_steps=16",
        "env.train.total_num_envs=4",
        "env.train.max_steps_per_rollout_epoch=16",
        "env.eval.total_num_envs=4",
        "env.eval.num_episodes=4",
        "env.train.init_params.image_size=32",
        "env.eval.init_params.image_size=32",
    ]
    demos = subprocess.run(
        [*CTL, "collect-demos", config, *common, "sft.num_demos=2", "sft.only_successful=false"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demos.returncode == 0, demos.stdout[-2000:] + demos.stderr[-2000:]
    assert "wrote 2 episodes" in demos.stdout
    rl = subprocess.run(
        [
            *CTL,
            "start",
            config,
            *common,
            "runner.max_epochs=3",
            "runner.val_check_interval=3",
            "actor.model.hidden_dims=[32,32]",
            "actor.global_batch_size=16",
            "actor.micro_batch_size=16",
            "algorithm.learning_starts=32",
            "algorithm.utd_ratio=0.125",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert rl.returncode == 0, rl.stdout[-3000:] + rl.stderr[-3000:]
    run = tmp_path / f"{config}-2"  # (tmp_path / config holds the demonstrations it read)
    learner_log = (run / "logs" / "learner_0.log").read_text()
    from rlfleet.data.datasets import Dataset

    ds = Dataset(tmp_path / config / "demos")
    frames = sum(int(e["length"]) - 1 for e in ds.episodes_meta)  # an episode's last frame has no next one
    assert f"learner: rlpd: {frames:,} demonstration transitions from 2 episodes" in learner_log, learner_log[-2000:]
    trained = [r for r in read_metrics(run) if "train/critic/loss" in r]
    assert len(trained) == 3 and all(r["train/optimizer_steps"] == 8 for r in trained)  # 0.125 x 64 new, from epoch 1
    assert "final evaluation: success_once" in rl.stdout

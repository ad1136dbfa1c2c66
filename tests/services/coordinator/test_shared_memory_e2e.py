"""The zero-copy path on one host end to end (issue 34): `coordinatorctl start` with every service a local process, so
observations, rollouts and weights go through shared memory (cluster.shared_memory: auto, the default). A kill -9 of
the writer (an env server) or of a reader (the inference server) mid-rollout leaves no segment anywhere and the run
recovers as it does over plain gRPC; the tiny OpenVLA-OFT at 224 px learns the same numbers with and without it."""

from __future__ import annotations

import json
import signal
import time

import pytest

from rlfleet.data.metrics import read_metrics
from rlfleet.v1 import coordinator_pb2
from rlfleet.wire import shm
from tests.rlfleet.test_shm import dev_shm, holders
from tests.services.coordinator.test_end_to_end import (
    CTL,
    _learning_record,
    assert_no_orphans,
    finish,
    kill_and_wait_restart,
    start,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(shm.unavailable()), reason="no shared memory here")]


def wait_gone(name_part: str, timeout: float = 20.0) -> dict:
    end = time.monotonic() + timeout
    while (held := holders(name_part)) and time.monotonic() < end:
        time.sleep(0.2)
    return held


@pytest.mark.parametrize("role", [coordinator_pb2.ENV, coordinator_pb2.INFERENCE], ids=["env", "inference"])
def test_kill9_with_shared_memory_leaves_no_segment_and_the_run_recovers(tmp_path, monkeypatch, role):
    monkeypatch.setenv("RLFLEET_SHM_MIN_BYTES", "0")  # every tensor by handle, however small (the MLP run's are)
    before = dev_shm()
    name = f"shmkill{coordinator_pb2.Role.Name(role).lower()}"
    proc = start(
        tmp_path,
        "runner.max_epochs=1000",
        "env.train.max_steps_per_rollout_epoch=100",
        "actor.global_batch_size=400",
        "actor.micro_batch_size=200",
        name=name,
    )
    run = tmp_path / name
    pids = kill_and_wait_restart(run, proc, role, min_epoch=4)  # the killed one last
    dead = pids[-1]
    # the dead process's segments (the env server's Act ring and rollout buffers) are held by nobody: the
    # survivors that mapped them (the inference server, the learner) dropped them when its calls broke
    assert wait_gone(f"-{dead}-") == {}
    proc.send_signal(signal.SIGINT)
    code, out = finish(proc)
    assert code == 0, out
    assert "restarting it (restart 1)" in out
    assert_no_orphans(pids)
    for pid in pids:
        assert wait_gone(f"-{pid}-") == {}, pid
    assert dev_shm() - before == set()  # nothing ever went to /dev/shm
    records = [r for r in read_metrics(run) if "wire/act_shm_bytes" in r]
    # by handle before and after the kill (the restarted service took the handshake again), nothing inline but
    # the messages' own fields; and every trained epoch had its whole batch
    assert len(records) >= 4 and all(r["wire/act_shm_bytes"] > 0 and r["wire/rollout_shm_bytes"] > 0 for r in records)
    assert all(r["wire/rollout_bytes"] < r["wire/rollout_shm_bytes"] for r in records)
    steps = [r["env/env_steps"] for r in read_metrics(run) if "env/env_steps" in r]
    assert all(b - a == 800 for a, b in zip(steps, steps[1:]))


OFT_224 = [
    "runner.max_epochs=2",
    "runner.val_check_interval=0",
    "rollout.pipeline_stage_num=1",
    "env.train.init_params={image_size: 224}",
    "env.eval.init_params={image_size: 224}",
    "env.eval.num_episodes=4",
    "env.eval.total_num_envs=4",
    "runner.seed=3",
]


def test_oft_at_224px_learns_the_same_numbers_with_and_without_shared_memory(tmp_path):
    import subprocess

    runs = {}
    for mode in ("auto", "inline"):
        proc = subprocess.run(
            [
                *CTL,
                "start",
                "pandapickcube_vision_grpo_openvla_oft_tiny",
                *OFT_224,
                f"cluster.shared_memory={mode}",
                f"runner.logger.log_path={tmp_path}",
                f"runner.experiment_name={mode}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[mode] = read_metrics(tmp_path / mode)
    shared, inline = runs["auto"], runs["inline"]
    trained = [r for r in shared if "train/loss" in r]
    assert len(trained) == 2
    # through shared memory: two 224 px cameras of 8 envs x 48 steps, each way (~29 MB an epoch); inline: none
    for r in trained:
        assert r["wire/act_shm_bytes"] > 25e6 and r["wire/rollout_shm_bytes"] > 25e6, r
        assert r["wire/act_bytes"] < 1e6 and r["wire/rollout_bytes"] < 1e6, r
    for r in (r for r in inline if "train/loss" in r):
        assert r["wire/act_shm_bytes"] == r["wire/rollout_shm_bytes"] == r["wire/weights_shm_bytes"] == 0, r
        assert r["wire/act_bytes"] > 25e6 and r["wire/rollout_bytes"] > 25e6, r
    # the same run, number for number, but for the clock and where the bytes went
    strip = [{k: v for k, v in r.items() if not k.startswith("wire/")} for r in _learning_record(shared)]
    assert strip == [{k: v for k, v in r.items() if not k.startswith("wire/")} for r in _learning_record(inline)]
    assert "eval/success_once" in strip[-1]
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert summary["epochs"] == 2

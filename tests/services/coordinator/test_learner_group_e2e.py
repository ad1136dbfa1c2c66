"""`coordinatorctl start` with the learner as 2 ranks (torchrun, gloo) end to end: it trains and checkpoints in
shards; kill -9 of learner rank 1 mid-run ends the whole group (torchrun stops rank 0) and the run stops with the
resume command naming the rank; `--resume` then continues with 1 rank from the 2 ranks' sharded checkpoint."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess

import pytest

from rlfleet.data.metrics import read_metrics
from rlfleet.v1 import coordinator_pb2
from tests.services.coordinator.test_end_to_end import CTL, alive, assert_no_orphans, finish, start, wait_epoch

pytestmark = pytest.mark.slow


def ranks_of(agent: int) -> dict[int, int]:
    """{RANK: pid} of the processes torchrun's agent ``agent`` started."""
    out = {}
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != agent:
                continue
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(proc.name)
    return out


def test_two_learner_ranks_train_and_checkpoint_in_shards(tmp_path):
    code, out = finish(
        start(
            tmp_path,
            "runner.max_epochs=4",
            "runner.val_check_interval=2",
            "runner.save_interval=2",
            "cluster.learner_world_size=2",
            name="ranks2",
        )
    )
    assert code == 0, out
    assert "1 learner of 2 ranks" in out
    run = tmp_path / "ranks2"
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    assert [r["train/weights_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert all(r["train/learner_ranks"] == 2.0 and r["train/actor/first_logprob_abs_diff"] < 1e-5 for r in rows)
    shards = list((run / "checkpoints" / "global_step_4" / "state").glob("*.distcp"))
    assert len(shards) == 2
    assert json.loads((run / "checkpoints" / "global_step_4" / "learner_state.json").read_text())["world_size"] == 2
    log = (run / "logs" / "learner_0.log").read_text()
    assert "learner rank 0/2 (gloo, cpu)" in log and "learner rank 1/2 (gloo, cpu)" in log


def test_killing_a_learner_rank_stops_the_run_then_it_resumes_on_one_rank(tmp_path):
    proc = start(
        tmp_path, "runner.max_epochs=1000", "runner.save_interval=1", "cluster.learner_world_size=2", name="rankkill"
    )
    run = tmp_path / "rankkill"
    st = wait_epoch(run, 3, proc)
    pids = {s.role: s.pid for s in st.services}
    agent = pids[coordinator_pb2.LEARNER]  # the learner registers the process its launcher started: torchrun's agent
    ranks = ranks_of(agent)
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1], signal.SIGKILL)
    code, out = finish(proc)
    assert code == 1, out
    assert "learner[0] died" in out and "rank 1 exited with code -9" in out, out
    assert f"coordinatorctl start --resume {run}" in out
    assert_no_orphans([*pids.values(), *ranks.values()])
    assert not alive(ranks[0])
    from services.learner.learner import latest_checkpoint

    ckpt = latest_checkpoint(run)
    last = json.loads((ckpt / "learner_state.json").read_text())
    assert last["world_size"] == 2
    # the sharded checkpoint of 2 ranks resumes on 1
    resumed = subprocess.run(
        [*CTL, "start", "--resume", str(run), "cluster.learner_world_size=1", f"runner.max_epochs={last['epoch'] + 3}"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed at epoch {last['epoch'] + 1}, {last['env_steps']} env steps" in resumed.stdout
    log = (run / "logs" / "learner_0.log").read_text()
    assert (
        f"resumed from {ckpt} (epoch {last['epoch']}, env steps {last['env_steps']}, saved by 2 rank(s), "
        f"resumed by 1)" in log
    )

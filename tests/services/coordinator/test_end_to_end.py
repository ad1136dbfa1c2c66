"""`coordinatorctl start` end to end: real processes, real gRPC on loopback, real MuJoCo, real PPO.

Covers the run folder, --resume, kill -9 of an env server mid-run (restart, lost episodes counted), kill -9 of
the learner (run fails with a resume hint; --resume continues with the same step count and optimizer state; after
the run's summary it fails nothing),
`coordinatorctl stop` and Ctrl-C with no orphan processes, and config errors.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from rlfleet.data.metrics import read_metrics
from rlfleet.v1 import coordinator_pb2, coordinator_pb2_grpc
from rlfleet.wire import channels
from tests.services.coordinator.tiny_run import CTL
from tests.services.coordinator.tiny_run import TINY as TINY_RUN

pytestmark = pytest.mark.slow

TINY = [
    *TINY_RUN,
    "cluster.heartbeat_timeout_s=8",
]
# collocated acting (issue 37): each env server acts with the policy in its own process, no inference server
COLLOCATED = ("cluster.component_placement.rollout=env", "rollout.pipeline_stage_num=1")


SIM_PACKAGES = ("metaworld", "mani_skill", "sapien", "robosuite", "libero", "omnigibson")


def modules_env(path) -> dict:
    """The environment under which `coordinatorctl start` writes its process's modules to ``path`` at the end."""
    return dict(os.environ, RLFLEET_MODULES_REPORT=str(path))


def assert_coordinator_loaded_no_env_code(path) -> None:
    """The run's coordinator never imported an env-side module or a simulator package (the env side runs in its
    own processes; the coordinator asks it for preflights and environments in subprocesses)."""
    loaded = json.loads(pathlib.Path(path).read_text())
    assert "services.coordinator.coordinator" in loaded  # (the report is the coordinator's)
    wrong = [m for m in loaded if m.startswith("services.env") or m.split(".")[0] in SIM_PACKAGES]
    assert not wrong, wrong


def start(tmp_path, *args, name="e2e"):
    cmd = [*CTL, "start", *TINY, f"runner.logger.log_path={tmp_path}", f"runner.experiment_name={name}", *args]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=modules_env(tmp_path / f"{name}-modules.json"),
    )


def finish(proc, timeout=240):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def filmed_outcomes(run_dir, epoch: int) -> dict[int, bool]:
    """The evaluation at ``epoch`` as its videos record it, one per filmed episode (env.eval.video_episodes):
    {episode index: succeeded at least once} from the file names (``episode007_seed1000007_success.gif``)."""
    import re

    out = {}
    for f in sorted((run_dir / "videos" / f"eval_epoch{epoch:04d}").glob("*.gif")):
        m = re.fullmatch(r"episode(\d+)_seed\d+_(success|fail)\.gif", f.name)
        assert m is not None and int(m[1]) not in out, f.name
        out[int(m[1])] = m[2] == "success"
    return out


def credential(run_dir, role="ctl", to="coordinator", index=0):
    """Call metadata of ``role[index]`` toward a server of role ``to``, made from the run folder's run_token (the
    operator's credential: what coordinatorctl status sends; role ctl only)."""
    from rlfleet.wire import auth

    return auth.metadata((run_dir / "run_token").read_text(), role, index, to=to)


def status(run_dir):
    info = json.loads((run_dir / "coordinator.json").read_text())
    with channels.channel(info["address"]) as ch:
        return coordinator_pb2_grpc.CoordinatorServiceStub(ch).Status(
            coordinator_pb2.StatusRequest(), timeout=5, metadata=credential(run_dir)
        )


def wait_epoch(run_dir, epoch, proc, timeout=180):
    end = time.monotonic() + timeout
    error = None
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"coordinator exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            st = status(run_dir)
            if st.epoch + 1 >= epoch:
                return st
        except Exception as exc:  # noqa: BLE001 - not up yet
            error = exc
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"run did not reach epoch {epoch} ({error}):\n{proc.communicate()[0]}")


def kill_and_wait_restart(run, proc, role, min_epoch):
    """kill -9 the service of `role` inside a rollout; wait until it is back and the run has gone on."""
    st = wait_epoch(run, 2, proc)
    old = {s.role: s.pid for s in st.services}[role]
    time.sleep(0.3)  # well inside the next rollout
    os.kill(old, signal.SIGKILL)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"coordinator exited with {proc.returncode}:\n{proc.stdout.read()}")
        st = status(run)
        svc = [s for s in st.services if s.role == role][0]
        if svc.restarts == 1 and svc.alive and svc.pid != old and st.epoch >= min_epoch:
            return [s.pid for s in st.services] + [old]
        time.sleep(0.3)
    pytest.fail(f"{coordinator_pb2.Role.Name(role)} was not restarted / the run did not go on: {st}")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def assert_no_orphans(pids, timeout=15):
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "service processes outlived the coordinator"


def test_run_writes_run_folder_and_resumes(tmp_path):
    # two env servers and two inference servers: envs split over servers, stages over inference servers
    code, out = finish(
        start(
            tmp_path,
            "runner.max_epochs=3",
            "runner.val_check_interval=2",
            "runner.save_interval=2",
            "cluster.num_env_servers=2",
            "cluster.num_inference_servers=2",
        )
    )
    assert code == 0, out
    assert_coordinator_loaded_no_env_code(tmp_path / "e2e-modules.json")  # gym, the main environment
    assert "starting 2 env server(s), 2 inference server(s)" in out
    run = tmp_path / "e2e"
    for f in ("config.yaml", "metrics.jsonl", "summary.json", "learning_curve.png", "logs/env_0.log"):
        assert (run / f).exists(), f
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "global_step_3" / "state" / ".metadata").exists()  # sharded policy + optimizer
    assert (run / "checkpoints" / "global_step_3" / "learner_state.json").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 3 and summary["env_steps"] == 3 * 8 * 25
    assert summary["final_eval"]["eval/num_episodes"] == 4
    assert {p.name for p in (run / "logs").iterdir()} == {
        "env_0.log",
        "env_1.log",
        "inference_0.log",
        "inference_1.log",
        "learner_0.log",
    }
    records = read_metrics(run)
    assert [r["step"] for r in records if "train/actor/policy_loss" in r] == [1, 2, 3]
    assert any("eval/success_once" in r for r in records)
    assert "final evaluation: success_once" in out and str(run) in out
    # --resume continues at epoch 4 with the same counters
    proc = subprocess.run(
        [*CTL, "start", "--resume", str(run), "runner.max_epochs=5"], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed at epoch 3, 600 env steps" in proc.stdout
    records = read_metrics(run)
    assert [r["step"] for r in records if "train/actor/policy_loss" in r] == [1, 2, 3, 4, 5]
    assert json.loads((run / "summary.json").read_text())["env_steps"] == 5 * 8 * 25


@pytest.mark.parametrize(
    "staleness, placement",
    [("0", ()), ("1", ()), ("2", ()), ("0", COLLOCATED), ("1", COLLOCATED)],
    ids=["sync", "async", "async2", "collocated-sync", "collocated-async"],
)
def test_env_server_killed_mid_run_is_restarted_then_ctrl_c(tmp_path, staleness, placement):
    # the kill lands 0.3 s into a rollout: collocated acting collects 100 steps in about that time, so its rollouts
    # are made 4x longer to keep the kill inside one
    steps = 400 if placement else 100
    proc = start(
        tmp_path,
        "runner.max_epochs=1000",
        f"env.train.max_steps_per_rollout_epoch={steps}",
        "actor.global_batch_size=400",
        "actor.micro_batch_size=200",
        f"algorithm.max_staleness={staleness}",
        *placement,
        name="envkill",
    )
    run = tmp_path / "envkill"
    all_pids = kill_and_wait_restart(run, proc, coordinator_pb2.ENV, min_epoch=4)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    code, out = finish(proc)
    assert code == 0, out
    assert "restarting it (restart 1)" in out and "partial episodes dropped" in out
    assert_no_orphans(all_pids)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["lost_episodes"] == 8 and summary["restarts"] == {"env[0]": 1}
    lost = [r["env/lost_episodes"] for r in read_metrics(run) if "env/lost_episodes" in r]
    assert lost[0] == 0 and lost[-1] == 8
    # every trained epoch had the full batch: the partial rollout never reached the learner
    counts = [r["env/env_steps"] for r in read_metrics(run) if "env/env_steps" in r]
    assert all(b - a == 8 * steps for a, b in zip(counts, counts[1:]))
    # the counts survive --resume
    resumed = subprocess.run(
        [*CTL, "start", "--resume", str(run), f"runner.max_epochs={summary['epochs'] + 1}"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    again = json.loads((run / "summary.json").read_text())
    assert again["lost_episodes"] == 8 and again["restarts"] == {"env[0]": 1}
    assert len(again["eval_history"]) >= len(summary["eval_history"])


@pytest.mark.parametrize(
    "staleness, placement",
    [("0", ()), ("1", ()), ("0", COLLOCATED), ("1", COLLOCATED)],
    ids=["sync", "async", "collocated-sync", "collocated-async"],
)
def test_learner_killed_then_resume_and_stop(tmp_path, staleness, placement):
    proc = start(
        tmp_path,
        "runner.max_epochs=1000",
        "runner.save_interval=1",
        f"algorithm.max_staleness={staleness}",
        *placement,
        name="learnerkill",
    )
    run = tmp_path / "learnerkill"
    st = wait_epoch(run, 3, proc)
    pids = {s.role: s.pid for s in st.services}
    os.kill(pids[coordinator_pb2.LEARNER], signal.SIGKILL)
    code, out = finish(proc)
    assert code == 1, out
    assert "learner[0] died" in out and f"coordinatorctl start --resume {run}" in out
    assert_no_orphans(list(pids.values()))
    from services.learner.learner import latest_checkpoint

    ckpt = latest_checkpoint(run)  # the kill may have hit a checkpoint being written: that one is skipped
    last = json.loads((ckpt / "learner_state.json").read_text())
    # resume: same step count and optimizer state, then `coordinatorctl stop`
    proc = subprocess.Popen(
        [*CTL, "start", "--resume", str(run)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    st = wait_epoch(run, last["epoch"] + 3, proc)
    pids2 = [s.pid for s in st.services]
    stop = subprocess.run([*CTL, "stop", str(run)], capture_output=True, text=True, timeout=30)
    assert stop.returncode == 0, stop.stderr
    code, out = finish(proc)
    assert code == 0, out
    assert f"resumed at epoch {last['epoch'] + 1}, {last['env_steps']} env steps" in out
    learner_log = (run / "logs" / "learner_0.log").read_text()
    assert f"resumed from {ckpt}" in learner_log
    assert_no_orphans(pids2)
    steps = [r["step"] for r in read_metrics(run) if "train/actor/policy_loss" in r]
    assert steps == sorted(set(steps))  # each epoch once: the records after the checkpoint were dropped on resume


# `coordinatorctl start` whose learner is killed (-9) the moment the run has written its summary, before the
# coordinator shuts the services down; the monitor is given time to notice the exit
KILL_AFTER_SUMMARY = """
import os, signal, sys, time
from services.coordinator import cli
from services.coordinator.coordinator import Coordinator

run = Coordinator.run

def run_then_kill_the_learner(self):
    summary = run(self)
    os.kill(self.registry.services[("learner", 0)].pid, signal.SIGKILL)
    time.sleep(2.0)
    return summary

Coordinator.run = run_then_kill_the_learner
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_learner_killed_after_the_summary_fails_nothing(tmp_path):
    """A run that has ended (final evaluation, checkpoint, summary written) stays a finished run when its learner
    dies while the services shut down: exit code 0, no "run failed", no resume hint."""
    name = "endkill"
    cmd = [sys.executable, "-c", KILL_AFTER_SUMMARY, "start", *TINY, "runner.max_epochs=2"]
    cmd += [f"runner.logger.log_path={tmp_path}", f"runner.experiment_name={name}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "run failed" not in out and "--resume" not in out, out
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["epochs"] == 2 and summary["stop_reason"] == "runner.max_epochs=2 reached"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["env.train.totl_num_envs=8"],
            "unknown config key 'env.train.totl_num_envs'; did you mean 'env.train.total_num_envs'",
        ),
        (["env.train.env_id=PandaPickCub-v0"], "unknown env id 'PandaPickCub-v0'; did you mean 'PandaPickCube-v0'"),
        (["rollout.pipeline_stage_num=3"], "must split evenly into 3 stages"),
        (["runner.only_eval=true"], "'runner.only_eval': true means evaluation only, which `coordinatorctl eval"),
    ],
)
def test_config_errors_name_the_key(args, message, tmp_path):
    proc = subprocess.run(
        [*CTL, "start", f"runner.logger.log_path={tmp_path}", *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir()), "a rejected config must not start anything"


def test_attach_to_services_started_elsewhere(tmp_path):
    """cluster.launcher=attach (what docker-compose runs): services started on their own register with the
    coordinator, train, and exit when the run is over."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    coordinator = f"127.0.0.1:{port}"
    from rlfleet.config import load_config, to_yaml

    config = tmp_path / "attach.yaml"
    config.write_text(
        to_yaml(
            load_config(
                None,
                [
                    *TINY,
                    "cluster.launcher=attach",
                    f"cluster.coordinator_address={coordinator}",
                    "runner.max_epochs=2",
                    "runner.experiment_name=attach",
                    f"runner.logger.log_path={tmp_path}",
                ],
            )
        )
    )
    # a service started with a different config is refused, with the key named
    odd_config = tmp_path / "odd.yaml"
    odd_config.write_text(config.read_text().replace("gamma: 0.95", "gamma: 0.5"))
    env = dict(os.environ, RLFLEET_RUN_TOKEN="attach-test-token")  # the deployment hands every part the credential
    # a service without the credential does not start
    bare = subprocess.run(
        [sys.executable, "-m", "services.inference.server", "--config", str(config), "--coordinator", coordinator],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "RLFLEET_RUN_TOKEN"},
    )
    assert bare.returncode == 3 and "no run credential: set RLFLEET_RUN_TOKEN" in bare.stderr, bare.stderr
    odd = subprocess.Popen(
        [sys.executable, "-m", "services.inference.server", "--config", str(odd_config), "--coordinator", coordinator],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    services = []
    for module, extra in (
        ("services.learner.server", ["--run-dir", str(tmp_path / "attach")]),
        ("services.inference.server", []),
        ("services.env.server", []),
    ):
        services.append(
            subprocess.Popen(
                [sys.executable, "-m", module, "--config", str(config), "--coordinator", coordinator, *extra],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
            )
        )
    proc = subprocess.run([*CTL, "start", str(config)], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "final evaluation: success_once" in proc.stdout
    for p in services:
        assert p.wait(30) == 0  # told to shut down through their heartbeats
    out, _ = odd.communicate(timeout=30)
    assert odd.returncode == 2
    assert "refused this service: inference[0] was started with a different config: 'algorithm.gamma' is 0.5" in out


@pytest.mark.parametrize("staleness", ["0", "1", "2"], ids=["sync", "async", "async2"])
def test_inference_server_killed_is_restarted_and_reloaded(tmp_path, staleness):
    proc = start(
        tmp_path,
        "runner.max_epochs=1000",
        "env.train.max_steps_per_rollout_epoch=100",
        "actor.global_batch_size=400",
        "actor.micro_batch_size=200",
        f"algorithm.max_staleness={staleness}",
        name="infkill",
    )
    run = tmp_path / "infkill"
    pids = kill_and_wait_restart(run, proc, coordinator_pb2.INFERENCE, min_epoch=5)
    proc.send_signal(signal.SIGINT)
    code, out = finish(proc)
    assert code == 0, out
    assert "inference[0]" in out and "restarting it (restart 1)" in out
    assert_no_orphans(pids)
    steps = [r["env/env_steps"] for r in read_metrics(run) if "env/env_steps" in r]
    assert all(b - a == 800 for a, b in zip(steps, steps[1:]))


def test_external_simulator_plugs_in(tmp_path):
    """examples/point_reach_env_server.py implements EnvService from scratch; the fleet trains on it."""
    sim = subprocess.Popen(
        [sys.executable, "examples/point_reach_env_server.py", "--address", "127.0.0.1:0", "--num-envs", "8"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = sim.stdout.readline().split()[-1]
        proc = subprocess.run(
            [
                *CTL,
                "start",
                *TINY,
                f"runner.logger.log_path={tmp_path}",
                "runner.max_epochs=3",
                "runner.experiment_name=external",
                f"cluster.external_env_addresses=[{address}]",
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "env PointReach-v0: 8 envs" in proc.stdout
        summary = json.loads((tmp_path / "external" / "summary.json").read_text())
        assert summary["env_steps"] == 3 * 8 * 25 and summary["final_eval"]["eval/num_episodes"] == 4
    finally:
        sim.kill()


def test_coordinator_kill9_leaves_no_orphans(tmp_path):
    proc = start(tmp_path, "runner.max_epochs=1000", name="coordkill")
    st = wait_epoch(tmp_path / "coordkill", 1, proc)
    pids = [s.pid for s in st.services]
    proc.kill()  # SIGKILL: no cleanup code runs in the coordinator
    proc.wait(10)
    assert_no_orphans(pids)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _point_reach(port: int) -> subprocess.Popen:
    sim = subprocess.Popen(
        [sys.executable, "examples/point_reach_env_server.py", "--address", f"127.0.0.1:{port}", "--num-envs", "8"],
        stdout=subprocess.PIPE,
        text=True,
    )
    sim.stdout.readline()  # serving
    return sim


def test_external_simulator_killed_mid_rollout_costs_episodes_not_the_run(tmp_path):
    port = _free_port()
    sim = _point_reach(port)
    proc = subprocess.Popen(
        [
            *CTL,
            "start",
            *TINY,
            f"runner.logger.log_path={tmp_path}",
            "runner.max_epochs=8",
            "runner.experiment_name=extkill",
            f"cluster.external_env_addresses=[127.0.0.1:{port}]",
            "runner.val_check_interval=0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_epoch(tmp_path / "extkill", 2, proc)
        sim.kill()  # kill -9 of the simulator, mid-rollout
        sim.wait(5)
        time.sleep(2.0)  # down for a while: the bridge says so and retries
        sim = _point_reach(port)
        code, out = finish(proc)
        assert code == 0, out
        summary = json.loads((tmp_path / "extkill" / "summary.json").read_text())
        assert summary["epochs"] == 8 and summary["lost_episodes"] >= 8, summary
        assert "external simulator restarted; 8 episodes lost" in out
        log = (tmp_path / "extkill" / "logs" / "env_0.log").read_text()
        assert f"external env 127.0.0.1:{port} is down" in log and "is back after" in log
    finally:
        sim.kill()
        if proc.poll() is None:
            proc.kill()


def test_env_server_killed_mid_evaluation_is_retried(tmp_path):
    proc = start(
        tmp_path, "runner.max_epochs=4", "runner.val_check_interval=2", "env.eval.num_episodes=40", name="evalkill"
    )
    run = tmp_path / "evalkill"
    end = time.monotonic() + 180
    while time.monotonic() < end:
        st = wait_epoch(run, 1, proc)
        if st.phase == "evaluating":
            break
        time.sleep(0.05)
    else:
        pytest.fail("no evaluation seen")
    env_pid = [s.pid for s in st.services if s.role == coordinator_pb2.ENV][0]
    os.kill(env_pid, signal.SIGKILL)
    code, out = finish(proc)
    assert code == 0, out
    assert "lost mid-evaluation" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["lost_episodes"] >= 1 and summary["restarts"] == {"env[0]": 1}
    assert [h["eval/num_episodes"] for h in summary["eval_history"]] == [40.0, 40.0]


def test_evaluation_cut_off_by_a_kill_is_redone_on_resume(tmp_path):
    """The checkpoint of epoch 2 is saved before its evaluation: kill -9 the coordinator (its services die with it)
    while that evaluation runs, and --resume evaluates epoch 2 before training on, so the history has no hole."""
    proc = start(
        tmp_path,
        "runner.max_epochs=4",
        "runner.val_check_interval=2",
        "runner.save_interval=2",
        "env.eval.num_episodes=400",
        "runner.eval_before_train=false",
        name="evalcut",
    )
    run = tmp_path / "evalcut"
    end = time.monotonic() + 180
    while time.monotonic() < end:
        st = wait_epoch(run, 2, proc)
        if st.phase == "evaluating":
            break
        time.sleep(0.05)
    else:
        pytest.fail("no evaluation seen")
    proc.kill()  # SIGKILL: mid-evaluation of epoch 2
    proc.communicate()
    assert (run / "checkpoints" / "global_step_2" / "learner_state.json").exists()
    state = json.loads((run / "coordinator_state.json").read_text())
    assert not any(h["step"] == 2 for h in state["eval_history"])
    resumed = subprocess.run(
        [*CTL, "start", "--resume", str(run), "env.eval.num_episodes=4"], capture_output=True, text=True, timeout=240
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "evaluating epoch 2 again" in resumed.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert [h["step"] for h in summary["eval_history"]] == [2, 4]
    evals = [r["step"] for r in read_metrics(run) if "eval/success_once" in r]
    assert evals == [2, 4]


def test_any_gymnasium_id_trains(tmp_path):
    """A gymnasium id that is not ours (Pendulum-v1: 1-d action in [-2, 2], no success signal) runs end to end."""
    proc = subprocess.run(
        [
            *CTL,
            "start",
            *TINY,
            f"runner.logger.log_path={tmp_path}",
            "runner.max_epochs=3",
            "runner.experiment_name=pendulum",
            "env.train.env_id=Pendulum-v1",
            "env.eval.env_id=Pendulum-v1",
            "env.train.max_episode_steps=40",
            "env.eval.max_episode_steps=40",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "pendulum" / "summary.json").read_text())
    assert summary["env_id"] == "Pendulum-v1" and summary["env_steps"] == 3 * 8 * 25
    assert summary["final_eval"]["eval/success_once"] == 0.0 and summary["final_eval"]["eval/return"] < 0


@pytest.mark.sim
def test_metaworld_run_uses_its_own_environment(tmp_path):
    """coordinatorctl start metaworld_mt1_ppo_mlp: env servers run from the metaworld environment (mujoco 3.3.0)
    while this process keeps the main environment's mujoco."""
    import mujoco

    proc = subprocess.run(
        [
            *CTL,
            "start",
            "metaworld_mt1_ppo_mlp",
            f"runner.logger.log_path={tmp_path}",
            "runner.max_epochs=2",
            "runner.experiment_name=mw",
            "env.train.total_num_envs=8",
            "env.train.max_steps_per_rollout_epoch=32",
            "env.eval.total_num_envs=5",
            "env.eval.num_episodes=10",
            "actor.micro_batch_size=128",
            "actor.global_batch_size=256",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=modules_env(tmp_path / "modules.json"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_coordinator_loaded_no_env_code(tmp_path / "modules.json")
    log = (tmp_path / "mw" / "logs" / "env_0.log").read_text()
    assert "metaworld:reach-v3" in log and "mujoco 3.3.0" in log and "metaworld 3.1.1" in log
    assert mujoco.__version__ != "3.3.0"
    summary = json.loads((tmp_path / "mw" / "summary.json").read_text())
    assert summary["env_id"] == "reach-v3" and summary["final_eval"]["eval/num_episodes"] == 10


@pytest.mark.sim
def test_unknown_task_in_a_simulator_environment_fails_fast_without_restarts(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            *CTL,
            "start",
            "metaworld_mt1_ppo_mlp",
            f"runner.logger.log_path={tmp_path}",
            "env.train.env_id=reech-v3",
            "runner.experiment_name=badtask",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "env[0] could not start" in proc.stderr and "unknown task 'reech-v3'; did you mean 'reach-v3'" in proc.stderr
    assert "restarting" not in proc.stdout and time.monotonic() - t0 < 60


@pytest.mark.sim
def test_libero_runs_end_to_end_and_evaluates_on_fixed_initial_states(tmp_path):
    proc = subprocess.run(
        [
            *CTL,
            "start",
            "libero_spatial_ppo_cnn",
            f"runner.logger.log_path={tmp_path}",
            "runner.max_epochs=1",
            "runner.experiment_name=libero",
            "env.train.total_num_envs=2",
            "env.train.max_episode_steps=16",
            "env.train.max_steps_per_rollout_epoch=16",
            "env.eval.total_num_envs=2",
            "env.eval.num_episodes=2",
            "env.eval.max_episode_steps=8",
            "env.eval.video_episodes=2",
            "rollout.pipeline_stage_num=1",
            "actor.micro_batch_size=32",
            "actor.global_batch_size=32",
            "env.train.init_params.fast_render=true",
            "env.eval.init_params.fast_render=true",
            "env.train.init_params.image_size=32",
            "env.eval.init_params.image_size=32",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=modules_env(tmp_path / "modules.json"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_coordinator_loaded_no_env_code(tmp_path / "modules.json")
    log = (tmp_path / "libero" / "logs" / "env_0.log").read_text()
    assert "libero:libero_spatial" in log and "robosuite 1.4.0" in log and "mujoco 3.3.0" in log
    summary = json.loads((tmp_path / "libero" / "summary.json").read_text())
    assert summary["env_id"] == "libero_spatial" and summary["final_eval"]["eval/num_episodes"] == 2
    # the reported rate is the episodes' own: each evaluation episode's outcome is in its video's name
    outcomes = filmed_outcomes(tmp_path / "libero", summary["epochs"])
    assert sorted(outcomes) == [0, 1]
    assert summary["final_eval"]["eval/success_once"] == sum(outcomes.values()) / 2


@pytest.mark.sim
def test_two_simulators_in_one_run_each_from_its_own_environment(tmp_path):
    """env.per_server: env server 0 hosts LIBERO (libero environment), env server 1 Meta-World (metaworld
    environment), both on mujoco 3.3.0 while the main environment keeps its own; one policy acts in their joint
    spaces and the evaluation reports success per simulator."""
    small = [
        "env.train.total_num_envs=2",
        "env.train.max_episode_steps=16",
        "env.train.max_steps_per_rollout_epoch=16",
        "env.eval.total_num_envs=2",
        "env.eval.num_episodes=4",
        "env.eval.max_episode_steps=8",
        "env.eval.video_episodes=4",
        "rollout.pipeline_stage_num=1",
        "actor.micro_batch_size=32",
        "actor.global_batch_size=32",
        "env.train.init_params.fast_render=true",
        "env.eval.init_params.fast_render=true",
        "env.train.init_params.image_size=32",
        "env.eval.init_params.image_size=32",
        "env.per_server=[{},{simulator_type: metaworld, env_id: reach-v3, max_episode_steps: 16, "
        "init_params: {camera: corner, image_size: 32}}]",
    ]
    proc = subprocess.run(
        [
            *CTL,
            "start",
            "libero_metaworld_ppo_cnn",
            f"runner.logger.log_path={tmp_path}",
            "runner.max_epochs=2",
            "runner.experiment_name=mix",
            *small,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=modules_env(tmp_path / "modules.json"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_coordinator_loaded_no_env_code(tmp_path / "modules.json")
    assert (
        "env[0] libero:libero_spatial (agentview[32, 32, 3], state[8], wrist[32, 32, 3]; action 7-D); "
        "env[1] metaworld:reach-v3 (pixels[32, 32, 3], state[39]; action 4-D)"
    ) in proc.stdout
    assert (
        "joint spaces: agentview[32, 32, 3], pixels[32, 32, 3], state[39], wrist[32, 32, 3]; action 7-D" in proc.stdout
    )
    logs = tmp_path / "mix" / "logs"
    libero_log, metaworld_log = (logs / "env_0.log").read_text(), (logs / "env_1.log").read_text()
    assert "libero:libero_spatial" in libero_log and "robosuite 1.4.0" in libero_log and "mujoco 3.3.0" in libero_log
    assert (
        "metaworld:reach-v3" in metaworld_log and "metaworld 3.1.1" in metaworld_log and "mujoco 3.3.0" in metaworld_log
    )
    assert "/envs/libero-" in libero_log and "/envs/metaworld-" in metaworld_log  # two environments
    import mujoco

    assert mujoco.__version__ != "3.3.0"  # the main environment keeps its own version
    summary = json.loads((tmp_path / "mix" / "summary.json").read_text())
    final = summary["final_eval"]
    assert final["eval/num_episodes"] == 4
    # episodes 0-1 ran on env server 0 (LIBERO), 2-3 on env server 1 (Meta-World): each simulator's rate and the
    # overall one are those of the episodes' own outcomes (in their videos' names)
    outcomes = filmed_outcomes(tmp_path / "mix", summary["epochs"])
    assert sorted(outcomes) == [0, 1, 2, 3]
    assert final["eval/libero/success_once"] == (outcomes[0] + outcomes[1]) / 2
    assert final["eval/metaworld/success_once"] == (outcomes[2] + outcomes[3]) / 2
    assert final["eval/success_once"] == sum(outcomes.values()) / 4
    assert "final evaluation: success_once" in proc.stdout and "(libero " in proc.stdout


@pytest.mark.parametrize("placement", [(), COLLOCATED], ids=["inference-server", "collocated"])
def test_scale_env_servers_during_a_run(tmp_path, placement):
    """`coordinatorctl scale env 2` adds a server at the next epoch (samples per epoch double: envs per server are
    fixed), `scale env 1` retires it again; the run goes on throughout. Collocated, the new server gets the
    weights from the learner before it collects."""
    proc = start(tmp_path, "runner.max_epochs=1000", *placement, name="scale")
    run = tmp_path / "scale"
    try:
        st = wait_epoch(run, 2, proc)
        first_env_pid = [s.pid for s in st.services if s.role == coordinator_pb2.ENV][0]
        out = subprocess.run([*CTL, "scale", "env", "2", str(run)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert "env servers 1 -> 2 from the next epoch: 8 envs each, 16 train envs" in out.stdout
        end = time.monotonic() + 120
        while time.monotonic() < end:
            st = status(run)
            envs = [s for s in st.services if s.role == coordinator_pb2.ENV]
            if (
                len(envs) == 2
                and all(s.alive for s in envs)
                and any(r.get("env/env_steps") for r in read_metrics(run)[-1:])
            ):
                steps = [r["env/env_steps"] for r in read_metrics(run) if "env/env_steps" in r]
                if len(steps) >= 3 and steps[-1] - steps[-2] == 400:
                    break
            time.sleep(0.3)
        else:
            pytest.fail(f"the second env server did not join: {st}")
        second_pid = [s.pid for s in envs if s.index == 1][0]
        bad = subprocess.run([*CTL, "scale", "env", "0", str(run)], capture_output=True, text=True, timeout=30)
        assert bad.returncode == 1 and "count: 0 is not in 1..256" in bad.stderr
        assert subprocess.run([*CTL, "scale", "env", "1", str(run)], capture_output=True, timeout=30).returncode == 0
        end = time.monotonic() + 60
        while time.monotonic() < end:
            steps = [r["env/env_steps"] for r in read_metrics(run) if "env/env_steps" in r]
            if (
                len([s for s in status(run).services if s.role == coordinator_pb2.ENV]) == 1
                and steps[-1] - steps[-2] == 200
            ):
                break
            time.sleep(0.3)
        else:
            pytest.fail("the second env server was not retired")
        assert_no_orphans([second_pid])
        proc.send_signal(signal.SIGINT)
        code, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, out
    assert "env servers: 1 -> 2 (16 train envs)" in out and "env servers: 2 -> 1 (8 train envs)" in out
    assert_no_orphans([first_env_pid])


@pytest.mark.parametrize("depth", [1, 2], ids=["staleness1", "staleness2"])
def test_async_collects_ahead_while_training(tmp_path, depth):
    """algorithm.max_staleness=N: the envs collect up to N epochs ahead while the learner trains; samples are at
    most N weights versions old (rollout/staleness), those more than one version old are trained with truncated
    importance weights, every epoch is trained exactly once, and the run finishes as usual."""
    # a long update (many passes) so the envs do get N epochs ahead of it
    code, out = finish(
        start(
            tmp_path,
            "runner.max_epochs=8",
            "runner.val_check_interval=4",
            f"algorithm.max_staleness={depth}",
            f"algorithm.update_epoch={10 if depth == 1 else 150}",
            name="async",
        )
    )
    assert code == 0, out
    records = [r for r in read_metrics(tmp_path / "async") if "rollout/staleness" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    # up to N when training k published its weights while later epochs were being collected
    assert records[0]["rollout/staleness"] == 0 and all(0 <= r["rollout/staleness"] <= depth for r in records)
    assert sum(r["rollout/staleness"] for r in records) >= 4
    assert all(0 <= r["rollout/stale_fraction"] <= 1 for r in records)
    if depth == 1:
        assert all(r["rollout/stale_fraction"] == 0 for r in records)
    else:
        assert any(r["rollout/staleness"] == 2 for r in records)
        assert all("train/actor/is_weight_mean" in r for r in records if r["rollout/stale_fraction"] > 0)
    assert [r["env/env_steps"] for r in records] == [200 * (i + 1) for i in range(8)]
    summary = json.loads((tmp_path / "async" / "summary.json").read_text())
    assert summary["epochs"] == 8 and summary["final_eval"]["eval/num_episodes"] == 4


@pytest.mark.parametrize("staleness", ["0", "1"], ids=["sync", "async"])
def test_bottleneck_line_in_status_console_and_summary(tmp_path, staleness):
    """A live run's `coordinatorctl status` has a "bottleneck: ..." line (services/coordinator/bottleneck.py), the
    console says it once a window of epochs is in, and summary.json and the end-of-run summary carry it."""
    from services.coordinator.bottleneck import WINDOW

    proc = start(
        tmp_path,
        "runner.max_epochs=1000",
        "runner.val_check_interval=0",
        f"algorithm.max_staleness={staleness}",
        name="diagnosed",
    )
    run = tmp_path / "diagnosed"
    wait_epoch(run, WINDOW + 2, proc)
    status_out = subprocess.run([*CTL, "status", str(run)], capture_output=True, text=True, timeout=30)
    assert status_out.returncode == 0, status_out.stderr
    lines = [ln.strip() for ln in status_out.stdout.splitlines() if ln.strip().startswith("bottleneck: ")]
    assert len(lines) == 1, status_out.stdout
    stop = subprocess.run([*CTL, "stop", str(run)], capture_output=True, text=True, timeout=30)
    assert stop.returncode == 0, stop.stderr
    code, out = finish(proc)
    assert code == 0, out
    print(status_out.stdout, out, sep="\n")  # what a user sees (pytest -s)
    summary = json.loads((run / "summary.json").read_text())
    detail = summary["bottleneck_detail"]
    assert summary["bottleneck"] and detail["line"] == summary["bottleneck"] and detail["epochs"] == WINDOW
    assert detail["part"] in {"env", "inference", "learner", "rest", "wire", "balanced"}
    assert all(0 <= v <= 1 for v in detail["shares"].values())
    assert f"bottleneck (last {WINDOW} epochs): {summary['bottleneck']}" in out
    assert sum(ln.startswith("  bottleneck: ") for ln in out.splitlines()) >= 1  # said once the window filled


def _learning_record(records):
    """A run's metrics without the wall-clock ones (the only things two runs of one seed may differ in)."""
    timed = ("time/", "wall_time", "per_s")
    return [{k: v for k, v in r.items() if not any(t in k for t in timed)} for r in records]


def test_one_seed_gives_the_same_run_twice(tmp_path):
    """Synchronous mode repeats bit for bit per seed, with two env servers and two pipeline stages feeding one
    dynamic batcher: sampling noise is keyed per env and step (rlfleet.wire.codec), act batches are padded so a row's
    numbers do not depend on its batch companions, env seeds come from the run seed. Another seed differs."""
    args = [
        "runner.max_epochs=3",
        "runner.val_check_interval=3",
        "cluster.num_env_servers=2",
        "rollout.pipeline_stage_num=2",
    ]
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        code, out = finish(start(tmp_path, *args, f"runner.seed={seed}", name=name))
        assert code == 0, out
        runs[name] = _learning_record(read_metrics(tmp_path / name))
    assert len(runs["a"]) == 4 and "train/actor/policy_loss" in runs["a"][0] and "eval/return" in runs["a"][-1]
    assert runs["a"] == runs["b"]
    assert runs["a"][0]["env/reward"] != runs["c"][0]["env/reward"]

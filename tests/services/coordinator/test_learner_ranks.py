"""The learner as a group of ranks: config checks, the plan's layout and torchrun command, the manifests (compose,
an Indexed Job over nodes on Kubernetes) and, for real, the local launcher's torchrun agent: its ranks die with it,
it dies with the coordinator (even by kill -9), and the coordinator's health monitor matches its exit to the
learner (rank 0 registers the agent's pid). The real launches run a stand-in rank (rank_probe.py), not the learner.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import kubernetes_validate
import pytest
import yaml

from rlfleet.config import ConfigError, learner_layout, load_config
from rlfleet.v1 import coordinator_pb2
from rlfleet.wire import auth
from rlfleet.wire.service import CANNOT_START
from services.coordinator import deploy
from services.coordinator.launcher import AGENT, LocalLauncher
from services.coordinator.plan import process_plan
from services.coordinator.service_registry import HealthMonitor, Registry, RunFate
from tests.services.coordinator import rank_probe
from tests.services.coordinator.test_deploy import k8s_docs

ROOT = str(pathlib.Path(__file__).resolve().parents[3])
CPU_RANKS = rank_probe.CPU_RANKS
ONE_NODE = ["cluster.num_gpus_per_node=8", "cluster.component_placement={env: 0-3, rollout: 4-7, actor: 0-7}"]
TWO_NODES = [
    "cluster.num_nodes=2",
    "cluster.num_gpus_per_node=8",
    "cluster.num_env_servers=2",
    "cluster.component_placement={env: 0-7, rollout: 8-15, actor: 0-15}",
]


def learner(cfg):
    return next(s for s in process_plan(cfg) if s.role == "learner")


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


# --- config and plan ---------------------------------------------------------------------------------------------
def test_cpu_ranks_run_torchrun_standalone():
    spec = learner(load_config(None, CPU_RANKS))
    assert (spec.nnodes, spec.nproc_per_node, spec.world_size, spec.gpus) == (1, 2, 2, ())
    cmd = spec.command("run.yaml", "127.0.0.1:0", "127.0.0.1:9", "/runs/x")
    agent_flags, target = (
        cmd[: cmd.index("services.learner.server") - 1],
        cmd[cmd.index("services.learner.server") - 1 :],
    )
    assert agent_flags[:2] == ["-m", "torch.distributed.run"]
    assert "--standalone" in agent_flags and "--master-port" not in agent_flags  # a free port: runs never collide
    assert flag(agent_flags, "--nproc-per-node") == "2" and flag(agent_flags, "--nnodes") == "1"
    assert flag(agent_flags, "--max-restarts") == "0" and float(flag(agent_flags, "--monitor-interval")) <= 1
    assert target == ["-m", "services.learner.server", *spec.args("run.yaml", "127.0.0.1:0", "127.0.0.1:9", "/runs/x")]
    # one rank: exactly today's command
    single = learner(load_config())
    assert single.world_size == 1
    assert single.command("c", "a", "k", "r") == ["-m", "services.learner.server", *single.args("c", "a", "k", "r")]


def test_eight_gpus_of_the_actor_are_eight_ranks_on_one_node():
    spec = learner(load_config(None, ONE_NODE))
    assert (spec.nnodes, spec.nproc_per_node) == (1, 8)
    assert spec.cuda_visible_devices == "0,1,2,3,4,5,6,7"
    cmd = spec.command("c", "a", "k", "r")
    assert flag(cmd, "--nproc-per-node") == "8" and "--standalone" in cmd
    assert learner_layout(load_config(None, ONE_NODE + ["cluster.learner_world_size=8"])) == (1, 8)


def test_sixteen_gpus_over_two_nodes_are_two_nodes_of_eight_ranks():
    cfg = load_config(None, TWO_NODES)
    assert learner_layout(cfg) == (2, 8)
    spec = learner(cfg)
    assert (spec.nnodes, spec.nproc_per_node, spec.world_size) == (2, 8, 16)
    assert spec.gpus == tuple(range(16)) and spec.cuda_visible_devices == "0,1,2,3,4,5,6,7"  # one node's devices
    cmd = spec.command("c", "a", "k", "r", master="learner-0.learner-ranks:29500", node_rank="$(NODE_RANK)")
    assert "--standalone" not in cmd and flag(cmd, "--nnodes") == "2" and flag(cmd, "--nproc-per-node") == "8"
    assert flag(cmd, "--node-rank") == "$(NODE_RANK)" and flag(cmd, "--rdzv-backend") == "static"
    assert (flag(cmd, "--master-addr"), flag(cmd, "--master-port")) == ("learner-0.learner-ranks", "29500")
    with pytest.raises(ValueError, match="rendezvous address"):
        spec.command("c", "a", "k", "r")
    # half of each node is 2 x 4 ranks
    half = load_config(
        None,
        [
            "cluster.num_nodes=2",
            "cluster.num_gpus_per_node=8",
            "cluster.component_placement={'env,rollout': all, actor: '4-11'}",
        ],
    )
    assert learner_layout(half) == (2, 4)


@pytest.mark.parametrize(
    "overrides, why",
    [
        (["cluster.learner_world_size=0"], r"'cluster.learner_world_size': must be an integer >= 1, got 0"),
        (["cluster.learner_world_size=1.5"], r"'cluster.learner_world_size': must be an integer >= 1"),
        (
            ONE_NODE + ["cluster.learner_world_size=4"],
            r"'cluster.learner_world_size': 4 ranks, but the actor is placed on 8 GPU\(s\) "
            r"\(cluster.component_placement.actor = '0-7'\).*leave it at 1 or set 8",
        ),
        (
            [
                "cluster.num_nodes=2",
                "cluster.num_gpus_per_node=8",
                "cluster.component_placement={'env,rollout': all, actor: 0-11}",
            ],
            r"'cluster.component_placement.actor': .*same number of GPUs on each node.*8 on node 0, 4 on node 1",
        ),
        (["cluster.learner_collective_timeout_s=0"], r"'cluster.learner_collective_timeout_s': must be > 0"),
        (["cluster.learner_master_port=0"], r"'cluster.learner_master_port': must be a port number in 1..65535"),
        (["cluster.learner_master_port=65536"], r"'cluster.learner_master_port'"),
        (["actor.weights_bucket_mb=0"], r"'actor.weights_bucket_mb': must be > 0"),
    ],
)
def test_config_errors_name_the_key(overrides, why):
    with pytest.raises(ConfigError, match=why):
        load_config(None, overrides)


# --- manifests ---------------------------------------------------------------------------------------------------
def test_k8s_learner_over_two_nodes_is_an_indexed_job(tmp_path):
    cfg = load_config(None, TWO_NODES)
    docs = k8s_docs(cfg, tmp_path)
    assert not [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "learner"]
    job = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "learner")["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"], job["backoffLimit"]) == ("Indexed", 2, 2, 0)
    pod = job["template"]["spec"]
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    ranks = services[pod["subdomain"]]  # pods are <job>-<index>.<subdomain>
    assert ranks["clusterIP"] == "None" and ranks["publishNotReadyAddresses"] is True  # DNS before readiness
    assert ranks["selector"] == job["template"]["metadata"]["labels"]
    assert ranks["ports"][0]["port"] == 29500
    # the gRPC service: pod 0 only (rank 0 serves gRPC)
    grpc_svc = services["learner"]
    assert grpc_svc["selector"] == {
        **job["template"]["metadata"]["labels"],
        "batch.kubernetes.io/job-completion-index": "0",
    }
    assert grpc_svc["ports"][0]["port"] == 50052
    (container,) = pod["containers"]
    cmd = container["command"]
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    assert flag(cmd, "--nnodes") == "2" and flag(cmd, "--nproc-per-node") == "8"
    master = f"learner-0.{pod['subdomain']}"
    assert (flag(cmd, "--master-addr"), flag(cmd, "--master-port")) == (master, "29500")
    assert flag(cmd, "--node-rank") == "$(NODE_RANK)"
    assert flag(cmd, "--advertise") == f"{master}:50052"
    env = {e["name"]: e for e in container["env"]}
    index = {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert env["NODE_RANK"]["valueFrom"] == index and env["PET_NODE_RANK"]["valueFrom"] == index
    assert env["PET_MASTER_ADDR"]["value"] == master and env["PET_NPROC_PER_NODE"]["value"] == "8"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert "RLFLEET_RUN_TOKEN" in env and pod["restartPolicy"] == "Never"
    # only pod 0 is probed for gRPC
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["sh", "-c"] and '"$NODE_RANK" != 0' in probe[2] and "127.0.0.1:50052" in probe[2]
    # the other roles are unchanged: StatefulSets
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "StatefulSet"} == {"env", "inference"}


def test_k8s_learner_on_one_node_runs_torchrun_in_its_pod(tmp_path):
    docs = deploy.k8s(load_config(None, ONE_NODE))
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    pod = sets["learner"]["spec"]["template"]["spec"]
    cmd = pod["containers"][0]["command"]
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"] and "--standalone" in cmd
    assert flag(cmd, "--nproc-per-node") == "8" and flag(cmd, "--index") == "$(POD_INDEX)"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert not [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "learner"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)


def test_compose_runs_torchrun_for_two_cpu_ranks_and_refuses_two_nodes(tmp_path):
    deploy.write("compose", load_config(None, CPU_RANKS), tmp_path)
    services = yaml.safe_load((tmp_path / "docker-compose.yml").read_text())["services"]
    cmd = services["learner-0"]["command"]
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and flag(cmd, "--nproc-per-node") == "2"
    assert cmd[cmd.index("services.learner.server") - 1] == "-m" and flag(cmd, "--advertise") == "learner-0:50052"
    assert services["learner-0"]["shm_size"] == deploy.SHM_SIZE
    assert services["env-0"]["command"][:3] == ["python", "-m", "services.env.server"]  # one process each
    with pytest.raises(ConfigError, match=r"span 2 nodes.*coordinatorctl deploy k8s"):
        deploy.write("compose", load_config(None, TWO_NODES), tmp_path / "two")
    assert not (tmp_path / "two").exists()  # refused before writing anything


# --- the local launcher ------------------------------------------------------------------------------------------
def test_local_launcher_refuses_a_learner_over_two_nodes(tmp_path, capsys):
    cfg = load_config(None, TWO_NODES)
    with pytest.raises(ConfigError, match=r"'cluster.launcher'.*span 2 nodes.*coordinatorctl deploy k8s"):
        LocalLauncher(cfg, tmp_path, tmp_path / "c.yaml", "127.0.0.1:1")
    from services.coordinator import cli

    assert cli.main(["start", "pandapickcube_ppo", *TWO_NODES, f"runner.logger.log_path={tmp_path}"]) == 2
    assert "coordinatorctl deploy k8s" in capsys.readouterr().err


def test_local_launcher_gives_the_learner_its_devices_and_the_agent(tmp_path, monkeypatch):
    seen = {}

    class FakePopen:
        pid = 0

        def __init__(self, cmd, env, **kw):
            seen[cmd[cmd.index("-m") + 1]] = (cmd, env)

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    LocalLauncher(load_config(None, ONE_NODE), tmp_path, tmp_path / "c.yaml", "127.0.0.1:1").start_all()
    cmd, env = seen[AGENT]
    assert cmd[:3] == [sys.executable, "-m", AGENT] and "--standalone" in cmd
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"  # the whole range; rank i takes cuda:LOCAL_RANK
    assert seen["services.env.server"][1]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


class _FakeLauncher:
    def __init__(self, proc, code):
        self.proc, self.code = proc, code

    def exited(self):
        return [(self.proc, self.code)]

    @staticmethod
    def log_tail(proc, lines=15):
        return ""


@pytest.mark.parametrize(
    "registered, code, fatal",
    [
        ("agent", 1, "learner[0] died: exited with code 1"),
        # a rank failing after the group came up (its own code, through the agent) is a death, not a failed start
        ("agent", CANNOT_START, "learner[0] died: exited with code 3"),
        (None, CANNOT_START, "learner[0] could not start"),
        ("rank", 1, None),  # a pid the launcher did not start: its exit is not matched (only heartbeats would tell)
    ],
)
def test_health_monitor_matches_the_agents_exit_to_the_learner(tmp_path, registered, code, fatal):
    cfg = load_config(None, CPU_RANKS + ["cluster.heartbeat_timeout_s=60"])
    agent, rank = 4242, 4243
    proc = type("Proc", (), {"role": "learner", "index": 0, "popen": type("P", (), {"pid": agent})()})()
    fate = RunFate()
    reg = Registry(cfg, fate, lambda *a, **k: None)
    if registered:
        reg.register(coordinator_pb2.LEARNER, 0, "127.0.0.1:1", agent if registered == "agent" else rank, "i")
    HealthMonitor(reg, _FakeLauncher(proc, code), cfg, tmp_path, lambda *a, **k: None).start()
    fate.stop_event.wait(1.0)
    reg.shutting_down = True
    if fatal is None:
        assert fate.fatal is None
    else:
        assert fate.fatal.startswith(fatal)
        assert ("coordinatorctl start --resume" in fate.fatal) == ("died" in fatal)


# --- real launches: torchrun's agent and two stand-in ranks ------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")  # a zombie is dead
    except FileNotFoundError:
        return False


def _wait(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"{what} within {timeout} s")
        time.sleep(0.02)


def _ranks(run_dir: pathlib.Path, n: int = 2) -> list[dict]:
    _wait(lambda: len(list(run_dir.glob("rank_*.json"))) == n, 30, f"{n} ranks did not start")
    return [json.loads((run_dir / f"rank_{r}.json").read_text()) for r in range(n)]


@pytest.fixture
def probe_env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.delenv("RANK_PROBE_EXIT", raising=False)


def test_a_killed_agent_takes_its_ranks_and_the_monitor_names_the_learner(tmp_path, probe_env):
    launcher = rank_probe.launcher(tmp_path)
    proc = launcher.start("learner", 0)
    assert proc.popen.args[1:3] == ["-m", AGENT] and "--standalone" in proc.popen.args
    try:
        ranks = _ranks(tmp_path)
        assert sorted(r["RANK"] for r in ranks) == ["0", "1"] and {r["WORLD_SIZE"] for r in ranks} == {"2"}
        for r in ranks:  # each rank's parent is the agent, the process the launcher started
            assert r["ppid"] == proc.popen.pid and r["RLFLEET_PARENT_PID"] == str(proc.popen.pid)
            assert r["launched_pid"] == proc.popen.pid
            assert r["RLFLEET_RUN_TOKEN"] == auth.issue("t", "learner", 0)  # the learner's credential, not the secret
        fate = RunFate()
        reg = Registry(launcher.cfg, fate, lambda *a, **k: None)
        reg.register(coordinator_pb2.LEARNER, 0, "127.0.0.1:1", ranks[0]["launched_pid"], "i")  # what rank 0 sends
        HealthMonitor(reg, launcher, launcher.cfg, tmp_path, lambda *a, **k: None).start()
        os.kill(proc.popen.pid, signal.SIGKILL)
        _wait(lambda: not any(_alive(r["pid"]) for r in ranks), 5, "the ranks did not die with their agent")
        _wait(lambda: fate.fatal is not None, 5, "the health monitor did not notice the learner's exit")
        reg.shutting_down = True
        assert "learner[0] died: exited with code -9" in fate.fatal
    finally:
        launcher.stop_all(timeout=2)


COORDINATOR = """
import sys, pathlib, time
from tests.services.coordinator.rank_probe import launcher
print(launcher(pathlib.Path(sys.argv[1])).start("learner", 0).popen.pid, flush=True)
time.sleep(120)
"""


def test_a_killed_coordinator_takes_the_agent_and_its_ranks(tmp_path, probe_env):
    coordinator = subprocess.Popen(
        [sys.executable, "-c", COORDINATOR, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    agent = 0
    try:
        agent = int(coordinator.stdout.readline())
        ranks = _ranks(tmp_path)
        assert {r["ppid"] for r in ranks} == {agent}
        coordinator.kill()
        coordinator.wait(5)
        pids = [agent] + [r["pid"] for r in ranks]
        _wait(lambda: not any(_alive(p) for p in pids), 10, "the agent and its ranks did not die with the coordinator")
    finally:
        coordinator.kill()
        for pid in [agent] + [r["pid"] for r in _ranks_if_any(tmp_path)]:
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _ranks_if_any(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in run_dir.glob("rank_*.json")]


def test_a_rank_that_cannot_start_ends_the_group_with_its_code(tmp_path, probe_env, monkeypatch):
    monkeypatch.setenv("RANK_PROBE_EXIT", str(CANNOT_START))  # rank 1 fails before serving; rank 0 waits
    launcher = rank_probe.launcher(tmp_path)
    fate = RunFate()
    reg = Registry(launcher.cfg, fate, lambda *a, **k: None)  # nothing registers: it fails before serving
    HealthMonitor(reg, launcher, launcher.cfg, tmp_path, lambda *a, **k: None).start()
    proc = launcher.start("learner", 0)
    try:
        ranks = _ranks(tmp_path)
        code = proc.popen.wait(15)
        assert code == CANNOT_START  # rank 1's own code, not torchrun's 1
        _wait(lambda: not _alive(ranks[0]["pid"]), 5, "rank 0 did not end with the group")
        _wait(lambda: fate.fatal is not None, 5, "the health monitor did not notice the learner's exit")
        reg.shutting_down = True
        assert fate.fatal.startswith("learner[0] could not start") and "rank 1 exited with code 3" in fate.fatal
    finally:
        launcher.stop_all(timeout=2)

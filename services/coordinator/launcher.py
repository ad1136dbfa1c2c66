"""Local launcher: every service as a child process of the coordinator on this machine.

Children run in their own session (a terminal's Ctrl-C reaches only the coordinator, which then stops them in
order) and bind themselves to the coordinator's life with PR_SET_PDEATHSIG (``RLFLEET_PARENT_PID``, see
``rlfleet.service``), so a killed coordinator leaves no orphans. No Python runs between fork and exec (no
preexec_fn): the coordinator has gRPC threads, and forking those is unsafe.
Each process gets CUDA_VISIBLE_DEVICES for its placed GPU range. Env servers run with their simulator's own
Python environment (rlfleet.environments), built before the run starts.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from rlfleet import environments
from rlfleet.config import cuda_visible_devices, parse_placement

MODULES = {"env": "services.env.server", "inference": "services.inference.server", "learner": "services.learner.server"}
COMPONENT = {"env": "env", "inference": "rollout", "learner": "actor"}


def child_environ(python: str, num_threads: int, **extra: str) -> dict[str, str]:
    """Environment variables of a child process run by ``python`` (a simulator environment's interpreter gets
    rlfleet's env side from this checkout through PYTHONPATH)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(num_threads), **extra)
    env.setdefault("MUJOCO_GL", "egl")
    if python != sys.executable:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(environments.REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.pop("VIRTUAL_ENV", None)
    return env


@dataclass
class Proc:
    role: str
    index: int
    popen: subprocess.Popen
    log_path: pathlib.Path
    started: float


class LocalLauncher:
    def __init__(self, cfg, run_dir: pathlib.Path, config_path: pathlib.Path, coordinator_address: str):
        self.cfg = cfg
        self.run_dir = run_dir
        self.config_path = config_path
        self.coordinator_address = coordinator_address
        self.procs: dict[tuple[str, int], Proc] = {}
        self.pythons: dict[str, str] = {}  # role -> interpreter (env: the simulator's environment)
        gpus = cfg.cluster.num_nodes * cfg.cluster.num_gpus_per_node
        self.placement = parse_placement(cfg.cluster.component_placement, gpus)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def devices_for(self, role: str, index: int, count: int) -> str:
        ranks = self.placement[COMPONENT[role]]
        if not ranks:
            return ""
        if len(ranks) >= count:  # one process per GPU slice of the range
            per = len(ranks) // count
            ranks = ranks[index * per:(index + 1) * per]
        return cuda_visible_devices(ranks, self.cfg.cluster.num_gpus_per_node)

    def prepare(self, log=print) -> None:
        """Build (or find) the simulator environment env servers run in; a first build prints its progress."""
        if not self.cfg.cluster.external_env_addresses:
            self.pythons["env"] = environments.python_for(self.cfg.env.train.simulator_type,
                                                          self.cfg.cluster.envs_dir, log)

    def start(self, role: str, index: int, count: int) -> Proc:
        python = self.pythons.get(role, sys.executable)
        cmd = [python, "-m", MODULES[role], "--config", str(self.config_path), "--index", str(index),
               "--address", f"{self.cfg.cluster.host}:0", "--coordinator", self.coordinator_address]
        if role == "learner":
            cmd += ["--run-dir", str(self.run_dir)]
        if role == "env" and self.cfg.cluster.external_env_addresses:
            cmd += ["--external-env", str(self.cfg.cluster.external_env_addresses[index])]
        env = child_environ(python, self.cfg.cluster.torch_num_threads, RLFLEET_PARENT_PID=str(os.getpid()),
                            CUDA_VISIBLE_DEVICES=self.devices_for(role, index, count))
        log_path = self.run_dir / "logs" / f"{role}_{index}.log"
        log_file = open(log_path, "ab")
        popen = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 start_new_session=True)
        log_file.close()
        proc = Proc(role, index, popen, log_path, time.monotonic())
        self.procs[(role, index)] = proc
        return proc

    def exited(self) -> list[tuple[Proc, int]]:
        return [(p, p.popen.returncode) for p in self.procs.values() if p.popen.poll() is not None]

    def kill(self, role: str, index: int) -> None:
        proc = self.procs.get((role, index))
        if proc and proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait(5)

    def stop_all(self, timeout: float = 10.0) -> None:
        for p in self.procs.values():
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.popen.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(5)

    @staticmethod
    def log_tail(proc: Proc, lines: int = 15) -> str:
        try:
            text = proc.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in text[-lines:])

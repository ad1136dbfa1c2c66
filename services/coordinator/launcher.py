"""Launchers: how the processes of :func:`services.coordinator.plan.process_plan` come to exist.

``LocalLauncher`` starts every service as a child process of the coordinator on this machine; ``AttachLauncher``
starts nothing and waits for services started elsewhere (compose, Kubernetes, other hosts) to register;
``make_launcher`` picks one from ``cluster.launcher``. `coordinatorctl deploy` writes the compose and Kubernetes
manifests from the same plan (services/coordinator/deploy.py).

Local children run in their own session (a terminal's Ctrl-C reaches only the coordinator, which then stops them in
order) and bind themselves to the coordinator's life with PR_SET_PDEATHSIG (``RLFLEET_PARENT_PID``, see
``rlfleet.wire.service``), so a killed coordinator leaves no orphans. No Python runs between fork and exec (no
preexec_fn): the coordinator has gRPC threads, and forking those is unsafe.
A learner of several ranks (``ProcessSpec.world_size`` > 1) is started as torchrun's agent, ``python -m
rlfleet.wire.torchrun --standalone --nproc-per-node N ...`` (torch.distributed.run in a process of ours that binds itself
to the coordinator and its ranks to itself: see rlfleet/wire/torchrun.py); rank 0 registers the agent's pid, the process
this launcher started and watches. A learner over several nodes is refused here (`coordinatorctl deploy k8s`).
Each process gets CUDA_VISIBLE_DEVICES for its placed GPU range, the CPU cores it pins itself to
(RLFLEET_CPU_CORES, from cluster.cpu_placement), its own credential issued from the run secret (RLFLEET_RUN_TOKEN,
rlfleet.wire.auth) and where its traces go
(RLFLEET_TRACE_DIR). Env servers run with their simulator's own Python environment
(rlfleet.simulators.environments), built before the run starts.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from rlfleet.config import ConfigError, learner_layout
from rlfleet.policies.backends import get_backend
from rlfleet.simulators import environments
from rlfleet.simulators.environments import child_environ
from rlfleet.wire import auth, tracing
from rlfleet.wire.service import CPU_CORES_ENV, PARENT_PID_ENV
from services.coordinator.plan import ProcessSpec, cpu_placement, process_plan

AGENT = "rlfleet.wire.torchrun"  # torchrun's agent, bound to the coordinator's life (a learner of several ranks)


def check_local(cfg) -> None:
    """Raise ConfigError when the local launcher cannot start this run: a learner whose ranks span nodes, or a CPU
    placement (cluster.cpu_placement) naming cores this process may not use (before any service starts)."""
    cpu_placement(cfg, sorted(os.sched_getaffinity(0)))
    nnodes, per_node = learner_layout(cfg)
    if nnodes > 1:
        raise ConfigError(
            f"'cluster.launcher': the learner's {nnodes * per_node} ranks span {nnodes} nodes ({per_node} GPUs each, "
            f"cluster.component_placement's actor range), and the local launcher starts processes on this machine "
            f"only: deploy the run with `coordinatorctl deploy k8s` (an Indexed Job, one learner pod per node), or "
            f"start the learner's nodes yourself and set cluster.launcher=attach"
        )


ENV_SIDE_COMMAND = [sys.executable, "-m", "services.env.environment"]  # the env side's environment command


def simulator_python(simulator: str, envs_dir: str | None = None, log=print) -> str:
    """The python env servers of ``simulator`` run with: the main one, its built environment's, or (not built yet)
    what the env side's command builds (a subprocess: the coordinator never imports env code); its progress goes
    to ``log``. Raises EnvironmentError_ with the build's last lines when it fails."""
    python = environments.installed_python(simulator, envs_dir)
    if python:
        return python
    cmd = [*ENV_SIDE_COMMAND, "python", simulator, *(["--envs-dir", str(envs_dir)] if envs_dir else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tail: list[str] = []
    for line in proc.stderr:
        log(line.rstrip())
        tail = (tail + [line.rstrip()])[-20:]
    out = proc.stdout.read().strip()
    if proc.wait() != 0 or not out:
        raise environments.EnvironmentError_("\n".join(tail) or f"{' '.join(cmd)} failed (exit {proc.returncode})")
    return out.splitlines()[-1]


@dataclass
class Proc:
    role: str
    index: int
    popen: subprocess.Popen
    log_path: pathlib.Path
    started: float


class AttachLauncher:
    """cluster.launcher=attach: the services are started elsewhere and register by address."""

    def prepare(self, log=print) -> None:
        pass

    def start_all(self) -> None:
        pass

    def start(self, role: str, index: int) -> None:
        pass  # a container platform restarts what it runs

    def resize(self, role: str, count: int) -> None:
        pass  # the operator changes the replicas (kubectl scale statefulset env --replicas N)

    def retire(self, role: str, index: int, timeout: float = 10.0) -> None:
        pass  # told to leave through its heartbeats

    def exited(self) -> list:
        return []

    def kill(self, role: str, index: int) -> None:
        pass

    def stop_all(self, timeout: float = 10.0) -> None:
        pass  # the services leave when their heartbeats say the run is over


class LocalLauncher:
    def __init__(
        self, cfg, run_dir: pathlib.Path, config_path: pathlib.Path, coordinator_address: str, token: str | None = None
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.config_path = config_path
        self.coordinator_address = coordinator_address
        self.token = token
        check_local(cfg)
        self.cores = sorted(os.sched_getaffinity(0))  # the cores this run may use
        self.specs = {(s.role, s.index): s for s in process_plan(cfg, cores=self.cores)}
        self.procs: dict[tuple[str, int], Proc] = {}
        self.pythons: dict[str, str] = {}  # role -> interpreter (inference: its backend's environment)
        self.env_pythons: dict[str, str] = {}  # simulator -> interpreter of its environment (env servers)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def devices_for(self, role: str, index: int) -> str:
        return self.specs[(role, index)].cuda_visible_devices

    def prepare(self, log=print) -> None:
        """Build (or find) the simulator environment env servers run in; a first build prints its progress."""
        for sim in dict.fromkeys(s.simulator for s in self.specs.values() if s.role == "env" and s.simulator):
            self.env_pythons[sim] = simulator_python(sim, self.cfg.cluster.envs_dir, log)
        backend = get_backend(self.cfg.rollout.backend)
        if backend.environment is not None:  # e.g. vLLM: the inference servers run from its own environment
            self.pythons["inference"] = str(environments.ensure(backend.environment, self.cfg.cluster.envs_dir, log))
        if any(s.cpus and set(s.cpus) != set(self.cores) for s in self.specs.values()):
            log(
                "  CPU placement (cluster.cpu_placement): "
                + ", ".join(
                    f"{s.name} on core{'s' if len(s.cpus) > 1 else ''} {','.join(map(str, s.cpus))}"
                    for s in self.specs.values()
                )
            )

    def start_all(self) -> None:
        for role, index in self.specs:
            self.start(role, index)

    def resize(self, role: str, count: int) -> None:
        """Plan ``count`` servers of ``role`` (env): new indices get their spec (GPU slice of the new count)."""
        for spec in process_plan(self.cfg, num_env_servers=count, cores=self.cores):
            if spec.role == role:
                self.specs.setdefault((role, spec.index), spec)

    def retire(self, role: str, index: int, timeout: float = 10.0) -> None:
        """Stop a server that is no longer part of the run (scaled away); it is not restarted."""
        proc = self.procs.pop((role, index), None)
        self.specs.pop((role, index), None)
        if proc and proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)

    def start(self, role: str, index: int) -> Proc:
        spec: ProcessSpec = self.specs[(role, index)]
        if role == "env" and spec.simulator:  # its simulator's environment (a scaled-up server's may be new)
            if spec.simulator not in self.env_pythons:
                self.env_pythons[spec.simulator] = simulator_python(spec.simulator, self.cfg.cluster.envs_dir)
            python = self.env_pythons[spec.simulator]
        else:
            python = self.pythons.get(role, sys.executable)
        # a learner of several ranks: torchrun's agent (rlfleet.wire.torchrun), --standalone on a free port
        cmd = [
            python,
            *spec.command(
                str(self.config_path),
                f"{self.cfg.cluster.host}:0",
                self.coordinator_address,
                str(self.run_dir),
                agent=AGENT,
            ),
        ]
        # this process's own credential, issued from the run secret (which stays with the coordinator)
        extra = {auth.TOKEN_ENV: auth.issue(self.token, role, index)} if self.token else {}
        if spec.cpus:
            extra[CPU_CORES_ENV] = ",".join(map(str, spec.cpus))
        env = child_environ(
            python,
            self.cfg.cluster.torch_num_threads,
            **{PARENT_PID_ENV: str(os.getpid())},
            CUDA_VISIBLE_DEVICES=spec.cuda_visible_devices,
            **{tracing.TRACE_DIR_ENV: str(self.run_dir / "traces")},
            **extra,
        )
        log_path = self.run_dir / "logs" / f"{role}_{index}.log"
        log_file = open(log_path, "ab")
        popen = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
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


def make_launcher(cfg, run_dir: pathlib.Path, config_path: pathlib.Path, coordinator_address: str, token: str | None):
    """The one place that turns ``cluster.launcher`` into a launcher."""
    if cfg.cluster.launcher == "local":
        return LocalLauncher(cfg, run_dir, config_path, coordinator_address, token)
    return AttachLauncher()

"""What processes a run config needs: one pure function, used by every launcher and by `coordinatorctl deploy`.

``process_plan(cfg)`` lists the services (role, index, module, GPU ranks, simulator) without starting anything
or touching the disk. The local launcher turns each entry into a child process; the compose and Kubernetes
generators turn the same entries into containers; so a placement or a server count means the same everywhere.

The learner is a group of ranks (``rlfleet.config.learner_layout``: one per GPU of the actor's range, or
``cluster.learner_world_size`` on CPU). Its entry carries the layout (``nnodes`` x ``nproc_per_node``) and
``ProcessSpec.command`` gives every launcher the same command line: the learner module itself for one rank, else
torchrun's agent (``-m torch.distributed.run``) with ``--max-restarts 0`` (a dead rank ends the group, and the run
stops with its resume command) starting ``nproc_per_node`` copies of it on each node: ``--standalone`` on one node
(a free rendezvous port: concurrent runs never collide), static rendezvous at node 0's ``host:port`` with
``--node-rank`` over several, so the rank-0 process (the one that serves gRPC) is always on node 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.config import (
    ConfigError,
    cuda_visible_devices,
    env_server_config,
    learner_layout,
    parse_placement,
    resolve_cpu_placement,
    rollout_in_env,
)

MODULES = {"env": "services.env.server", "inference": "services.inference.server", "learner": "services.learner.server"}
COMPONENT = {"env": "env", "inference": "rollout", "learner": "actor"}  # RLinf's component names per role
PORTS = {"coordinator": 50051, "learner": 50052, "inference": 50053, "env": 50054}  # in containers
TORCHRUN = "torch.distributed.run"  # torchrun's agent, as a module
MONITOR_INTERVAL_S = 0.5  # how often torchrun's agent checks its ranks (a dead one ends the group within this)


@dataclass(frozen=True)
class ProcessSpec:
    role: str  # env | inference | learner
    index: int  # index among its role
    module: str  # python -m <module>
    gpus: tuple[int, ...]  # global GPU ranks placed on this process (cluster.component_placement)
    cuda_visible_devices: str  # the same ranks as device ids on their node ('' = CPU)
    simulator: str | None  # env servers: the simulator whose environment they run in
    external_env: str | None  # env servers bridging an external simulator: its address
    cpus: tuple[int, ...] = ()  # CPU cores the local launcher pins it to (cluster.cpu_placement; () = any core)
    nnodes: int = 1  # learner: nodes its ranks span (rlfleet.config.learner_layout)
    nproc_per_node: int = 1  # learner: ranks per node

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def command(
        self,
        config: str,
        address: str,
        coordinator: str,
        run_dir: str | None = None,
        advertise: str | None = None,
        *,
        agent: str = TORCHRUN,
        master: str | None = None,
        node_rank: str = "0",
    ) -> list[str]:
        """The command line after the interpreter, the same for every launcher: ``-m <module> <args>``, or for a
        learner of several ranks torchrun's agent starting ``nproc_per_node`` of them here. ``agent``: the module
        of the agent (torch.distributed.run, or a drop-in that runs it: the local launcher's rlfleet.wire.torchrun).
        Over several nodes, ``master`` is node 0's ``host:port`` (static rendezvous) and ``node_rank`` this node's
        rank (a literal, or a variable the container platform expands)."""
        target = ["-m", self.module, *self.args(config, address, coordinator, run_dir, advertise)]
        if self.world_size == 1:
            return target
        flags = ["--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc_per_node)]
        if self.nnodes == 1:
            flags.append("--standalone")
        else:
            host, _, port = (master or "").rpartition(":")
            if not host or not port:
                raise ValueError(
                    f"{self.name}: its {self.nnodes} nodes need node 0's rendezvous address (host:port), got {master!r}"
                )
            flags += [
                "--node-rank",
                node_rank,
                "--rdzv-backend",
                "static",
                "--master-addr",
                host,
                "--master-port",
                port,
            ]
        flags += ["--max-restarts", "0", "--monitor-interval", str(MONITOR_INTERVAL_S)]
        return ["-m", agent, *flags, *target]

    def args(
        self, config: str, address: str, coordinator: str, run_dir: str | None = None, advertise: str | None = None
    ) -> list[str]:
        """Command-line arguments after ``python -m <module>``."""
        out = ["--config", config, "--index", str(self.index), "--address", address, "--coordinator", coordinator]
        if advertise:
            out += ["--advertise", advertise]
        if self.role == "learner":
            out += ["--run-dir", run_dir or "."]
        if self.external_env:
            out += ["--external-env", self.external_env]
        return out


def cpu_placement(cfg, cores: list[int]) -> dict[str, list[int]] | None:
    """CPU cores per component (env, rollout, actor) of a run on this machine, whose usable cores are ``cores``:
    ``cluster.cpu_placement`` (core ids as the OS numbers them; ``env: auto`` resolved by
    rlfleet.config.resolve_cpu_placement), or None (no pinning) when nothing is placed. Measured on 2 cores
    (docs/benchmarks.md, CPU placement): env servers one core each made a synchronous collocated run faster; in
    every other layout tried the OS scheduler did better (a core of its own for the asynchronous learner left it
    idle most of the time and cost 18% of the loop's env steps/s)."""
    given = resolve_cpu_placement(cfg)
    if not given:
        return None
    placed = parse_placement(given, max(cores) + 1, "cluster.cpu_placement", "CPU core")
    for names, spec in given.items():
        if str(spec).strip() == "all":  # every core this run may use
            placed.update({n.strip(): list(cores) for n in str(names).split(",")})
        outside = sorted(set(placed[str(names).split(",")[0].strip()]) - set(cores))
        if outside:
            raise ConfigError(
                f"'cluster.cpu_placement.{names}': core(s) {outside} of '{spec}' are not usable "
                f"here (this process may run on cores {_ranges(cores)})"
            )
    return {c: r or list(cores) for c, r in placed.items()}  # an unplaced component may use any core


def _ranges(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def _devices(placement: dict, role: str, index: int, count: int) -> tuple[int, ...]:
    ranks = placement[COMPONENT[role]]
    if ranks and len(ranks) >= count:  # one process per GPU slice of the range
        per = len(ranks) // count
        ranks = ranks[index * per : (index + 1) * per]
    return tuple(ranks)


def process_plan(cfg, num_env_servers: int | None = None, cores: list[int] | None = None) -> list[ProcessSpec]:
    """Every service process the run needs, learner first (it owns the run state), then inference, then env.
    ``num_env_servers``: the env server count after `coordinatorctl scale` (default: the config's).
    ``cores``: the CPU cores of the machine that runs every process (the local launcher's); each process gets its
    slice of ``cpu_placement``; without them (containers, other hosts) no process is pinned."""
    cl = cfg.cluster
    placement = parse_placement(cl.component_placement, cl.num_nodes * cl.num_gpus_per_node)
    cpu = cpu_placement(cfg, sorted(cores)) if cores else None  # None: no process is pinned
    # rollout: env (collocated acting): the env servers act with the policy themselves, no inference server runs
    inference = 0 if rollout_in_env(cfg) else cl.num_inference_servers
    counts = {"learner": 1, "inference": inference, "env": num_env_servers or cl.num_env_servers}
    ext = list(cl.external_env_addresses)
    nnodes, per_node = learner_layout(cfg)
    out = []
    for role, n in counts.items():
        for i in range(n):
            gpus = _devices(placement, role, i, n)
            # the learner's devices on one of its nodes (each node holds per_node of its GPUs; rank i uses
            # cuda:LOCAL_RANK of them); any other process: its range's ids
            local = list(gpus[:per_node]) if role == "learner" else list(gpus)
            ranks = {"nnodes": nnodes, "nproc_per_node": per_node} if role == "learner" else {}
            out.append(
                ProcessSpec(
                    role,
                    i,
                    MODULES[role],
                    gpus,
                    cuda_visible_devices(local, cl.num_gpus_per_node) if gpus else "",
                    env_server_config(cfg, i).env.train.simulator_type if role == "env" and not ext else None,
                    str(ext[i]) if role == "env" and ext else None,
                    _devices(cpu, role, i, n) if cpu else (),
                    **ranks,
                )
            )
    return out

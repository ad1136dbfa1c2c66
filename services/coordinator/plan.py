"""What processes a run config needs: one pure function, used by every launcher and by `coordinatorctl deploy`.

``process_plan(cfg)`` lists the services (role, index, module, GPU ranks, simulator) without starting anything
or touching the disk. The local launcher turns each entry into a child process; the compose and Kubernetes
generators turn the same entries into containers; so a placement or a server count means the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.config import ConfigError, cuda_visible_devices, env_server_config, parse_placement

MODULES = {"env": "services.env.server", "inference": "services.inference.server", "learner": "services.learner.server"}
COMPONENT = {"env": "env", "inference": "rollout", "learner": "actor"}  # RLinf's component names per role
PORTS = {"coordinator": 50051, "learner": 50052, "inference": 50053, "env": 50054}  # in containers


@dataclass(frozen=True)
class ProcessSpec:
    role: str                     # env | inference | learner
    index: int                    # index among its role
    module: str                   # python -m <module>
    gpus: tuple[int, ...]         # global GPU ranks placed on this process (cluster.component_placement)
    cuda_visible_devices: str     # the same ranks as device ids on their node ('' = CPU)
    simulator: str | None         # env servers: the simulator whose environment they run in
    external_env: str | None      # env servers bridging an external simulator: its address
    cpus: tuple[int, ...] = ()    # CPU cores the local launcher pins it to (cluster.cpu_placement; () = any core)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def args(self, config: str, address: str, coordinator: str, run_dir: str | None = None,
             advertise: str | None = None) -> list[str]:
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
    ``cluster.cpu_placement`` (core ids as the OS numbers them), or None (no pinning) when it is empty. Measured on
    2 cores (README, CPU placement), the OS scheduler beats every fixed layout tried: a core of its own for the
    asynchronous learner left it idle most of the time and cost 18% of the loop's env steps/s."""
    given = cfg.cluster.cpu_placement
    if not given:
        return None
    placed = parse_placement(given, max(cores) + 1, "cluster.cpu_placement", "CPU core")
    for names, spec in given.items():
        if str(spec).strip() == "all":  # every core this run may use
            placed.update({n.strip(): list(cores) for n in str(names).split(",")})
        outside = sorted(set(placed[str(names).split(",")[0].strip()]) - set(cores))
        if outside:
            raise ConfigError(f"'cluster.cpu_placement.{names}': core(s) {outside} of '{spec}' are not usable "
                              f"here (this process may run on cores {_ranges(cores)})")
    return {c: r or list(cores) for c, r in placed.items()}  # an unplaced component may use any core


def _ranges(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def _devices(placement: dict, role: str, index: int, count: int) -> tuple[int, ...]:
    ranks = placement[COMPONENT[role]]
    if ranks and len(ranks) >= count:  # one process per GPU slice of the range
        per = len(ranks) // count
        ranks = ranks[index * per:(index + 1) * per]
    return tuple(ranks)


def process_plan(cfg, num_env_servers: int | None = None, cores: list[int] | None = None) -> list[ProcessSpec]:
    """Every service process the run needs, learner first (it owns the run state), then inference, then env.
    ``num_env_servers``: the env server count after `coordinatorctl scale` (default: the config's).
    ``cores``: the CPU cores of the machine that runs every process (the local launcher's); each process gets its
    slice of ``cpu_placement``; without them (containers, other hosts) no process is pinned."""
    cl = cfg.cluster
    placement = parse_placement(cl.component_placement, cl.num_nodes * cl.num_gpus_per_node)
    cpu = cpu_placement(cfg, sorted(cores)) if cores else None  # None: no process is pinned
    counts = {"learner": 1, "inference": cl.num_inference_servers, "env": num_env_servers or cl.num_env_servers}
    ext = list(cl.external_env_addresses)
    out = []
    for role, n in counts.items():
        for i in range(n):
            gpus = _devices(placement, role, i, n)
            out.append(ProcessSpec(
                role, i, MODULES[role], gpus, cuda_visible_devices(list(gpus), cl.num_gpus_per_node) if gpus else "",
                env_server_config(cfg, i).env.train.simulator_type if role == "env" and not ext else None,
                str(ext[i]) if role == "env" and ext else None,
                _devices(cpu, role, i, n) if cpu else ()))
    return out

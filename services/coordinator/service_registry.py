"""The run's service registry and health: who is up where, heartbeats, deaths noticed, restarts.

``Registry`` answers Register/Heartbeat, knows each service's address and incarnation, and lets the run loop wait
for a service. ``HealthMonitor`` watches process exits (local launcher) and heartbeats, restarts env and inference
servers (stateless) up to ``cluster.max_restarts``, and fails the run when the learner dies. ``RunFate`` is where
either of them records that the run cannot go on.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

from omegaconf import DictConfig

from rlfleet.config import rollout_in_env
from rlfleet.config.views import CoordinatorView, as_view
from rlfleet.errors import FailedPrecondition, InvalidRequest
from rlfleet.v1 import coordinator_pb2
from rlfleet.wire.addresses import check_address
from rlfleet.wire.service import CANNOT_START  # a service that failed before serving: not restarted

ROLE_NAMES = {coordinator_pb2.ENV: "env", coordinator_pb2.INFERENCE: "inference", coordinator_pb2.LEARNER: "learner"}
ROLE_ENUMS = {v: k for k, v in ROLE_NAMES.items()}

# keys that may differ between the coordinator and a service (where things are, not what is trained)
LOCAL_KEYS = (
    "cluster.launcher",
    "cluster.host",
    "cluster.coordinator_address",
    "runner.resume_dir",
    "runner.logger.log_path",
    "cluster.tls.cert_file",
    "cluster.tls.key_file",
    "cluster.tls.ca_file",
)


class RunFailed(RuntimeError):
    """The run cannot go on; the message says why and what to do."""


class RunStopped(RuntimeError):
    """A stop was asked for (signal, `coordinatorctl stop`) while the run was waiting for its services."""


class RunFate:
    """Set once when the run must end: ``fatal`` says why (a death that cannot be repaired); ``stop_event`` is also
    set by a requested stop (signal, `coordinatorctl stop`), with ``stop_reason``."""

    def __init__(self):
        self.fatal: str | None = None
        self.stop_event = threading.Event()
        self.stop_reason = ""

    def fail(self, why: str) -> None:
        if self.fatal is None:
            self.fatal = why
        self.stop_event.set()

    def check(self) -> None:
        if self.fatal:
            raise RunFailed(self.fatal)


@dataclass
class Service:
    role: str
    index: int
    address: str = ""
    pid: int = 0
    incarnation: str = ""
    last_heartbeat: float = 0.0
    last_heard: float = 0.0  # when a heartbeat last arrived, before it waited for a server thread
    alive: bool = False
    restarts: int = 0
    ready: threading.Event = field(default_factory=threading.Event)


MAX_CONFIG_YAML = 1 << 20
_INCARNATION = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def check_claim(
    role: int, index: int, address: str | None = None, pid: int = 1, incarnation: str = "x", config_yaml: str = "x"
) -> None:
    """A Register request's claim, field by field, before anything of it is believed (INVALID_ARGUMENT);
    ``address`` None: only the role and index."""
    if role not in ROLE_NAMES:
        raise InvalidRequest(f"role: {role} is not one of ENV, INFERENCE, LEARNER")
    if index < 0:
        raise InvalidRequest(f"index: {index} is negative")
    if address is None:
        return
    check_address(address, "address")
    if pid <= 0:
        raise InvalidRequest(f"pid: {pid} is not a process id")
    if not _INCARNATION.match(incarnation):
        raise InvalidRequest(f"incarnation: {incarnation[:80]!r} is not 1-64 characters of [A-Za-z0-9._-]")
    if not config_yaml.strip():
        raise InvalidRequest(
            "config_yaml: empty; a service registers with the run config it was started with "
            "(the coordinator compares it with its own)"
        )
    if len(config_yaml) > MAX_CONFIG_YAML:
        raise InvalidRequest(f"config_yaml: {len(config_yaml)} characters; at most {MAX_CONFIG_YAML}")


def config_difference(cfg, other_yaml: str) -> str:
    """'' when a service's config matches the coordinator's, else the first differing key, named."""
    from omegaconf import OmegaConf

    from rlfleet.config import _flatten
    from rlfleet.untrusted import BadFile, parse_yaml

    try:  # a peer's text: plain YAML only (no anchors, aliases or tags), then OmegaConf
        plain = parse_yaml(other_yaml, "config_yaml")
        other = OmegaConf.create(plain) if isinstance(plain, dict) else None
    except BadFile as exc:
        raise InvalidRequest(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - YAML that does not parse is bad input, not a coordinator bug
        raise InvalidRequest(
            f"config_yaml: does not parse as YAML ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None
    if not isinstance(other, DictConfig):
        raise InvalidRequest("config_yaml: is not a mapping of config groups")
    mine, theirs = _flatten(cfg), _flatten(other)
    for key in sorted(set(mine) | set(theirs)):
        if key in LOCAL_KEYS:
            continue
        a, b = mine.get(key, "<missing>"), theirs.get(key, "<missing>")
        a = OmegaConf.to_container(a) if OmegaConf.is_config(a) else a
        b = OmegaConf.to_container(b) if OmegaConf.is_config(b) else b
        if a != b:
            return f"'{key}' is {b!r} there, {a!r} here (give every service the coordinator's config file)"
    return ""


class Registry:
    def __init__(self, cfg, fate: RunFate, say, logs_hint: str = ""):
        self.cfg = cfg
        self.fate = fate
        self.say = say
        self.logs_hint = logs_hint  # where to look when a service does not come up
        # rollout: env (collocated acting): no inference server; the env servers hold the policy and take its weights
        self.collocated = rollout_in_env(cfg)
        inference = 0 if self.collocated else cfg.cluster.num_inference_servers
        self.counts = {"env": cfg.cluster.num_env_servers, "inference": inference, "learner": 1}
        self.services = {(r, i): Service(r, i) for r, n in self.counts.items() for i in range(n)}
        self.retired: set[tuple[str, int]] = set()  # scaled away: told to shut down through heartbeats
        self.lock = threading.Lock()
        self.shutting_down = False

    # --- called by the gRPC servicer ---------------------------------------------------------------------------
    def register(self, role: int, index: int, address: str, pid: int, incarnation: str, config_yaml: str = "") -> bool:
        name = ROLE_NAMES.get(role)
        svc = self.services.get((name, index))
        if svc is None:
            raise InvalidRequest(f"role/index: this run has no {name or role}[{index}] (expects {self.counts})")
        if config_yaml:
            diff = config_difference(self.cfg, config_yaml)
            if diff:
                raise FailedPrecondition(f"{name}[{index}] was started with a different config: {diff}")
        with self.lock:
            svc.address, svc.pid, svc.incarnation = address, pid, incarnation
            svc.last_heartbeat, svc.alive = time.monotonic(), True
            svc.ready.set()
        self.say(f"  {name}[{index}] up at {address} (pid {pid})", verbose=True)
        return True

    def heard(self, role: str, index: int) -> None:
        """A heartbeat (or registration) of ``role[index]`` arrived, its credential checked, and waits for a server
        thread: the service is alive even if a busy coordinator answers it late. No lock: it runs on the gRPC
        server's polling thread."""
        svc = self.services.get((role, index))
        if svc is not None and svc.alive:
            svc.last_heard = time.monotonic()

    def heartbeat(self, role: int, index: int, incarnation: str) -> bool:
        """-> whether the service should shut down (the run is over, or it was scaled away)."""
        key = (ROLE_NAMES.get(role), index)
        svc = self.services.get(key)
        if svc is not None and svc.incarnation == incarnation:
            svc.last_heartbeat = time.monotonic()
        return self.shutting_down or key in self.retired

    def add_status(self, st: coordinator_pb2.RunStatus) -> None:
        now = time.monotonic()
        for svc in list(self.services.values()):
            st.services.add(
                role=ROLE_ENUMS[svc.role],
                index=svc.index,
                address=svc.address,
                pid=svc.pid,
                alive=svc.alive,
                restarts=svc.restarts,
                last_heartbeat_age_s=now - svc.last_heartbeat if svc.last_heartbeat else -1,
            )

    # --- used by the run loop ------------------------------------------------------------------------------------
    def wait(self, role: str, index: int, timeout: float, stoppable: bool = False) -> Service:
        """Wait until ``role[index]`` has registered; RunFailed after ``timeout`` or when the run has failed;
        ``stoppable``: RunStopped as soon as a stop is asked for."""
        svc = self.services[(role, index)]
        end = time.monotonic() + timeout
        while not svc.ready.wait(0.2):
            self.fate.check()
            if stoppable and self.fate.stop_event.is_set():
                raise RunStopped(self.fate.stop_reason or "stopped")
            if time.monotonic() > end:
                raise RunFailed(f"{role}[{index}] did not come up within {timeout:.0f}s{self.logs_hint}")
        return svc

    def addresses(self, role: str) -> list[str]:
        return [self.services[(role, i)].address for i in range(self.counts[role])]

    @property
    def policy_role(self) -> str:
        """The role whose servers hold the acting policy and take the learner's weights: inference, or env when
        the env servers act themselves (collocated acting)."""
        return "env" if self.collocated else "inference"

    def policy_addresses(self) -> list[str]:
        """Where the learner publishes weights (and, with inference servers, where env servers ask for actions)."""
        return self.addresses(self.policy_role)

    def act_addresses(self) -> list[str]:
        """The inference servers an env server asks for actions (none: it acts itself, collocated)."""
        return [] if self.collocated else self.addresses("inference")

    def inference_generation(self) -> tuple:
        """Changes whenever a server holding the policy (an inference server; with collocated acting an env
        server) dies or comes back."""
        role = self.policy_role
        return tuple((s.incarnation, s.ready.is_set()) for (r, _), s in sorted(self.services.items()) if r == role)

    def add(self, role: str, indices: range) -> None:
        with self.lock:
            for i in indices:
                self.retired.discard((role, i))
                self.services[(role, i)] = Service(role, i)
            self.counts[role] = max(self.counts[role], indices.stop)

    def retire(self, role: str, index: int) -> None:
        with self.lock:
            self.retired.add((role, index))
            self.services.pop((role, index), None)
            self.counts[role] = min(self.counts[role], index)

    def restart_counts(self, prior: dict[str, int]) -> dict[str, int]:
        """Restarts per service over the whole run, ``prior`` (earlier parts, --resume) included."""
        out = dict(prior)
        for s in list(self.services.values()):
            out[f"{s.role}[{s.index}]"] = out.get(f"{s.role}[{s.index}]", 0) + s.restarts
        return {k: v for k, v in out.items() if v}


class HealthMonitor:
    """Restart env and inference servers that exited or went silent; fail the run if the learner dies."""

    def __init__(self, registry: Registry, launcher, view: CoordinatorView, run_dir, say):
        """``view``: the coordinator's view (or the run config: its view is built)."""
        self.registry, self.launcher, self.run_dir, self.say = registry, launcher, run_dir, say
        self.view = as_view(CoordinatorView, view)

    def start(self) -> None:
        threading.Thread(target=self._loop, name="monitor", daemon=True).start()

    def _loop(self) -> None:
        reg, timeout = self.registry, self.view.heartbeat_timeout_s
        while not reg.shutting_down:
            time.sleep(0.2)
            dead: list[tuple[Service, str]] = []
            for proc, code in self.launcher.exited():  # a local launcher sees exits at once; attach: heartbeats
                svc = reg.services.get((proc.role, proc.index))
                if svc is None:  # scaled away
                    continue
                # svc.pid: what the service registered, the pid of the process its launcher started (for a learner
                # of several ranks, torchrun's agent, whose exit code is its first failed rank's)
                if svc.pid in (0, proc.popen.pid) and (svc.alive or not svc.ready.is_set()):
                    if code == CANNOT_START and not svc.pid:  # failed before registering: restarting cannot help
                        reg.fate.fail(f"{proc.role}[{proc.index}] could not start:\n{self.launcher.log_tail(proc, 8)}")
                        return
                    dead.append((svc, f"exited with code {code}\n{self.launcher.log_tail(proc)}"))
            now = time.monotonic()
            for svc in list(reg.services.values()):
                last = max(svc.last_heartbeat, svc.last_heard)  # heard: arrived, maybe not answered yet
                if svc.alive and now - last > timeout and all(d[0] is not svc for d in dead):
                    dead.append((svc, f"sent no heartbeat for {now - last:.0f}s"))
            for svc, why in dead:
                if reg.shutting_down:
                    return
                self._handle_death(svc, why)

    def _handle_death(self, svc: Service, why: str) -> None:
        with self.registry.lock:
            svc.alive = False
            svc.ready.clear()
        name = f"{svc.role}[{svc.index}]"
        limit = self.view.max_restarts
        if svc.role == "learner":  # it holds the training state: the run stops, --resume continues it
            self.registry.fate.fail(f"{name} died: {why}\n  resume with: coordinatorctl start --resume {self.run_dir}")
            return
        if svc.restarts >= limit:
            self.registry.fate.fail(f"{name} died {svc.restarts + 1} times (cluster.max_restarts={limit}): {why}")
            return
        svc.restarts += 1
        self.say(f"  ! {name} {why.splitlines()[0]}; restarting it (restart {svc.restarts})")
        self.launcher.kill(svc.role, svc.index)  # env servers and (stateless) inference servers are restarted
        self.launcher.start(svc.role, svc.index)

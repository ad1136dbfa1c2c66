"""Coordinator: the run's step clock (rollout epoch k -> train k -> weights k+1), service registry and health,
restarts of crashed env servers, evaluation, and the run folder (config, metrics, curve, summary).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
from omegaconf import DictConfig

from rlfleet import codec, rpc
from rlfleet.config import to_yaml
from rlfleet.service import CANNOT_START  # a service that failed before serving: not restarted
from rlfleet.v1 import coordinator_pb2, env_pb2, learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from rlfleet import auth, tracing
from services.coordinator.launcher import LocalLauncher, make_launcher

ROLE_NAMES = {coordinator_pb2.ENV: "env", coordinator_pb2.INFERENCE: "inference", coordinator_pb2.LEARNER: "learner"}
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)


class RunFailed(RuntimeError):
    """The run cannot go on; the message says why and what to do."""


@dataclass
class Service:
    role: str
    index: int
    address: str = ""
    pid: int = 0
    incarnation: str = ""
    last_heartbeat: float = 0.0
    alive: bool = False
    restarts: int = 0
    ready: threading.Event = field(default_factory=threading.Event)


# keys that may differ between the coordinator and a service (where things are, not what is trained)
LOCAL_KEYS = ("cluster.launcher", "cluster.host", "cluster.coordinator_address", "runner.resume_dir",
              "runner.logger.log_path", "cluster.tls.cert_file", "cluster.tls.key_file", "cluster.tls.ca_file")


def config_difference(cfg, other_yaml: str) -> str:
    """'' when a service's config matches the coordinator's, else the first differing key, named."""
    from omegaconf import OmegaConf

    from rlfleet.config import _flatten

    try:
        other = OmegaConf.create(other_yaml)
    except Exception as exc:  # noqa: BLE001 - YAML that does not parse is bad input, not a coordinator bug
        raise rpc.InvalidRequest(f"config_yaml: does not parse as YAML ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0]})") from None
    if not isinstance(other, DictConfig):
        raise rpc.InvalidRequest("config_yaml: is not a mapping of config groups")
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


def choose_run_dir(cfg, resume_dir: str | None) -> pathlib.Path:
    if resume_dir:
        return pathlib.Path(resume_dir)
    base = pathlib.Path(cfg.runner.logger.log_path) / cfg.runner.experiment_name
    if cfg.cluster.launcher == "attach":  # the learner was started elsewhere with this run folder
        return base
    path, n = base, 1
    while path.exists() and any(path.iterdir()):
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


class Coordinator:
    def __init__(self, cfg, run_dir: pathlib.Path, *, quiet: bool = False, token: str | None = None):
        self.cfg = cfg
        self.token = token  # the run credential, handed to the services this coordinator starts
        self.run_dir = run_dir
        self.quiet = quiet
        self.counts = {"env": cfg.cluster.num_env_servers, "inference": cfg.cluster.num_inference_servers,
                       "learner": 1}
        self.services = {(r, i): Service(r, i) for r, n in self.counts.items() for i in range(n)}
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.stop_reason = ""
        self.shutting_down = False
        self.fatal: str | None = None
        self.launcher = None  # set in start_services (make_launcher)
        self.local = cfg.cluster.launcher == "local"  # local: process exits are seen at once
        self.phase = "starting"
        self.epoch = -1
        self.env_steps = 0
        self.lost_episodes = 0
        self.last_metrics: dict[str, float] = {}
        self.eval_history: list[dict] = []
        self.elapsed_offset = 0.0
        self.t_train = None
        self.address = ""
        self.env_id = cfg.env.train.env_id  # replaced by what the env servers describe
        self._env_seen: dict[str, float] = {}  # latest env/* metrics, for progress lines
        self.weights_lock = threading.Lock()
        self.weights_generation: tuple = ()
        self.prior_restarts: dict[str, int] = {}  # from the run's earlier parts (--resume)
        # envs per env server are fixed by the config; `coordinatorctl scale env N` changes the server count
        self.envs_per_server = cfg.env.train.total_num_envs // cfg.cluster.num_env_servers
        self.pending_scale: int | None = None
        self.retired: set[tuple[str, int]] = set()  # scaled away: told to shut down through heartbeats

    # --- registry (called by the gRPC servicer) --------------------------------------------------------------
    def register(self, role: int, index: int, address: str, pid: int, incarnation: str,
                 config_yaml: str = "") -> bool:
        name = ROLE_NAMES.get(role)
        svc = self.services.get((name, index))
        if svc is None:
            raise rpc.InvalidRequest(f"role/index: this run has no {name or role}[{index}] "
                                     f"(expects {self.counts})")
        if config_yaml:
            diff = config_difference(self.cfg, config_yaml)
            if diff:
                raise rpc.FailedPrecondition(f"{name}[{index}] was started with a different config: {diff}")
        with self.lock:
            svc.address, svc.pid, svc.incarnation = address, pid, incarnation
            svc.last_heartbeat, svc.alive = time.monotonic(), True
            svc.ready.set()
        self.say(f"  {name}[{index}] up at {address} (pid {pid})", verbose=True)
        return True

    def heartbeat(self, role: int, index: int, incarnation: str) -> bool:
        key = (ROLE_NAMES.get(role), index)
        svc = self.services.get(key)
        if svc is not None and svc.incarnation == incarnation:
            svc.last_heartbeat = time.monotonic()
        return self.shutting_down or key in self.retired

    MAX_ENV_SERVERS = 256

    def request_scale(self, role: int, count: int) -> tuple[int, str]:
        """`coordinatorctl scale env N`: takes effect at the next epoch boundary. -> (current count, message)."""
        if ROLE_NAMES.get(role) != "env":
            raise rpc.InvalidRequest(f"role: only env servers scale during a run, not {ROLE_NAMES.get(role, role)}")
        if self.cfg.cluster.external_env_addresses:
            raise rpc.FailedPrecondition("cluster.external_env_addresses: env servers bridging external simulators "
                                         "are fixed by that list")
        if not 1 <= count <= self.MAX_ENV_SERVERS:
            raise rpc.InvalidRequest(f"count: {count} is not in 1..{self.MAX_ENV_SERVERS}")
        with self.lock:
            self.pending_scale = count
        current = self.counts["env"]
        per, steps = self.envs_per_server, self.cfg.env.train.max_steps_per_rollout_epoch
        message = (f"env servers {current} -> {count} from the next epoch: {per} envs each, {count * per} train "
                   f"envs, {count * per * steps} env steps per epoch (actor.global_batch_size is unchanged: more "
                   f"or fewer minibatches per epoch)")
        self.say(f"  scale requested: {message}")
        return current, message

    def _apply_scale(self) -> None:
        """Between epochs: start or retire env servers so that the next epoch collects from the new set."""
        with self.lock:
            target, self.pending_scale = self.pending_scale, None
        old = self.counts["env"]
        if target is None or target == old:
            return
        self.launcher.resize("env", target)
        if target > old:
            with self.lock:
                for i in range(old, target):
                    self.retired.discard(("env", i))
                    self.services[("env", i)] = Service("env", i)
                self.counts["env"] = target
            for i in range(old, target):
                self.launcher.start("env", i)
            try:
                for i in range(old, target):
                    self._wait_service("env", i, self.cfg.cluster.startup_timeout_s)
            except RunFailed as exc:
                if self.fatal:
                    raise
                self.say(f"  ! scaling up did not complete ({exc}); staying at {old} env servers")
                target = old
                for i in range(old, self.counts["env"]):
                    self._retire(i)
                return
        else:
            for i in range(target, old):
                self._retire(i)
        self.say(f"  env servers: {old} -> {target} ({target * self.envs_per_server} train envs)")

    def _retire(self, index: int) -> None:
        with self.lock:
            self.retired.add(("env", index))
            self.services.pop(("env", index), None)
            self.counts["env"] = min(self.counts["env"], index)
        self.launcher.retire("env", index)

    def request_stop(self, reason: str) -> None:
        if not self.stop_event.is_set():
            self.stop_reason = reason
            self.say(f"\nstopping: {reason} (finishing the current epoch; Ctrl-C again to stop at once)")
        self.stop_event.set()

    def status(self) -> coordinator_pb2.RunStatus:
        now = time.monotonic()
        st = coordinator_pb2.RunStatus(
            experiment_name=self.cfg.runner.experiment_name, run_dir=str(self.run_dir), phase=self.phase,
            epoch=self.epoch, max_epochs=self.cfg.runner.max_epochs, env_steps=self.env_steps,
            elapsed_s=self.elapsed(), last_metrics={k: v for k, v in self.last_metrics.items() if math.isfinite(v)})
        roles = {v: k for k, v in ROLE_NAMES.items()}
        for svc in list(self.services.values()):
            st.services.add(role=roles[svc.role], index=svc.index, address=svc.address, pid=svc.pid,
                            alive=svc.alive, restarts=svc.restarts,
                            last_heartbeat_age_s=now - svc.last_heartbeat if svc.last_heartbeat else -1)
        return st

    # --- output ---------------------------------------------------------------------------------------------
    def say(self, text: str, verbose: bool = False) -> None:
        if not self.quiet and not (verbose and os.environ.get("RLFLEET_VERBOSE", "0") == "0"):
            print(text, flush=True)

    def elapsed(self) -> float:
        return self.elapsed_offset + (time.monotonic() - self.t_train if self.t_train else 0.0)

    # --- health ---------------------------------------------------------------------------------------------
    def _monitor(self) -> None:
        """Restart env servers that exited or went silent; fail the run if the learner or inference dies."""
        timeout = self.cfg.cluster.heartbeat_timeout_s
        while not self.shutting_down:
            time.sleep(0.2)
            dead: list[tuple[Service, str]] = []
            if self.launcher is not None:  # a local launcher sees exits at once; attach relies on heartbeats
                for proc, code in self.launcher.exited():
                    svc = self.services.get((proc.role, proc.index))
                    if svc is None:  # scaled away
                        continue
                    if svc.pid in (0, proc.popen.pid) and (svc.alive or not svc.ready.is_set()):
                        if code == CANNOT_START:  # restarting cannot help: say why and stop
                            self.fatal = (f"{proc.role}[{proc.index}] could not start:\n"
                                          f"{LocalLauncher.log_tail(proc, 8)}")
                            self.stop_event.set()
                            return
                        dead.append((svc, f"exited with code {code}\n{LocalLauncher.log_tail(proc)}"))
            now = time.monotonic()
            for svc in list(self.services.values()):
                if svc.alive and now - svc.last_heartbeat > timeout and all(d[0] is not svc for d in dead):
                    dead.append((svc, f"sent no heartbeat for {now - svc.last_heartbeat:.0f}s"))
            for svc, why in dead:
                if self.shutting_down:
                    return
                self._handle_death(svc, why)

    def _handle_death(self, svc: Service, why: str) -> None:
        with self.lock:
            svc.alive = False
            svc.ready.clear()
        name = f"{svc.role}[{svc.index}]"
        if svc.role == "learner":  # it holds the training state: the run stops, --resume continues it
            self.fatal = f"{name} died: {why}\n  resume with: coordinatorctl start --resume {self.run_dir}"
            self.stop_event.set()
            return
        if svc.restarts >= self.cfg.cluster.max_restarts:
            self.fatal = f"{name} died {svc.restarts + 1} times (cluster.max_restarts={self.cfg.cluster.max_restarts}): {why}"
            self.stop_event.set()
            return
        svc.restarts += 1
        self.say(f"  ! {name} {why.splitlines()[0]}; restarting it (restart {svc.restarts})")
        if self.launcher is not None:  # env servers and (stateless) inference servers are restarted
            self.launcher.kill(svc.role, svc.index)
            self.launcher.start(svc.role, svc.index)

    def _wait_service(self, role: str, index: int, timeout: float) -> Service:
        svc = self.services[(role, index)]
        end = time.monotonic() + timeout
        while not svc.ready.wait(0.2):
            if self.fatal:
                raise RunFailed(self.fatal)
            if time.monotonic() > end:
                raise RunFailed(f"{role}[{index}] did not come up within {timeout:.0f}s"
                                + (f" (see {self.run_dir / 'logs'})" if self.local else ""))
        return svc

    # --- run ------------------------------------------------------------------------------------------------
    def start_services(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.run_dir / "config.yaml"
        config_path.write_text(to_yaml(self.cfg))
        if self.token:
            path = auth.write_token(self.run_dir, self.token)
            if not self.local:
                self.say(f"  run credential: {path} (services started elsewhere need it as {auth.TOKEN_ENV})")
        (self.run_dir / "coordinator.json").write_text(json.dumps({"address": self.address, "pid": os.getpid()}))
        self.launcher = make_launcher(self.cfg, self.run_dir, config_path, self.address, self.token)
        from rlfleet.environments import EnvironmentError_

        try:
            self.launcher.prepare(log=self.say)
        except EnvironmentError_ as exc:
            raise RunFailed(f"the {self.cfg.env.train.simulator_type} simulator environment could not be "
                            f"built:\n{exc}") from None
        self.launcher.start_all()
        if not self.local:
            self.say(f"waiting for services to register at {self.address} (cluster.launcher=attach): "
                     f"{self.counts}")
        threading.Thread(target=self._monitor, name="monitor", daemon=True).start()
        for (role, index) in self.services:
            self._wait_service(role, index, self.cfg.cluster.startup_timeout_s)

    def addresses(self, role: str) -> list[str]:
        return [self.services[(role, i)].address for i in range(self.counts[role])]

    def learner(self):
        svc = self._wait_service("learner", 0, 30)
        return learner_pb2_grpc.LearnerServiceStub(rpc.channel(svc.address))

    def _rollout_stub(self, index: int, timeout: float):
        svc = self._wait_service("env", index, timeout)
        return svc, rollout_pb2_grpc.RolloutServiceStub(rpc.channel(svc.address))

    def _collect(self, index: int, epoch: int, min_version: int) -> rollout_pb2.CollectResponse:
        per_server = self.envs_per_server
        while True:
            svc, stub = self._rollout_stub(index, self.cfg.cluster.startup_timeout_s)
            incarnation = svc.incarnation
            policy_generation = self._inference_generation()
            try:
                with tracing.span("collect", **{"rlfleet.epoch": epoch, "rlfleet.env_server": index}):
                    resp = stub.Collect(rollout_pb2.CollectRequest(
                        epoch=epoch,
                        num_steps=self.cfg.env.train.max_steps_per_rollout_epoch // self.cfg.actor.model.num_action_chunks,
                        inference_addresses=self.addresses("inference"), learner_address=self.addresses("learner")[0],
                        min_weights_version=min_version), timeout=self.cfg.cluster.collect_timeout_s)
                if resp.lost_episodes:
                    with self.lock:
                        self.lost_episodes += resp.lost_episodes
                    self.say(f"  ! env[{index}]: its external simulator restarted; {resp.lost_episodes} episodes lost")
                return resp
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE or self.fatal:
                    raise RunFailed(f"env[{index}] Collect failed: {rpc.describe_error(exc)}"
                                    + (f"\n  {self.fatal}" if self.fatal else "")) from exc
                # did the server die? the monitor notices a process exit at once, a hung server by its heartbeats
                patience = 3.0 if self.local else self.cfg.cluster.heartbeat_timeout_s + 5
                deadline = time.monotonic() + patience
                while svc.incarnation == incarnation and svc.ready.is_set() and time.monotonic() < deadline \
                        and not self.fatal:
                    time.sleep(0.1)
                if self.fatal:
                    raise RunFailed(self.fatal) from exc
                if svc.incarnation == incarnation and svc.ready.is_set() \
                        and self._inference_generation() != policy_generation:
                    # an inference server died under this rollout: the env server is fine and its episodes go
                    # on; the partial rollout is dropped and collected again once the restarted server has weights
                    self.say(f"  ! env[{index}] rollout interrupted by an inference server restart; collecting again")
                    self._ensure_inference_weights()
                    continue
                if svc.incarnation == incarnation and svc.ready.is_set():
                    raise RunFailed(f"env[{index}] Collect failed and the server is still up: "
                                    f"{rpc.describe_error(exc)} (see {self.run_dir / 'logs' / f'env_{index}.log'})") from exc
                # it died mid-rollout: its partial episodes are dropped (never sent to the learner) and counted
                with self.lock:
                    self.lost_episodes += per_server
                self.say(f"  ! env[{index}] lost mid-rollout ({rpc.describe_error(exc).splitlines()[0]}); "
                         f"{per_server} partial episodes dropped, collecting again after restart")

    def _inference_generation(self) -> tuple:
        """Changes whenever an inference server dies or comes back."""
        return tuple((s.incarnation, s.ready.is_set()) for (r, _), s in sorted(self.services.items()) if r == "inference")

    def _ensure_inference_weights(self) -> None:
        """After inference restarts: wait for every server, then have the learner republish the current weights.
        A server that dies under the republish (the monitor has not noticed yet) is waited for and tried again."""
        deadline = time.monotonic() + self.cfg.cluster.startup_timeout_s
        with self.weights_lock:
            while True:
                for i in range(self.counts["inference"]):
                    self._wait_service("inference", i, max(1.0, deadline - time.monotonic()))
                generation = self._inference_generation()
                if generation == self.weights_generation:
                    return
                try:
                    self.learner().PublishWeights(learner_pb2.PublishWeightsRequest(
                        inference_addresses=self.addresses("inference")), timeout=120)
                    self.weights_generation = generation
                    return
                except grpc.RpcError as exc:
                    settle = min(deadline, time.monotonic() + 5.0)
                    while self._inference_generation() == generation and time.monotonic() < settle \
                            and not self.fatal:
                        time.sleep(0.1)  # a death is noticed by the monitor within a fraction of a second
                    if self.fatal:
                        raise RunFailed(self.fatal) from exc
                    if self._inference_generation() == generation or time.monotonic() >= deadline:
                        raise RunFailed(f"republishing weights failed: {rpc.describe_error(exc)}") from exc

    def _why_failed(self, exc: grpc.RpcError, what: str) -> str:
        """A failed call's explanation: a service death noticed by the monitor says more than the RPC error."""
        deadline = time.monotonic() + (3.0 if self.local else self.cfg.cluster.heartbeat_timeout_s)
        while not self.fatal and time.monotonic() < deadline and exc.code() in RETRYABLE:
            time.sleep(0.1)
        return self.fatal or f"{what} failed: {rpc.describe_error(exc)}"

    def _await(self, future, what: str):
        """Wait for a future (thread pool or gRPC) while watching for a fatal service death."""
        while True:
            if self.fatal:
                if hasattr(future, "cancel"):
                    future.cancel()
                raise RunFailed(self.fatal)
            try:
                return future.result(timeout=0.25)
            except (TimeoutError, grpc.FutureTimeoutError):
                continue

    def evaluate(self, step: int, num_episodes: int | None = None) -> dict[str, float]:
        ev = self.cfg.env.eval
        total = num_episodes or ev.num_episodes
        n = self.counts["env"]
        shares = [len(a) for a in np.array_split(np.arange(total), n)]
        firsts = np.cumsum([0] + shares[:-1])
        t0 = time.perf_counter()

        per_server = self.cfg.env.eval.total_num_envs // self.cfg.cluster.num_env_servers  # fixed per server
        phase, self.phase = self.phase, "evaluating"

        def one(i):
            for attempt in range(self.cfg.cluster.max_restarts + 1):
                svc, stub = self._rollout_stub(i, self.cfg.cluster.startup_timeout_s)
                incarnation, generation = svc.incarnation, self._inference_generation()
                try:
                    resp = stub.Evaluate(rollout_pb2.EvaluateRequest(
                        num_episodes=shares[i], first_episode=int(firsts[i]), seed=ev.seed,
                        deterministic=ev.deterministic, inference_addresses=self.addresses("inference"),
                        use_reset_state_ids=ev.use_fixed_reset_state_ids, video_episodes=ev.video_episodes,
                        video_dir=str(self.run_dir / "videos" / f"eval_epoch{step:04d}") if ev.video_episodes else ""),
                        timeout=self.cfg.cluster.collect_timeout_s)
                    if resp.lost_episodes:
                        with self.lock:
                            self.lost_episodes += resp.lost_episodes
                    return resp
                except grpc.RpcError as exc:
                    if exc.code() not in RETRYABLE or self.fatal:
                        raise
                    deadline = time.monotonic() + (3.0 if self.local
                                                   else self.cfg.cluster.heartbeat_timeout_s + 5)
                    while svc.incarnation == incarnation and svc.ready.is_set() and time.monotonic() < deadline \
                            and self._inference_generation() == generation and not self.fatal:
                        time.sleep(0.1)  # let the monitor notice a death
                    if svc.incarnation != incarnation or not svc.ready.is_set():
                        lost = min(shares[i], per_server)
                        with self.lock:
                            self.lost_episodes += lost
                        self.say(f"  ! env[{i}] lost mid-evaluation ({rpc.describe_error(exc).splitlines()[0]}); "
                                 f"{lost} episodes in flight lost, evaluating its share again after restart")
                        continue
                    if self._inference_generation() == generation:
                        raise
                    self._ensure_inference_weights()  # an inference server restarted: evaluate again
            raise RunFailed(f"env[{i}] evaluation failed {self.cfg.cluster.max_restarts + 1} times")

        try:
            with ThreadPoolExecutor(n) as pool, tracing.span("evaluate", **{"rlfleet.step": step}):
                futures = [tracing.submit(pool, one, i) for i in range(n) if shares[i]]
                results = [f.result() for f in futures]
        finally:
            self.phase = phase
        eps = [e for r in results for e in r.episodes]
        metrics = {"eval/success_once": float(np.mean([e.success_once for e in eps])),
                   "eval/success_at_end": float(np.mean([e.success_at_end for e in eps])),
                   "eval/return": float(np.mean([codec.episode_return(e) for e in eps])),
                   "eval/episode_len": float(np.mean([e.length for e in eps])),
                   "eval/num_episodes": float(len(eps)), "time/eval": time.perf_counter() - t0,
                   "eval/env_steps": float(self.env_steps), "eval/wall_time_s": self.elapsed()}
        metrics["env/lost_episodes"] = float(self.lost_episodes)
        self.learner().LogMetrics(learner_pb2.LogMetricsRequest(step=step, metrics=metrics),
                                  timeout=self.cfg.cluster.rpc_timeout_s)
        self.eval_history.append({"step": step, **metrics})
        return metrics

    def run(self) -> dict:
        cfg, runner = self.cfg, self.cfg.runner
        t_setup = time.monotonic()
        self.say(f"rlfleet: {runner.experiment_name} -> {self.run_dir}")
        self.say(f"  starting {self.counts['env']} env server(s), {self.counts['inference']} inference server(s), "
                 f"1 learner ({cfg.cluster.launcher} launcher, coordinator at {self.address})")
        self.start_services()
        rpc_timeout = cfg.cluster.rpc_timeout_s
        _, stub0 = self._rollout_stub(0, 30)
        spec = stub0.Describe(env_pb2.DescribeEnvRequest(), timeout=rpc_timeout)
        self.env_id = spec.env_id
        if cfg.cluster.external_env_addresses and not cfg.cluster.external_eval_env_addresses:
            self.say("  note: evaluation runs on the external training simulators (no "
                     "cluster.external_eval_env_addresses): env.eval's env_id, init_params and total_num_envs do not "
                     "apply, and training episodes restart after each evaluation")
        learner = self.learner()
        pub = learner.PublishWeights(learner_pb2.PublishWeightsRequest(
            env_spec=spec, inference_addresses=self.addresses("inference")), timeout=max(120.0, rpc_timeout))
        self.weights_generation = self._inference_generation()
        status = learner.Status(learner_pb2.LearnerStatusRequest(), timeout=rpc_timeout)
        self._load_counts()
        start_epoch = status.epoch + 1
        self.env_steps, self.elapsed_offset = status.env_steps, status.elapsed_time_s
        version = pub.weights_version
        chunk = cfg.actor.model.num_action_chunks
        batch = cfg.env.train.total_num_envs * cfg.env.train.max_steps_per_rollout_epoch // chunk
        self.say(f"  services up in {time.monotonic() - t_setup:.1f}s; env {spec.env_id}: "
                 f"{cfg.env.train.total_num_envs} envs x {cfg.env.train.max_steps_per_rollout_epoch} steps"
                 + (f" in chunks of {chunk}" if chunk > 1 else "") + f" = {batch} samples/epoch, "
                 f"{cfg.rollout.pipeline_stage_num} pipeline stage(s)"
                 + (f"; resumed at epoch {start_epoch}, {self.env_steps} env steps" if start_epoch else ""))
        if runner.eval_before_train and start_epoch == 0 and not any(e["step"] == 0 for e in self.eval_history):
            self.phase = "evaluating"
            self.say(f"  evaluating the initial policy ({cfg.env.eval.num_episodes} episodes) ...")
            ev = self.evaluate(0)
            self.say(f"  eval @ start: success_once {ev['eval/success_once']:.1%} return {ev['eval/return']:.2f} "
                     f"over {int(ev['eval/num_episodes'])} episodes")
            self._save_counts()
        self.phase = "training"
        self.t_train = time.monotonic()
        epoch = start_epoch
        stop_why = "budget reached"
        pool = ThreadPoolExecutor(self.MAX_ENV_SERVERS)  # threads start as needed: room for `scale env N`
        try:
            while True:
                if epoch >= runner.max_epochs:
                    stop_why = f"runner.max_epochs={runner.max_epochs} reached"
                    break
                if runner.max_env_steps is not None and self.env_steps >= runner.max_env_steps:
                    stop_why = f"runner.max_env_steps={runner.max_env_steps} reached"
                    break
                if runner.max_wall_time_s is not None and self.elapsed() >= runner.max_wall_time_s:
                    stop_why = f"runner.max_wall_time_s={runner.max_wall_time_s} reached"
                    break
                if self.stop_event.is_set():
                    stop_why = self.stop_reason or "stopped"
                    break
                self._apply_scale()
                with tracing.span("epoch", **{"rlfleet.epoch": epoch}):
                    t0 = time.perf_counter()
                    lost_before = self.lost_episodes
                    futures = [tracing.submit(pool, self._collect, i, epoch, version) for i in range(self.counts["env"])]
                    results = [self._await(f, "rollout") for f in futures]
                    t_rollout = time.perf_counter() - t0
                    steps = sum(r.env_steps for r in results)
                    extra = {"time/rollout": t_rollout, "rollout/env_steps_per_s": steps / t_rollout,
                             "time/env": max(r.env_time_s for r in results),
                             "time/inference_wait": max(r.inference_wait_s for r in results),
                             "env/lost_episodes": float(self.lost_episodes),
                             "env/lost_episodes_epoch": float(self.lost_episodes - lost_before),
                             "time/elapsed": self.elapsed()}
                    t1 = time.perf_counter()
                    try:
                        with tracing.span("train", **{"rlfleet.epoch": epoch}):
                            resp = self._await(learner.Train.future(learner_pb2.TrainRequest(
                                epoch=epoch, worker_indices=list(range(self.counts["env"])),
                                inference_addresses=self.addresses("inference"), extra_metrics=extra),
                                timeout=cfg.cluster.collect_timeout_s), "training")
                    except grpc.RpcError as exc:
                        raise RunFailed(self._why_failed(exc, "learner Train")) from exc
                    version = resp.weights_version
                    if resp.publish_error:
                        self.say(f"  ! weights {version} did not reach every inference server "
                                 f"({resp.publish_error.splitlines()[0]}); republishing")
                        with self.weights_lock:
                            self.weights_generation = ()
                        self._ensure_inference_weights()
                    metrics = dict(resp.metrics)
                    metrics["time/step"] = time.perf_counter() - t0
                    metrics["time/train_rpc"] = time.perf_counter() - t1
                    self.env_steps = int(metrics.get("env/env_steps", self.env_steps + steps))
                    self.last_metrics, self.epoch = metrics, epoch
                    self._save_counts()
                if epoch % runner.progress_interval == 0:
                    self.say(self.progress_line(epoch, metrics))
                epoch += 1
                if runner.val_check_interval and epoch % runner.val_check_interval == 0:
                    ev = self.evaluate(epoch)
                    self.say(f"  eval @ epoch {epoch}: success_once {ev['eval/success_once']:.1%} "
                             f"return {ev['eval/return']:.2f} over {int(ev['eval/num_episodes'])} episodes")
                    target = runner.early_stop_success_rate
                    if target is not None and ev["eval/success_once"] >= target:
                        stop_why = f"eval success_once {ev['eval/success_once']:.1%} >= runner.early_stop_success_rate"
                        break
        except grpc.RpcError as exc:
            raise RunFailed(self._why_failed(exc, "a service call")) from exc
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        train_time = self.elapsed()
        self.phase = "evaluating"
        interrupted = self.stop_event.is_set() and not self.fatal
        self.say(f"training done after {train_time:.0f}s: {stop_why}")
        final = None
        if not interrupted:
            if self.eval_history and self.eval_history[-1]["step"] == epoch \
                    and self.eval_history[-1]["eval/num_episodes"] >= cfg.env.eval.num_episodes:
                final = self.eval_history[-1]
            else:
                self.say(f"final evaluation: {cfg.env.eval.num_episodes} episodes ...")
                final = self.evaluate(epoch)
        ckpt = learner.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(),
                                      timeout=cfg.cluster.collect_timeout_s).path if epoch > 0 else ""
        self._save_counts()
        return self.write_summary(epoch, train_time, stop_why, final, ckpt)

    # --- counts that survive --resume -------------------------------------------------------------------------
    def _save_counts(self) -> None:
        state = {"lost_episodes": self.lost_episodes,
                 "restarts": self.restart_counts(),
                 "eval_history": self.eval_history}
        tmp = self.run_dir / "coordinator_state.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.run_dir / "coordinator_state.json")

    def _load_counts(self) -> None:
        path = self.run_dir / "coordinator_state.json"
        if not self.cfg.runner.resume_dir or not path.exists():
            return
        state = json.loads(path.read_text())
        self.lost_episodes = int(state.get("lost_episodes", 0))
        self.eval_history = list(state.get("eval_history", []))
        self.prior_restarts = {k: int(v) for k, v in state.get("restarts", {}).items()}

    def restart_counts(self) -> dict[str, int]:
        """Restarts per service over the whole run, resumed parts included (the limit applies per part)."""
        out = dict(self.prior_restarts)
        for s in self.services.values():
            out[f"{s.role}[{s.index}]"] = out.get(f"{s.role}[{s.index}]", 0) + s.restarts
        return {k: v for k, v in out.items() if v}

    def progress_line(self, epoch: int, m: dict[str, float]) -> str:
        # env/* exist only for epochs in which episodes ended: show the latest known values
        self._env_seen = {**self._env_seen, **{k: v for k, v in m.items() if k.startswith("env/")}}
        m = {**self._env_seen, **m}

        def f(key, fmt):
            v = m.get(key)
            return format(v, fmt) if v is not None and math.isfinite(v) else "-"

        budget = self.cfg.runner.max_env_steps
        return (f"epoch {epoch + 1:4d} | steps {self.env_steps / 1000:7.1f}k"
                + (f"/{budget / 1000:.0f}k" if budget else "")
                + f" | {f('rollout/env_steps_per_s', '5.0f')} env steps/s | {self.elapsed():5.0f}s"
                f" | success_once {f('env/success_once', '.2f')} | return {f('env/return', '6.2f')}"
                f" | policy_loss {f('train/actor/policy_loss', '+.3f')} | value_loss {f('train/critic/value_loss', '.3f')}"
                f" | kl {f('train/actor/approx_kl', '.4f')}"
                + (f" | lost {self.lost_episodes}" if self.lost_episodes else ""))

    def write_summary(self, epochs: int, train_time: float, stop_why: str, final: dict | None, ckpt: str) -> dict:
        from services.coordinator.plots import plot_learning_curve

        try:
            curve = plot_learning_curve(self.run_dir)
        except Exception as exc:  # noqa: BLE001 - a plot never costs the run its summary
            self.say(f"  ! learning curve not drawn: {type(exc).__name__}: {exc}")
            curve = None
        summary = {
            "experiment_name": self.cfg.runner.experiment_name, "run_dir": str(self.run_dir),
            "env_id": self.env_id, "epochs": epochs, "env_steps": self.env_steps,
            "train_wall_time_s": round(train_time, 2), "stop_reason": stop_why,
            "final_eval": {k: v for k, v in (final or {}).items()},
            "initial_eval": next((e for e in self.eval_history if e["step"] == 0), None),
            "eval_history": self.eval_history, "lost_episodes": self.lost_episodes,
            "restarts": self.restart_counts(),
            "last_train_metrics": {k: v for k, v in self.last_metrics.items() if math.isfinite(v)},
            "checkpoint": ckpt, "learning_curve": str(curve) if curve else None,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.say("")
        self.say("=" * 72)
        if final:
            self.say(f"final evaluation: success_once {final['eval/success_once']:.1%} "
                     f"({int(final['eval/num_episodes'])} seeded episodes), return {final['eval/return']:.2f}")
        else:
            self.say("no final evaluation (run stopped early)")
        self.say(f"{epochs} epochs, {self.env_steps} env steps, {train_time:.0f}s of training")
        self.say(f"run files: {self.run_dir}  (summary.json, metrics.jsonl, tensorboard/, checkpoints/, "
                 f"learning_curve.png, config.yaml, logs/)")
        if ckpt:
            self.say(f"last checkpoint: {ckpt}")
        self.say("=" * 72)
        return summary

    def shutdown(self) -> None:
        self.shutting_down = True
        self.phase = "stopped"
        if any(s.alive for s in self.services.values()):
            time.sleep(min(2.0, self.cfg.cluster.heartbeat_interval_s * 1.5))  # let heartbeats carry the word
        if self.launcher is not None:
            self.launcher.stop_all()


def install_signal_handlers(coord: Coordinator) -> None:
    def on_signal(signum, frame):
        if coord.stop_event.is_set():
            raise KeyboardInterrupt
        coord.request_stop(f"{signal.Signals(signum).name} received")

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

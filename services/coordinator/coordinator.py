"""Coordinator: the run's step clock (rollout epoch k -> train k -> weights k+1).

It owns the run loop and the run's folder; the other roles live in their own modules: ``registry`` (who is up
where, heartbeats, the health monitor and restarts), ``calls`` (calls into the fleet and what their failures
mean, weights republishing), ``evaluation`` (seeded evaluation), ``report`` (console, summary, resumable counts),
``launcher`` (how processes come to exist, from ``plan.process_plan``).
"""

from __future__ import annotations

import contextvars
import json
import math
import os
import pathlib
import signal
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import trace
from opentelemetry.context import Context

from rlfleet.config import env_server_config, learner_layout, to_yaml
from rlfleet.config.views import CoordinatorView, build_view
from rlfleet.errors import FailedPrecondition, InvalidRequest, PermissionDenied
from rlfleet.v1 import coordinator_pb2, env_pb2, learner_pb2, rollout_pb2
from rlfleet.wire import auth
from rlfleet.wire.spaces import TensorSpace, joint_spaces, spaces_from_proto, spaces_key
from services.coordinator.bottleneck import FleetShape
from services.coordinator.calls import CallFailed, FleetCalls, describe, retryable
from services.coordinator.evaluation import Evaluator
from services.coordinator.launcher import make_launcher
from services.coordinator.report import RunReport, eval_line, learned
from services.coordinator.service_registry import (
    ROLE_NAMES,
    HealthMonitor,
    Registry,
    RunFailed,
    RunFate,
    RunStopped,
    check_claim,
)

__all__ = ["Coordinator", "RunFailed", "choose_run_dir", "install_signal_handlers"]

_tracer = trace.get_tracer("rlfleet")  # the epoch's trace: epoch > collect (per env server), train


class CollectDropped(Exception):
    """A collection sent ahead of its epoch that the run, having ended, will not ask for again."""


def joint_env_spec(specs: list) -> tuple[env_pb2.EnvSpec, str | None]:
    """The env spec the policy is built for, from every env server's Describe: the first one when all have the
    same spaces, else their joint spaces (rlfleet.wire.spaces.joint_spaces) -> (spec, a line saying so or None).
    Raises RunFailed naming the entry two servers disagree on."""

    def spaces(s):
        return spaces_from_proto(s.observation_space), TensorSpace.from_proto(s.action_space)

    def key(s):
        return spaces_key(*spaces(s))

    if all(key(s) == key(specs[0]) for s in specs[1:]):
        return specs[0], None
    labels = [f"env[{i}] {s.simulator}:{s.env_id}" for i, s in enumerate(specs)]
    try:
        obs, action = joint_spaces({lab: spaces(s) for lab, s in zip(labels, specs)})
    except ValueError as exc:
        raise RunFailed(f"the env servers' spaces cannot be joined for one policy: {exc}") from None
    out = env_pb2.EnvSpec()
    out.CopyFrom(specs[0])
    out.env_id = "+".join(dict.fromkeys(s.env_id for s in specs))
    out.simulator = "+".join(dict.fromkeys(s.simulator for s in specs))
    out.num_envs = sum(s.num_envs for s in specs)
    out.max_episode_steps = max(s.max_episode_steps for s in specs)
    out.max_action_chunk = min(s.max_action_chunk for s in specs)
    out.num_reset_states = 0
    del out.task_descriptions[:]
    out.observation_space.clear()
    for k, sp in obs.items():
        out.observation_space[k].CopyFrom(sp.to_proto())
    out.action_space.CopyFrom(action.to_proto())

    def show(o, a):
        return ", ".join(f"{k}{list(v.shape)}" for k, v in sorted(o.items())) + f"; action {a.shape[0]}-D"

    line = (
        "  env servers with different spaces: "
        + "; ".join(f"{lab} ({show(*spaces(s))})" for lab, s in zip(labels, specs))
        + f"\n  the policy acts in their joint spaces: {show(obs, action)} (observations zero-padded, each "
        f"simulator executes its own first action dimensions)"
    )
    return out, line


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
    MAX_ENV_SERVERS = 256

    def __init__(self, cfg, run_dir: pathlib.Path, *, quiet: bool = False, token: str | None = None):
        # the run config, only handed on: written to the run folder for the services, given to the launcher and
        # compared with a registering service's; the coordinator reads its own keys through its view, built (and
        # checked) once here
        self.cfg = cfg
        self.view = view = build_view(CoordinatorView, cfg)
        self.token = token  # the run credential, handed to the services this coordinator starts
        self.run_dir = run_dir
        self.local = view.launcher == "local"
        self.report = RunReport(view, run_dir, quiet)
        self.say = self.report.say
        self.fate = RunFate()
        self.registry = Registry(cfg, self.fate, self.say, f" (see {run_dir / 'logs'})" if self.local else "")
        self.calls = FleetCalls(view, self.registry, self.local)
        eval_simulator = (lambda i: env_server_config(cfg, i).env.eval.simulator_type) if cfg.env.per_server else None
        self.evaluator = Evaluator(view, run_dir, self.calls, self.say, eval_simulator)
        self.launcher = None  # set in start_services (make_launcher)
        self.phase = "starting"
        self.epoch = -1
        self.env_steps = 0
        self.last_metrics: dict[str, float] = {}
        self.elapsed_offset = 0.0
        self.t_train = None
        self.address = ""
        self.env_id = view.env_id  # replaced by what the env servers describe
        # envs per env server are fixed by the config; `coordinatorctl scale env N` changes the server count
        self.envs_per_server = view.total_num_envs // view.num_env_servers
        self.pending_scale: int | None = None
        self.lost_by_epoch: dict[int, int] = {}  # episodes lost while collecting each epoch
        # Collect calls in flight, by (epoch, env server), and the epochs whose collection was dropped (a
        # synchronous epoch's Collect sent before the run ended: cancelled, never tried again)
        self._collect_calls: dict[tuple[int, int], object] = {}  # their call futures (cancel())
        self._dropped_epochs: set[int] = set()
        self._collect_lock = threading.Lock()

    # --- called by the gRPC servicer ---------------------------------------------------------------------------
    def register(self, role, index, address, pid, incarnation, config_yaml="", caller=None) -> bool:
        """A service's Register over gRPC: its claim checked field by field, and (with credentials) made by the
        service it names."""
        check_claim(role, index)  # what it claims to be, then whether it is that, then the rest
        self._check_caller(caller, role, index, "register")
        check_claim(role, index, address, pid, incarnation, config_yaml)
        return self.registry.register(role, index, address, pid, incarnation, config_yaml)

    def heartbeat(self, role: int, index: int, incarnation: str, caller=None) -> bool:
        self._check_caller(caller, role, index, "heartbeat")
        return self.registry.heartbeat(role, index, incarnation)

    @staticmethod
    def _check_caller(caller, role: int, index: int, what: str) -> None:
        """A service speaks only for itself: its credential's role and index are the ones it names."""
        if caller is None:  # no credentials in this process (in-process tests)
            return
        name = ROLE_NAMES.get(role, f"role {role}")
        if (caller.role, caller.index) != (name, index):
            raise PermissionDenied(f"{caller} cannot {what} as {name}[{index}]: a service speaks only for itself")

    def heard(self, method: str, caller) -> None:
        """rlfleet.wire.servers.make_server's on_call: a heartbeat (or registration) arrived from ``caller``."""
        if method.endswith(("/Heartbeat", "/Register")) and method.startswith("/rlfleet.v1.CoordinatorService/"):
            self.registry.heard(caller.role, caller.index)

    def request_stop(self, reason: str) -> None:
        if not self.fate.stop_event.is_set():
            self.fate.stop_reason = reason
            if self.phase == "starting":
                self.phase = "stopping"
                self.say(f"\nstopping: {reason} (before training: no longer waiting for the services)")
            else:
                self.say(f"\nstopping: {reason} (finishing the current epoch; Ctrl-C again to stop at once)")
        self.fate.stop_event.set()

    def status(self) -> coordinator_pb2.RunStatus:
        st = coordinator_pb2.RunStatus(
            experiment_name=self.view.experiment_name,
            run_dir=str(self.run_dir),
            phase=self.phase,
            epoch=self.epoch,
            max_epochs=self.view.max_epochs,
            env_steps=self.env_steps,
            elapsed_s=self.elapsed(),
            last_metrics={k: v for k, v in self.last_metrics.items() if math.isfinite(v)},
            bottleneck=self.report.bottleneck_line,
        )
        self.registry.add_status(st)
        return st

    def fleet_shape(self) -> FleetShape:
        """The run's shape as the bottleneck's advice needs it, with the server counts of now (`scale env N`)."""
        local = self.view.launcher == "local"
        return FleetShape.from_config(
            self.cfg,
            self.registry.counts["env"],
            self.registry.counts["inference"],
            host_cores=len(os.sched_getaffinity(0)) if local else None,
        )

    def request_scale(self, role: int, count: int) -> tuple[int, str]:
        """`coordinatorctl scale env N`: takes effect at the next epoch boundary. -> (current count, message)."""
        if ROLE_NAMES.get(role) != "env":
            raise InvalidRequest(f"role: only env servers scale during a run, not {ROLE_NAMES.get(role, role)}")
        if self.view.external_env_addresses:
            raise FailedPrecondition(
                "cluster.external_env_addresses: env servers bridging external simulators are fixed by that list"
            )
        if not 1 <= count <= self.MAX_ENV_SERVERS:
            raise InvalidRequest(f"count: {count} is not in 1..{self.MAX_ENV_SERVERS}")
        self.pending_scale = count
        current = self.registry.counts["env"]
        per, steps = self.envs_per_server, self.view.max_steps_per_rollout_epoch
        message = (
            f"env servers {current} -> {count} from the next epoch: {per} envs each, {count * per} train "
            f"envs, {count * per * steps} env steps per epoch (actor.global_batch_size is unchanged: more "
            f"or fewer minibatches per epoch)"
        )
        self.say(f"  scale requested: {message}")
        return current, message

    # compatibility for callers that read these off the coordinator
    @property
    def fatal(self) -> str | None:
        return self.fate.fatal

    @property
    def stop_event(self):
        return self.fate.stop_event

    @property
    def lost_episodes(self) -> int:
        return self.calls.lost_episodes

    def elapsed(self) -> float:
        return self.elapsed_offset + (time.monotonic() - self.t_train if self.t_train else 0.0)

    # --- start-up ---------------------------------------------------------------------------------------------
    def start_services(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.run_dir / "config.yaml"
        config_path.write_text(to_yaml(self.cfg))
        if self.token and (self.local or auth.token_from_env() != self.token):
            # the operator's credential (role ctl), for coordinatorctl: never the secret, which issues every role's;
            # not in attach mode when the deployment supplied the secret: there the run folder is a volume every
            # service shares, and a service holds only its own credential
            auth.write_token(self.run_dir, auth.issue(self.token, "ctl"))
            if not self.local:  # a secret made here: the operator issues the credentials of services started elsewhere
                path = auth.write_token(self.run_dir, self.token, auth.SECRET_FILE)
                self.say(
                    f"  run secret: {path}; give each service started elsewhere its own credential as "
                    f"{auth.TOKEN_ENV} (`python -m rlfleet.wire.auth issue --role ROLE --run-dir {self.run_dir}`)"
                )
        (self.run_dir / "coordinator.json").write_text(json.dumps({"address": self.address, "pid": os.getpid()}))
        self.launcher = make_launcher(self.cfg, self.run_dir, config_path, self.address, self.token)
        from rlfleet.simulators.environments import EnvironmentError_

        try:
            self.launcher.prepare(log=self.say)
        except EnvironmentError_ as exc:
            raise RunFailed(
                f"the {self.view.simulator_type} simulator environment could not be built:\n{exc}"
            ) from None
        self.launcher.start_all()
        if not self.local:
            self.say(
                f"waiting for services to register at {self.address} (cluster.launcher=attach): {self.registry.counts}"
            )
        HealthMonitor(self.registry, self.launcher, self.view, self.run_dir, self.say).start()
        for role, index in list(self.registry.services):
            self.registry.wait(role, index, self.view.startup_timeout_s, stoppable=True)

    # --- one epoch's parts ------------------------------------------------------------------------------------
    def _collect(self, index: int, epoch: int, min_version: int, wait_s: float = 0.0) -> rollout_pb2.CollectResponse:
        """Env server ``index`` collects epoch ``epoch`` with weights >= ``min_version``, which it may wait
        ``wait_s`` seconds for (collocated acting); a server that dies under it is waited for and asked again."""
        calls, reg = self.calls, self.registry
        while True:
            if reg.collocated:  # an env server that (re)started holds no policy yet: the learner publishes first
                calls.ensure_inference_weights()
            svc, stub = calls.rollout_stub(index)
            incarnation, generation = svc.incarnation, reg.inference_generation()
            try:
                with _tracer.start_as_current_span(
                    "collect", attributes={"rlfleet.epoch": epoch, "rlfleet.env_server": index}
                ):
                    request = rollout_pb2.CollectRequest(
                        epoch=epoch,
                        num_steps=self.view.max_steps_per_rollout_epoch // self.view.num_action_chunks,
                        inference_addresses=reg.act_addresses(),
                        learner_address=reg.addresses("learner")[0],
                        min_weights_version=min_version,
                        policy_spec=self.calls.policy_spec,
                        weights_wait_s=wait_s,
                    )
                    with self._collect_lock:
                        if epoch in self._dropped_epochs:
                            raise CollectDropped(f"epoch {epoch}'s collection was dropped: the run ended before it")
                        call = self._collect_calls[(epoch, index)] = stub.Collect.future(
                            request, timeout=self.view.collect_timeout_s
                        )
                    try:
                        resp = call.result()
                    finally:
                        with self._collect_lock:
                            self._collect_calls.pop((epoch, index), None)
                if resp.lost_episodes:
                    self._lost(epoch, resp.lost_episodes)
                    self.say(f"  ! env[{index}]: its external simulator restarted; {resp.lost_episodes} episodes lost")
                return resp
            except CallFailed as exc:
                if not retryable(exc) or self.fate.fatal:
                    raise RunFailed(
                        f"env[{index}] Collect failed: {describe(exc)}"
                        + (f"\n  {self.fate.fatal}" if self.fate.fatal else "")
                    ) from exc
                # did the server die? the monitor notices a process exit at once, a hung server by its heartbeats
                calls.settle(svc, incarnation, generation)
                if calls.same(svc, incarnation) and reg.inference_generation() != generation:
                    # an inference server died under this rollout: the env server is fine and its episodes go
                    # on; the partial rollout is dropped and collected again once the restarted server has weights
                    self.say(f"  ! env[{index}] rollout interrupted by an inference server restart; collecting again")
                    calls.ensure_inference_weights()
                    continue
                if calls.same(svc, incarnation):
                    raise RunFailed(
                        f"env[{index}] Collect failed and the server is still up: "
                        f"{describe(exc)} (see {self.run_dir / 'logs' / f'env_{index}.log'})"
                    ) from exc
                # it died mid-rollout: its partial episodes are dropped (never sent to the learner) and counted
                self._lost(epoch, self.envs_per_server)
                self.say(
                    f"  ! env[{index}] lost mid-rollout ({describe(exc).splitlines()[0]}); "
                    f"{self.envs_per_server} partial episodes dropped, collecting again after restart"
                )

    def _lost(self, epoch: int, n: int) -> None:
        self.calls.add_lost(n)
        with self.calls.lock:
            self.lost_by_epoch[epoch] = self.lost_by_epoch.get(epoch, 0) + n

    def evaluate(self, step: int, num_episodes: int | None = None) -> dict[str, float]:
        phase, self.phase = self.phase, "evaluating"
        try:
            metrics = self.evaluator.evaluate(step, num_episodes)
        finally:
            self.phase = phase
        metrics.update(
            {
                "eval/env_steps": float(self.env_steps),
                "eval/wall_time_s": self.elapsed(),
                "env/lost_episodes": float(self.lost_episodes),
            }
        )
        sent = {k: v for k, v in metrics.items() if math.isfinite(v)}  # the learner refuses NaN/inf (none = no value)
        self.calls.learner().LogMetrics(
            learner_pb2.LogMetricsRequest(step=step, metrics=sent), timeout=self.view.rpc_timeout_s
        )
        self.report.eval_history.append({"step": step, **metrics})
        return metrics

    def _apply_scale(self) -> None:
        """Between epochs: start or retire env servers so that the next epoch collects from the new set."""
        target, self.pending_scale = self.pending_scale, None
        reg = self.registry
        old = reg.counts["env"]
        if target is None or target == old:
            return
        self.launcher.resize("env", target)
        if target > old:
            reg.add("env", range(old, target))
            for i in range(old, target):
                self.launcher.start("env", i)
            try:
                for i in range(old, target):
                    reg.wait("env", i, self.view.startup_timeout_s)
            except RunFailed as exc:
                self.fate.check()
                self.say(f"  ! scaling up did not complete ({exc}); staying at {old} env servers")
                for i in range(old, target):
                    self._retire(i)
                return
        else:
            for i in range(target, old):
                self._retire(i)
        self.say(f"  env servers: {old} -> {target} ({target * self.envs_per_server} train envs)")

    def _retire(self, index: int) -> None:
        self.registry.retire("env", index)
        self.launcher.retire("env", index)

    def _save_state(self) -> None:
        self.report.save_state(self.lost_episodes, self.registry.restart_counts(self.report.prior_restarts))

    # --- the run ----------------------------------------------------------------------------------------------
    def run(self) -> dict:
        view, reg, calls = self.view, self.registry, self.calls
        t_setup = time.monotonic()
        self.say(f"rlfleet: {view.experiment_name} -> {self.run_dir}")
        nnodes, per_node = learner_layout(self.cfg)
        ranks = f" of {nnodes * per_node} ranks" if nnodes * per_node > 1 else ""
        ranks += f" on {nnodes} nodes" if nnodes > 1 else ""
        self.say(
            f"  starting {reg.counts['env']} env server(s), "
            + ("acting with the policy themselves (rollout: env), " if reg.collocated else "")
            + f"{reg.counts['inference']} inference server(s), "
            f"1 learner{ranks} ({view.launcher} launcher, coordinator at {self.address})"
        )
        try:
            self.start_services()
        except RunStopped as exc:  # `coordinatorctl stop` (or a signal) before every service had registered
            self.phase = "stopped"
            self.say(f"stopped before training: {exc}")
            return {"stopped": str(exc), "epochs": 0}
        rpc_timeout = view.rpc_timeout_s
        spec, joint = joint_env_spec(
            [
                calls.rollout_stub(i)[1].Describe(env_pb2.DescribeEnvRequest(), timeout=rpc_timeout)
                for i in range(reg.counts["env"])
            ]
        )
        if joint:
            self.say(joint)
            calls.policy_spec = spec
        self.env_id = spec.env_id
        if view.external_env_addresses and not view.external_eval_env_addresses:
            self.say(
                "  note: evaluation runs on the external training simulators (no "
                "cluster.external_eval_env_addresses): env.eval's env_id, init_params and total_num_envs do not "
                "apply, and training episodes restart after each evaluation"
            )
        t_started = time.monotonic()
        learner = calls.learner()
        pub = learner.PublishWeights(
            learner_pb2.PublishWeightsRequest(env_spec=spec, inference_addresses=reg.policy_addresses()),
            timeout=max(120.0, rpc_timeout),
        )
        calls.weights_published()
        status = learner.Status(learner_pb2.LearnerStatusRequest(), timeout=rpc_timeout)
        start_epoch = status.epoch + 1
        calls.lost_episodes = self.report.load_state(resumed_step=start_epoch)
        self.env_steps, self.elapsed_offset = status.env_steps, status.elapsed_time_s
        version = pub.weights_version
        chunk = view.num_action_chunks
        batch = view.total_num_envs * view.max_steps_per_rollout_epoch // chunk
        self.say(
            f"  services up in {time.monotonic() - t_setup:.1f}s (started and registered {t_started - t_setup:.1f}s, "
            f"first weights set {time.monotonic() - t_started:.1f}s); env {spec.env_id}: "
            f"{view.total_num_envs} envs x {view.max_steps_per_rollout_epoch} steps"
            + (f" in chunks of {chunk}" if chunk > 1 else "")
            + f" = {batch} samples/epoch, "
            f"{view.pipeline_stage_num} pipeline stage(s)"
            + (f"; resumed at epoch {start_epoch}, {self.env_steps} env steps" if start_epoch else "")
        )
        history = self.report.eval_history
        if view.eval_before_train and start_epoch == 0 and not any(e["step"] == 0 for e in history):
            self.phase = "evaluating"
            self.say(f"  evaluating the initial policy ({view.eval.num_episodes} episodes) ...")
            ev = self.evaluate(0)
            self.say(f"  eval @ start: {eval_line(ev)}")
            self._save_state()
        if (
            start_epoch
            and view.val_check_interval
            and start_epoch % view.val_check_interval == 0
            and not any(e["step"] == start_epoch for e in history)
        ):
            # the killed run saved this checkpoint, then was cut off while evaluating it: redo that evaluation
            self.phase = "evaluating"
            self.say(f"  evaluating epoch {start_epoch} again (the run stopped before its evaluation ended) ...")
            ev = self.evaluate(start_epoch)
            self.say(f"  eval @ epoch {start_epoch}: {eval_line(ev)}")
            self._save_state()
        self.phase = "training"
        self.t_train = time.monotonic()
        epoch = start_epoch
        stop_why = "budget reached"
        pool = ThreadPoolExecutor(self.MAX_ENV_SERVERS)  # threads start as needed: room for `scale env N`
        depth = view.max_staleness  # async: collections started ahead of the epoch being trained
        ahead: deque = deque()  # (epoch, futures), oldest first
        t_sent_ahead = None  # when the synchronous epoch sent ahead (_prefetch_next) could start stepping
        next_span = None  # that epoch's span, opened when its collection went out
        target, in_a_row = view.early_stop_success_rate, view.early_stop_evals
        # resumed, and the policy resumed from was evaluated (now, or before the run stopped): the evaluations in a
        # row (the eval history survives --resume) may already be enough
        resumed_learned = start_epoch and history and history[-1]["step"] == start_epoch
        why = learned(history, target, in_a_row) if resumed_learned else None
        done = why is not None
        if done:
            stop_why = why
        try:
            while not done:
                if epoch >= view.max_epochs:
                    stop_why = f"runner.max_epochs={view.max_epochs} reached"
                    break
                if view.max_env_steps is not None and self.env_steps >= view.max_env_steps:
                    stop_why = f"runner.max_env_steps={view.max_env_steps} reached"
                    break
                if view.max_wall_time_s is not None and self.elapsed() >= view.max_wall_time_s:
                    stop_why = f"runner.max_wall_time_s={view.max_wall_time_s} reached"
                    break
                if self.fate.stop_event.is_set():
                    stop_why = self.fate.stop_reason or "stopped"
                    break
                if not ahead:
                    self._apply_scale()
                # one trace per epoch; a synchronous epoch sent ahead opened its span when its collection went out
                span = next_span or _tracer.start_span("epoch", context=Context(), attributes={"rlfleet.epoch": epoch})
                next_span = None
                with trace.use_span(span, end_on_exit=True):
                    # a synchronous epoch sent ahead started when the learner's last reply came (its weights had
                    # landed); any other now
                    t0 = t_sent_ahead if t_sent_ahead is not None else time.perf_counter()
                    t_sent_ahead = None
                    rollout = ahead.popleft()[1] if ahead else self._start_collect(pool, epoch, version)
                    results = [calls.await_(f) for f in rollout]
                    t_rollout = time.perf_counter() - t0
                    while len(ahead) < depth and self.pending_scale is None:
                        # epoch k+d is collected after k+d-1 on each env server, with weights >= k+d-depth: its
                        # samples are at most `depth` versions old when it trains
                        nxt = epoch + 1 + len(ahead)
                        if nxt >= view.max_epochs:
                            break
                        after = ahead[-1][1] if ahead else None
                        ahead.append((nxt, self._start_collect(pool, nxt, max(version, nxt - depth), after)))
                    sent_ahead = not depth and self._prefetch_next(epoch, sum(r.env_steps for r in results))
                    if sent_ahead:
                        # synchronous, collocated: epoch k+1 is collected with the weights epoch k's update makes
                        # (version + 1), which each env server waits for (up to the Collect's own deadline)
                        next_span = _tracer.start_span(
                            "epoch", context=Context(), attributes={"rlfleet.epoch": epoch + 1}
                        )
                        with trace.use_span(next_span):  # its collection belongs to its own epoch's trace
                            nxt = self._start_collect(pool, epoch + 1, version + 1, wait_s=view.collect_timeout_s)
                        ahead.append((epoch + 1, nxt))
                    metrics = self._train(learner, epoch, version, results, t0, t_rollout)
                    if sent_ahead:
                        t_sent_ahead = time.perf_counter()
                version = int(metrics["train/weights_version"])
                bottleneck = self.report.note_epoch(epoch, metrics, self.fleet_shape())
                if epoch % view.progress_interval == 0:
                    self.say(
                        self.report.progress_line(epoch, metrics, self.env_steps, self.elapsed(), self.lost_episodes)
                    )
                if bottleneck:
                    self.say(bottleneck)
                epoch += 1
                if view.val_check_interval and epoch % view.val_check_interval == 0:
                    ev = self.evaluate(epoch)
                    self.say(f"  eval @ epoch {epoch}: {eval_line(ev)}")
                    why = learned(history, target, in_a_row)
                    if why:
                        stop_why = why
                        break
        except CallFailed as exc:
            raise RunFailed(calls.why_failed(exc, "a service call")) from exc
        finally:
            for e, futures in ahead:  # a collection started ahead is not trained on: let it end, do not wait
                for f in futures:
                    f.cancel()
                if not depth:  # synchronous: it may be waiting for weights that will not come
                    self._drop_collection(e)
            if next_span is not None:  # the epoch sent ahead never trained
                next_span.set_attribute("rlfleet.dropped", True)
                next_span.end()
            pool.shutdown(wait=False, cancel_futures=True)
        train_time = self.elapsed()
        self.phase = "evaluating"
        interrupted = self.fate.stop_event.is_set() and not self.fate.fatal
        self.say(f"training done after {train_time:.0f}s: {stop_why}")
        final = None
        if not interrupted:
            if history and history[-1]["step"] == epoch and history[-1]["eval/num_episodes"] >= view.eval.num_episodes:
                final = history[-1]
            else:
                self.say(f"final evaluation: {view.eval.num_episodes} episodes ...")
                final = self.evaluate(epoch)
        ckpt = (
            learner.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(), timeout=view.collect_timeout_s).path
            if epoch > 0
            else ""
        )
        self._save_state()
        summary = self.report.write_summary(
            env_id=self.env_id,
            epochs=epoch,
            env_steps=self.env_steps,
            train_time=train_time,
            stop_why=stop_why,
            final=final,
            ckpt=ckpt,
            lost_episodes=self.lost_episodes,
            restarts=self.registry.restart_counts(self.report.prior_restarts),
            last_metrics=self.last_metrics,
        )
        if self.fate.fatal is None:
            # the run has ended, its checkpoint and summary written: a service that exits from here on (a kill -9
            # of the learner while the run shuts down) is part of its shutdown, not a failure to resume from
            self.registry.shutting_down = True
        return summary

    def _start_collect(self, pool, epoch: int, version: int, after: list | None = None, wait_s: float = 0.0) -> list:
        """Collect epoch ``epoch`` on every env server (futures); samples need weights version >= ``version``
        (which a collocated env server may wait ``wait_s`` seconds for). ``after``: each server's collection of
        the previous epoch, which must end first (one epoch at a time)."""

        def collect(i: int):
            if after is not None and i < len(after):
                after[i].result()
            return self._collect(i, epoch, version, wait_s)

        # each collection runs in the caller's context: its span is a child of the epoch's
        return [pool.submit(contextvars.copy_context().run, collect, i) for i in range(self.registry.counts["env"])]

    def _prefetch_next(self, epoch: int, steps: int) -> bool:
        """Whether the next synchronous epoch's Collect goes out before epoch ``epoch`` (``steps`` env steps)
        trains: the env servers act themselves (collocated) and wait for the new weights, so they step as soon as
        the learner publishes them, not after its reply, this loop's bookkeeping and a new call. Only when nothing
        else comes between the two epochs: no evaluation, scaling, stop or end of the budget."""
        v, nxt = self.view, epoch + 1
        return (
            self.registry.collocated
            and v.max_staleness == 0
            and self.pending_scale is None
            and not self.fate.stop_event.is_set()
            and nxt < v.max_epochs
            and not (v.val_check_interval and nxt % v.val_check_interval == 0)
            and (v.max_env_steps is None or self.env_steps + steps < v.max_env_steps)
            and (v.max_wall_time_s is None or self.elapsed() < v.max_wall_time_s)
        )

    def _drop_collection(self, epoch: int) -> None:
        """Cancel epoch ``epoch``'s Collect calls (a synchronous epoch sent ahead when the run ended: its env
        servers may be waiting for weights that will not come) and keep it from being asked again."""
        with self._collect_lock:
            self._dropped_epochs.add(epoch)
            live = [c for (e, _), c in self._collect_calls.items() if e == epoch]
        for call in live:
            call.cancel()

    def _train(self, learner, epoch: int, version: int, results, t0: float, t_rollout: float) -> dict[str, float]:
        """Train on epoch ``epoch`` (collected as ``results``); -> the epoch's metrics."""
        calls, reg = self.calls, self.registry
        steps = sum(r.env_steps for r in results)
        lost_epoch = self.lost_by_epoch.pop(epoch, 0)
        extra = {
            "time/rollout": t_rollout,
            "rollout/env_steps_per_s": steps / t_rollout,
            "time/env": max(r.env_time_s for r in results),
            "time/inference_wait": max(r.inference_wait_s for r in results),
            # the wire's share (docs/architecture.md#shared-memory-on-one-host): the slowest env server's Act
            # and push encoding (the learner adds its decoding of the pushes), bytes summed over env servers
            "time/wire/act_s": max(r.wire_act_s for r in results),
            "time/wire/rollout_s": max(r.wire_rollout_s for r in results),
            "wire/act_bytes": float(sum(r.act_bytes for r in results)),
            "wire/act_shm_bytes": float(sum(r.act_shm_bytes for r in results)),
            "wire/rollout_bytes": float(sum(r.rollout_bytes for r in results)),
            "wire/rollout_shm_bytes": float(sum(r.rollout_shm_bytes for r in results)),
            "env/lost_episodes": float(self.lost_episodes),
            "env/lost_episodes_epoch": float(lost_epoch),
            # weights versions the learner is ahead of the oldest sample it trains on (0 when synchronous)
            "rollout/staleness": float(version - min(r.weights_version for r in results)),
            "time/elapsed": self.elapsed(),
        }
        t1 = time.perf_counter()
        try:
            with _tracer.start_as_current_span("train", attributes={"rlfleet.epoch": epoch}):
                resp = calls.await_(
                    learner.Train.future(
                        learner_pb2.TrainRequest(
                            epoch=epoch,
                            worker_indices=list(range(reg.counts["env"])),
                            inference_addresses=reg.policy_addresses(),
                            extra_metrics={k: v for k, v in extra.items() if math.isfinite(v)},
                        ),
                        timeout=self.view.collect_timeout_s,
                    )
                )
        except CallFailed as exc:
            raise RunFailed(calls.why_failed(exc, "learner Train")) from exc
        if resp.publish_error:
            self.say(
                f"  ! weights {resp.weights_version} did not reach every inference server "
                f"({resp.publish_error.splitlines()[0]}); republishing"
            )
            calls.republish()
        metrics = dict(resp.metrics)
        metrics["train/weights_version"] = float(resp.weights_version)
        metrics["time/step"] = time.perf_counter() - t0
        metrics["time/train_rpc"] = time.perf_counter() - t1
        self.env_steps = int(metrics.get("env/env_steps", self.env_steps + steps))
        self.last_metrics, self.epoch = metrics, epoch
        self._save_state()
        return metrics

    def shutdown(self) -> None:
        self.registry.shutting_down = True
        self.phase = "stopped"
        if any(s.alive for s in list(self.registry.services.values())):
            time.sleep(min(2.0, self.view.heartbeat_interval_s * 1.5))  # let heartbeats carry the word
        if self.launcher is not None:
            self.launcher.stop_all()


def install_signal_handlers(coord: Coordinator) -> None:
    """SIGINT/SIGTERM: the first asks the run to stop after this epoch, the next stops it at once. The handler
    takes no lock (it runs on the main thread, which may hold one; see rlfleet.wire.service): a thread turns the
    recorded signal into the stop request."""
    received: list[int] = []

    def on_signal(signum, frame):
        if received or coord.stop_event.is_set():
            raise KeyboardInterrupt
        received.append(signum)

    def relay():
        while not received:
            time.sleep(0.05)
        coord.request_stop(f"{signal.Signals(received[0]).name} received")

    threading.Thread(target=relay, name="signals", daemon=True).start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

"""Env server: hosts a VecEnv (EnvService) and the rollout worker next to it (RolloutService).

    python -m services.env.server --config run/config.yaml --index 0 [--coordinator ADDR]
    python -m services.env.server --config run/config.yaml --external-env HOST:PORT   # bridge to an external sim
    python -m services.env.server --config run/config.yaml --env-only                 # EnvService only

This module only translates gRPC to calls on the core objects: a vec env (services.env.vec_env), the
``RolloutWorker`` and the ``PolicyRunner`` that runs its calls. It runs in the simulator's own
Python environment (rlfleet.simulators.environments), so it imports nothing but the env side of rlfleet.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
from opentelemetry import trace

from rlfleet.config import env_server_config, load_service_config, rollout_in_env
from rlfleet.config.views import EnvView, InferenceView, as_view, build_view, service_view
from rlfleet.errors import Cancelled, FailedPrecondition, InvalidRequest
from rlfleet.v1 import env_pb2, env_pb2_grpc, inference_pb2, inference_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from rlfleet.wire import codec, servers, shm, status, streams, tracing
from rlfleet.wire.addresses import check_address
from rlfleet.wire.clients import CONNECT_TIMEOUT_S as LEARNER_CONNECT_TIMEOUT_S
from rlfleet.wire.clients import WireStats, learner_reachable, push_rollout
from rlfleet.wire.service import ServiceRuntime, common_args, exit_after, setup_process
from rlfleet.wire.spaces import TensorSpace, spaces_from_proto
from services.env.remote import EnvConnectionLost
from services.env.rollout import PolicyRunner, RolloutWorker
from services.env.vec_env import VecEnv
from services.env.vec_env_interface import VecEnvInterface

if (
    TYPE_CHECKING
):  # torch: only a collocated env server (the main environment) holds a policy; simulator environments have none
    from rlfleet.policies.local import LocalPolicy

MAX_STEP_STREAMS = 4  # concurrent EnvService.Step streams per server (more: RESOURCE_EXHAUSTED)
STEP_IDLE_RECLAIM_S = 30.0  # with every Step slot taken, a stream idle this long is closed for a newcomer
MAX_COLLECT_STEPS = 100_000  # steps per env in one Collect (the rollout buffer is allocated up front)
MAX_ROLLOUT_BYTES = 16 << 30  # observation bytes of one Collect's buffer
MAX_EVAL_EPISODES = 100_000  # per Evaluate call

ROLE = "env"
_tracer = trace.get_tracer("rlfleet")


def env_spec_proto(
    env: VecEnvInterface, incarnation: str = "", max_step_streams: int = MAX_STEP_STREAMS
) -> env_pb2.EnvSpec:
    spec = env_pb2.EnvSpec(
        env_id=env.env_id,
        num_envs=env.num_envs,
        max_episode_steps=env.max_episode_steps,
        task_descriptions=list(env.instructions),
        auto_reset=env.auto_reset,
        incarnation=incarnation,
        contract_version=env.contract_version,
        num_reset_states=env.num_reset_states,
        max_action_chunk=env.max_action_chunk,
        max_step_streams=max_step_streams,
        simulator=env.simulator,
    )
    for k, space in env.observation_space.items():
        spec.observation_space[k].CopyFrom(space.to_proto())
    spec.action_space.CopyFrom(env.action_space.to_proto())
    return spec


class EnvServicer(env_pb2_grpc.EnvServiceServicer):
    """EnvService over a VecEnv. ``owns_env``: Close releases the envs (a standalone simulator server); when a
    rollout worker shares them, Close is refused (the envs belong to the run)."""

    def __init__(
        self,
        env: VecEnv,
        incarnation: str = "",
        *,
        owns_env: bool = False,
        max_step_streams: int = MAX_STEP_STREAMS,
        step_idle_reclaim_s: float = STEP_IDLE_RECLAIM_S,
    ):
        self.env, self.incarnation, self.owns_env = env, incarnation, owns_env
        self.max_step_streams = max_step_streams
        # a stream that waits for its caller's next step longer than step_idle_reclaim_s keeps its slot until a
        # newcomer finds every slot taken; then it is closed (DEADLINE_EXCEEDED) and the newcomer served
        self._streams = streams.StreamSlots(max_step_streams, "Step", reclaim_idle_s=step_idle_reclaim_s)

    @status.handler
    def Describe(self, request, context):
        return env_spec_proto(self.env, self.incarnation, self.max_step_streams)

    @status.handler
    def Reset(self, request, context):
        ids = list(request.env_ids)
        obs = self.env.reset(ids, list(request.seeds), list(request.reset_state_ids))
        rows = ids or range(self.env.num_envs)
        return env_pb2.ResetResponse(
            observations=codec.encode_map(obs), instructions=[self.env.instructions[i] for i in rows]
        )

    @status.handler
    def Step(self, request_iterator, context):
        with self._streams.stream(request_iterator, context) as requests:  # ResourceExhausted when all are busy
            for req in requests:
                actions = codec.decode(req.actions, "actions", dtype=np.float32)
                yield self.env.step(list(req.env_ids), actions).to_proto()

    @status.handler
    def Close(self, request, context):
        if not self.owns_env:
            raise FailedPrecondition(
                "these envs belong to a running rollout worker; they close when the env server shuts down"
            )
        self.env.close()
        return env_pb2.CloseResponse()


PUSH_TIMEOUT_S = 300.0  # a rollout's push to the learner, when the caller set no deadline


def _time_left(context, margin: float = 0.0, default: float = PUSH_TIMEOUT_S) -> float:
    """Seconds left of the caller's deadline less ``margin`` (``default`` without one): what a call this request
    makes may take."""
    left = context.time_remaining()
    if left is None or left > 1e6:  # gRPC reports "no deadline" as a huge number
        return default
    return max(0.0, min(default, left - margin))


def _should_stop(context, margin: float = 2.0):
    """Stop between steps when the caller has gone or its deadline is about to pass."""

    def check() -> bool:
        left = context.time_remaining()
        return not context.is_active() or (left is not None and left < margin)

    return check


class CollocatedPolicyServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Collocated acting (``cluster.component_placement.rollout: env``, issue 37): this env server holds the policy
    (rlfleet.policies.local.LocalPolicy) and takes the learner's weights on the inference service's own methods,
    so the learner's publisher and the protocol are the same as toward an inference server: the shared-memory
    handshake, ``UpdateWeights`` (the learner's alone: rlfleet.wire.callers.METHOD_ROLES) and ``Describe``. It
    serves no ``Act``: its rollout worker acts in this process."""

    def __init__(self, policy: LocalPolicy, shared_memory: bool = True):
        self.policy = policy
        self.shared_memory = shared_memory  # read weights by handle from a learner on this host

    @status.handler
    def SharedMemory(self, request, context):
        return shm.answer(request, self.shared_memory)

    @status.handler
    def UpdateWeights(self, request_iterator, context):
        from rlfleet.wire import weights  # torch: imported where a policy is held

        return weights.receive(request_iterator, self.policy, self.shared_memory)

    @status.handler
    def Describe(self, request, context):
        policy = self.policy
        return inference_pb2.InferenceInfo(
            model_type=policy.model_cfg.model_type,
            weights_version=policy.version,
            num_parameters=policy.num_parameters,
            requests_served=policy.requests_served,
            batches_run=policy.requests_served,
            mean_batch_rows=0.0,
            reads_packed_weights=True,  # UpdateWeights: rlfleet.wire.weights.assemble reads WeightsChunk.tensors
        )


def local_policy(view: InferenceView, device: str = "cpu") -> LocalPolicy:
    """The policy a collocated env server acts with: the inference view's (the run config's rollout keys), acting
    as an inference server would (the same padding of a batch, the same noise keys)."""
    from rlfleet.policies.families import get_family
    from rlfleet.policies.local import LocalPolicy

    rows = view.batch_invariant_rows
    if rows is None:
        rows = get_family(view.model.model_type).batch_invariant_rows
    return LocalPolicy(
        view.model,
        normalize_obs=view.normalize_obs,
        logprob_type=view.logprob_type,
        batch_invariant_rows=rows,
        weights_precision=view.weights_precision,
        device=device,
    )


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        worker: RolloutWorker,
        index: int,
        incarnation: str,
        *,
        act_timeout_s: float = 120.0,
        reconnect_timeout_s: float = 120.0,
        shared_memory: bool = True,
        local_policy: LocalPolicy | None = None,
    ):
        self.worker, self.index, self.incarnation = worker, index, incarnation
        self.runner = PolicyRunner(
            worker,
            index,
            act_timeout_s=act_timeout_s,
            reconnect_timeout_s=reconnect_timeout_s,
            shared_memory=shared_memory,
            local_policy=local_policy,
        )
        # the rollout's observation buffers live in a shared-memory segment of this process: a learner on this host
        # that accepts handles copies them from there (no encoding here); any other gets them inline
        self.rollout_arena = shm.Arena("rollout", slots=1) if shared_memory and not shm.unavailable() else None
        self.lock = threading.Lock()
        self._policy_spec = None  # (the last policy_spec, its spaces): spaces are built once per policy spec

    def _use_policy_spec(self, request) -> None:
        """A run over several simulators: act in its policy's (joint) spaces (services.env.policy_spaces)."""
        if not request.HasField("policy_spec"):
            return
        spec = request.policy_spec
        try:
            if self._policy_spec is None or self._policy_spec[0] != spec:
                spaces = spaces_from_proto(spec.observation_space), TensorSpace.from_proto(spec.action_space)
                copy = env_pb2.EnvSpec()
                copy.CopyFrom(spec)
                self._policy_spec = (copy, spaces)
            self.worker.use_policy_spaces(*self._policy_spec[1])
        except ValueError as exc:
            own = self.worker.own_env
            raise InvalidRequest(
                f"policy_spec: env[{self.index}] ({own.simulator}:{own.env_id}) cannot act in "
                f"the run's policy spaces: {exc}"
            ) from None

    def _acquire(self, context) -> None:
        """One Collect/Evaluate at a time; a caller that waits past its deadline gets DEADLINE_EXCEEDED."""
        left = context.time_remaining()
        no_deadline = left is None or left > 1e6  # gRPC reports "no deadline" as a huge number
        if not self.lock.acquire(timeout=-1 if no_deadline else max(0.0, left)):
            raise Cancelled("another Collect/Evaluate was still running when the deadline passed")

    @status.handler
    def Collect(self, request, context):
        if not 1 <= request.num_steps <= MAX_COLLECT_STEPS:
            raise InvalidRequest(f"num_steps: {request.num_steps} is not in 1..{MAX_COLLECT_STEPS}")
        row_bytes = (
            sum(int(np.prod(sp.shape)) * np.dtype(sp.dtype).itemsize for sp in self.worker.observation_space.values())
            * self.worker.env.num_envs
        )
        if request.num_steps * row_bytes > MAX_ROLLOUT_BYTES:
            raise InvalidRequest(
                f"num_steps: {request.num_steps} steps of these observations need "
                f"{request.num_steps * row_bytes / 2**30:.1f} GiB; at most "
                f"{MAX_ROLLOUT_BYTES / 2**30:.0f} GiB per Collect"
            )
        if not request.inference_addresses and self.runner.local_policy is None:
            raise InvalidRequest("inference_addresses: at least one inference server is needed")
        for i, address in enumerate(request.inference_addresses):
            check_address(address, f"inference_addresses[{i}]")
        check_address(request.learner_address, "learner_address")
        if not (math.isfinite(request.weights_wait_s) and request.weights_wait_s >= 0):
            raise InvalidRequest(f"weights_wait_s: {request.weights_wait_s} is not a number of seconds >= 0")
        self._acquire(context)
        try:
            self._use_policy_spec(request)
            # an unreachable learner fails the call now, not after a whole rollout and the push's wait
            learner_reachable(request.learner_address, min(LEARNER_CONNECT_TIMEOUT_S, _time_left(context)))
            self.runner.await_weights(
                request.min_weights_version,
                _time_left(context, margin=2.0, default=request.weights_wait_s),
                _should_stop(context),
            )
            arena = self.rollout_arena
            (rollout, summary), lost = self.runner.run(
                request.inference_addresses,
                lambda policy: self.worker.collect(
                    request.epoch,
                    request.num_steps,
                    policy,
                    request.min_weights_version,
                    _should_stop(context),
                    buffers=arena.buffers if arena is not None else None,
                ),
                after_loss=self.worker.reset_all,
            )
            pushed = WireStats()
            with _tracer.start_as_current_span("push_rollout", attributes={"rlfleet.epoch": request.epoch}):
                push_rollout(
                    request.learner_address,
                    rollout,
                    request.epoch,
                    self.index,
                    self.incarnation,
                    timeout=_time_left(context, margin=1.0),
                    arena=arena,
                    stats=pushed,
                )
        finally:
            self.lock.release()
        act = summary.act_wire
        return rollout_pb2.CollectResponse(
            epoch=summary.epoch,
            env_steps=summary.env_steps,
            episodes=[codec.episode_to_proto(e) for e in summary.episodes],
            rollout_time_s=summary.rollout_time_s,
            env_time_s=summary.env_time_s,
            inference_wait_s=summary.inference_wait_s,
            weights_version=summary.weights_version,
            lost_episodes=lost,
            wire_act_s=act.seconds,
            act_bytes=act.bytes,
            act_shm_bytes=act.shm_bytes,
            wire_rollout_s=pushed.seconds,
            rollout_bytes=pushed.bytes,
            rollout_shm_bytes=pushed.shm_bytes,
        )

    @status.handler
    def Describe(self, request, context):
        return env_spec_proto(self.worker.own_env, self.incarnation)

    @status.handler
    def Evaluate(self, request, context):
        if not 0 < request.num_episodes <= MAX_EVAL_EPISODES:
            raise InvalidRequest(f"num_episodes: {request.num_episodes} is not in 1..{MAX_EVAL_EPISODES}")
        if not 0 <= request.seed < 2**31:  # episode i is seeded seed + i
            raise InvalidRequest(f"seed: {request.seed} is not in [0, 2**31)")
        if request.first_episode < 0:
            raise InvalidRequest(f"first_episode: must be >= 0, got {request.first_episode}")
        if not request.inference_addresses and self.runner.local_policy is None:
            raise InvalidRequest("inference_addresses: at least one inference server is needed")
        for i, address in enumerate(request.inference_addresses):
            check_address(address, f"inference_addresses[{i}]")
        if request.video_episodes < 0 or (request.video_episodes and not request.video_dir):
            raise InvalidRequest(f"video_episodes: {request.video_episodes} needs a video_dir and must be >= 0")
        t0 = time.perf_counter()
        self._acquire(context)
        episode_ids = list(range(request.first_episode, request.first_episode + request.num_episodes))
        try:
            self._use_policy_spec(request)
            episodes, lost = self.runner.run(
                request.inference_addresses,
                lambda policy: self.worker.evaluate(
                    episode_ids,
                    request.seed,
                    request.deterministic,
                    policy,
                    use_reset_state_ids=request.use_reset_state_ids,
                    should_stop=_should_stop(context),
                    video_episodes=request.video_episodes,
                    video_dir=request.video_dir,
                ),
            )
        finally:
            self.lock.release()
        return rollout_pb2.EvaluateResponse(
            episodes=[codec.episode_to_proto(e) for e in episodes],
            eval_time_s=time.perf_counter() - t0,
            lost_episodes=lost,
        )


def env_kwargs(view: EnvView, split: str, num_envs: int, seed: int, auto_reset: bool) -> dict:
    """VecEnv arguments for env.{split} of the env view (or of the run config: its view is built)."""
    view = as_view(EnvView, view)
    e = view.train if split == "train" else view.eval
    return dict(
        env_id=e.env_id,
        num_envs=num_envs,
        max_episode_steps=e.max_episode_steps,
        auto_reset=auto_reset,
        ignore_terminations=view.ignore_terminations if split == "train" else False,
        init_params=dict(e.init_params),
        seed=seed,
        simulator=e.simulator_type,
    )


def build_worker(
    view: EnvView, index: int, external_env: str | None = None, external_eval_env: str | None = None
) -> tuple[object, RolloutWorker]:
    """The env (built-in VecEnv, or an external EnvService) and the rollout worker in front of it, as this env
    server's view says (or the run config: its view is built)."""
    view = as_view(EnvView, view)
    n_servers = view.num_env_servers
    train, ev = view.train, view.eval
    per_server = train.total_num_envs // n_servers
    seed = train.seed + 10_000 * view.seed + index * per_server
    if external_env:
        from services.env.remote import RemoteVecEnv

        chunk = view.num_action_chunks  # a server whose max_action_chunk is shorter is refused here
        env = RemoteVecEnv(external_env, call_timeout=view.act_timeout_s, policy_chunk=chunk)
        if env.num_envs != per_server:
            raise SystemExit(
                f"config error: the external env at {external_env} hosts {env.num_envs} envs; "
                f"env.train.total_num_envs / cluster.num_env_servers = {per_server}"
            )
        if external_eval_env:  # connected (and checked) now: an unusable server is refused before the first epoch
            eval_env = RemoteVecEnv(external_eval_env, call_timeout=view.act_timeout_s, policy_chunk=chunk)
            eval_factory = lambda: eval_env  # noqa: E731
        else:
            eval_factory = lambda: env  # noqa: E731 - the external sim serves both (the coordinator said so)
    else:
        env = VecEnv(**env_kwargs(view, "train", per_server, seed, view.auto_reset))
        eval_factory = lambda: VecEnv(  # noqa: E731
            **env_kwargs(view, "eval", ev.total_num_envs // n_servers, ev.seed, False)
        )
    worker = RolloutWorker(
        env,
        view.pipeline_stage_num,
        auto_reset=view.auto_reset,
        eval_env_factory=eval_factory,
        group_size=view.group_size,
        use_fixed_reset_state_ids=train.use_fixed_reset_state_ids,
        seed=seed,
        step_spans=tracing.enabled(step_spans=True),
    )
    return env, worker


def serve(
    view: EnvView,
    address: str,
    index: int = 0,
    coordinator: str | None = None,
    external_env: str | None = None,
    policy: InferenceView | None = None,
):
    """Start env server ``index``: ``view`` is its view (of ``env_server_config(cfg, index)``), or the run config
    (that server's view is built from it). ``policy``: the inference view of a run with collocated acting
    (``cluster.component_placement.rollout: env``; from a run config: built when it says so): this server then
    holds the policy, takes its weights from the learner and acts itself."""
    if not isinstance(view, EnvView):
        if policy is None and rollout_in_env(view):
            policy = build_view(InferenceView, view)
        view = build_view(EnvView, env_server_config(view, index))
    held = None
    if policy is not None:  # on the env's GPU when this server was placed on one (rollout: env)
        from rlfleet.wire.service import pick_device

        held = local_policy(policy, pick_device())
    external_eval = None
    if external_env and len(view.external_eval_env_addresses) > index:
        external_eval = view.external_eval_env_addresses[index]
    env, worker = build_worker(view, index, external_env, external_eval)
    server = servers.make_server(max_workers=16)
    runtime = ServiceRuntime("env", index, server, "", coordinator, view.heartbeat_interval_s, view.heartbeat_timeout_s)
    names = [servers.service_name(rollout_pb2, "RolloutService")]
    if not external_env:
        env_pb2_grpc.add_EnvServiceServicer_to_server(EnvServicer(env, runtime.incarnation), server)
        names.append(servers.service_name(env_pb2, "EnvService"))
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(
        RolloutServicer(
            worker,
            index,
            runtime.incarnation,
            act_timeout_s=view.act_timeout_s,
            reconnect_timeout_s=view.external_env_reconnect_timeout_s,
            shared_memory=view.shared_memory == "auto",
            local_policy=held,
        ),
        server,
    )
    if held is not None:
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(
            CollocatedPolicyServicer(held, view.shared_memory == "auto"), server
        )
        names.append(servers.service_name(inference_pb2, "InferenceService"))
    servers.add_health_and_reflection(server, *names)
    runtime.address = servers.bind(server, address)
    server.start()
    return server, runtime.address, worker, runtime


def serve_env_only(view: EnvView, address: str, split: str = "train"):
    """A standalone EnvService (no rollout worker): what an external simulator looks like, for tests and
    `coordinatorctl check-env`. ``view``: the env view (or the run config: its view is built)."""
    view = as_view(EnvView, view)
    e = view.train if split == "train" else view.eval
    env = VecEnv(**env_kwargs(view, split, e.total_num_envs, e.seed, view.auto_reset if split == "train" else True))
    server = servers.make_server(max_workers=16)
    env_pb2_grpc.add_EnvServiceServicer_to_server(EnvServicer(env, owns_env=True), server)
    servers.add_health_and_reflection(server, servers.service_name(env_pb2, "EnvService"))
    bound = servers.bind(server, address)
    server.start()
    return server, bound, env


def main(argv=None) -> int:
    parser = common_args("rlfleet env server (envs + rollout worker)")
    parser.add_argument(
        "--external-env", default=None, help="address of an external EnvService to run the rollout worker in front of"
    )
    parser.add_argument(
        "--env-only", action="store_true", help="serve only EnvService over env.train (a standalone simulator server)"
    )
    args = parser.parse_args(argv)
    run_cfg = load_service_config(args)  # the run's config (registration compares it with the coordinator's)
    cfg = env_server_config(run_cfg, args.index)  # with this server's own simulator (env.per_server)
    view = service_view(EnvView, cfg)  # built and checked once, before anything starts
    setup_process(args, cfg, ROLE)
    if args.env_only:
        server, bound, env = serve_env_only(view, args.address)
        print(f"rlfleet EnvService ({env.simulator}:{env.env_id}, {env.num_envs} envs) on {bound}", flush=True)
        try:
            server.wait_for_termination()
        except KeyboardInterrupt:
            pass
        env.close()
        return 0
    try:
        policy = service_view(InferenceView, run_cfg) if rollout_in_env(run_cfg) else None  # collocated acting
        server, bound, worker, runtime = serve(
            view, args.address, args.index, args.coordinator, args.external_env, policy
        )
    except Exception as exc:  # noqa: BLE001 - a simulator that cannot start: say why in one line
        from services.env.backends.base import BackendUnavailable

        if isinstance(exc, (BackendUnavailable, InvalidRequest, EnvConnectionLost, TimeoutError)):
            raise SystemExit(f"rlfleet env[{args.index}]: cannot start the simulator: {exc}") from None
        raise
    if args.external_env:  # the simulator this bridge serves is the external one, not env.train's
        own = worker.own_env
        print(
            f"rlfleet env[{args.index}]: bridge to the external env {args.external_env}: {own.simulator}:"
            f"{own.env_id}, {own.num_envs} envs, env contract version {own.contract_version}",
            flush=True,
        )
    else:
        print(
            f"rlfleet env[{args.index}]: {view.train.simulator_type}:{view.train.env_id} in {sys.prefix} "
            f"({_versions(view.train.simulator_type)})",
            flush=True,
        )
    code = runtime.serve_until_stopped(run_cfg, args)
    worker.close()
    return code


def _versions(simulator: str) -> str:
    """The simulator environment's key package versions, for the log."""
    from importlib import metadata

    from rlfleet.simulators import get_simulator

    env = get_simulator(simulator).environment
    names = ["mujoco", "numpy"] + ([r.split("=")[0].split(">")[0].split("<")[0] for r in env.pip] if env else [])
    out = []
    for name in dict.fromkeys(names):
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


if __name__ == "__main__":
    exit_after(main)

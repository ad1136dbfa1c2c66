"""Env server: hosts a VecEnv (EnvService) and the rollout worker next to it (RolloutService).

    python -m services.env.server --config run/config.yaml --index 0 [--coordinator ADDR]
    python -m services.env.server --config run/config.yaml --external-env HOST:PORT   # bridge to an external sim

This module only translates gRPC to calls on ``VecEnv`` and ``RolloutWorker``.
"""

from __future__ import annotations

import threading

import numpy as np

from rlfleet import codec, rpc
from rlfleet.service import ServiceRuntime, common_args, exit_after, load_service_config, setup_process
from rlfleet.v1 import env_pb2, env_pb2_grpc, rollout_pb2, rollout_pb2_grpc, tensor_pb2
from services.env.rollout import RolloutWorker
from services.env.vec_env import VecEnv
from services.inference.client import make_policy_client
from services.learner.client import push_rollout


def _spec(shape, dtype, low, high) -> tensor_pb2.TensorSpec:
    return tensor_pb2.TensorSpec(dtype=codec.dtype_of(np.zeros((), dtype)), shape=list(shape), low=low, high=high)


def env_spec_proto(info, incarnation: str = "") -> env_pb2.EnvSpec:
    spec = env_pb2.EnvSpec(env_id=info.env_id, num_envs=info.num_envs, max_episode_steps=info.max_episode_steps,
                           task_descriptions=info.task_descriptions, auto_reset=info.auto_reset,
                           incarnation=incarnation)
    for k, (shape, dt, lo, hi) in info.obs_shapes.items():
        spec.observation_space[k].CopyFrom(_spec(shape, dt, lo, hi))
    spec.action_space.CopyFrom(_spec(info.action_shape, np.float32, info.action_low, info.action_high))
    return spec


class EnvServicer(env_pb2_grpc.EnvServiceServicer):
    def __init__(self, env: VecEnv, incarnation: str = ""):
        self.env, self.incarnation = env, incarnation

    @rpc.handler
    def Describe(self, request, context):
        return env_spec_proto(self.env.space_info(), self.incarnation)

    @rpc.handler
    def Reset(self, request, context):
        obs = self.env.reset(list(request.env_ids), list(request.seeds))
        return env_pb2.ResetResponse(observations=codec.encode_map(obs))

    @rpc.handler
    def Step(self, request_iterator, context):
        for req in request_iterator:
            actions = codec.decode(req.actions, "actions", dtype=np.float32)
            out = self.env.step(list(req.env_ids), actions)
            yield env_pb2.StepResponse(
                observations=codec.encode_map(out.obs), rewards=codec.encode(out.rewards),
                terminated=codec.encode(out.terminated), truncated=codec.encode(out.truncated),
                success=codec.encode(out.success), final_observations=codec.encode_map(out.final_obs),
                episodes=[codec.episode_to_proto(e) for e in out.episodes])

    @rpc.handler
    def Close(self, request, context):
        return env_pb2.CloseResponse()  # the server owns the envs' lifetime; closing happens at shutdown


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, worker: RolloutWorker, index: int, incarnation: str):
        self.worker, self.index, self.incarnation = worker, index, incarnation
        self.lock = threading.Lock()
        self._policy = None  # Act streams kept open across epochs: (addresses, stages) -> client
        self._policy_key = None

    def _policy_for(self, addresses: list[str], stages: int):
        key = (tuple(addresses), stages)
        if self._policy_key != key:
            self._drop_policy()
            self._policy = make_policy_client(list(addresses), stages, self.worker.action_dim)
            self._policy_key = key
        return self._policy

    def _drop_policy(self) -> None:
        if self._policy is not None:
            self._policy.close()
        self._policy = self._policy_key = None

    @rpc.handler
    def Collect(self, request, context):
        if request.num_steps < 1:
            raise rpc.InvalidRequest(f"num_steps: must be >= 1, got {request.num_steps}")
        with self.lock:
            policy = self._policy_for(list(request.inference_addresses), self.worker.num_stages)
            try:
                rollout, summary = self.worker.collect(request.epoch, request.num_steps, policy,
                                                       request.min_weights_version)
            except BaseException:
                self._drop_policy()  # streams may hold unanswered requests: start clean next time
                raise
            push_rollout(request.learner_address, rollout, request.epoch, self.index, self.incarnation)
        return rollout_pb2.CollectResponse(
            epoch=summary.epoch, env_steps=summary.env_steps,
            episodes=[codec.episode_to_proto(e) for e in summary.episodes], rollout_time_s=summary.rollout_time_s,
            env_time_s=summary.env_time_s, inference_wait_s=summary.inference_wait_s,
            weights_version=summary.weights_version)

    @rpc.handler
    def Describe(self, request, context):
        return env_spec_proto(self.worker.env.space_info(), self.incarnation)

    @rpc.handler
    def Evaluate(self, request, context):
        import time

        t0 = time.perf_counter()
        with self.lock:
            policy = self._policy_for(list(request.inference_addresses), self.worker.num_stages)
            try:
                episodes = self.worker.evaluate(
                    list(range(request.first_episode, request.first_episode + request.num_episodes)),
                    request.seed, request.deterministic, policy)
            except BaseException:
                self._drop_policy()
                raise
        return rollout_pb2.EvaluateResponse(episodes=[codec.episode_to_proto(e) for e in episodes],
                                            eval_time_s=time.perf_counter() - t0)


def build_worker(cfg, index: int, external_env: str | None = None) -> tuple[object, RolloutWorker]:
    """The env (built-in VecEnv, or an external EnvService) and the rollout worker in front of it."""
    n_servers = cfg.cluster.num_env_servers
    train, ev = cfg.env.train, cfg.env.eval
    per_server = train.total_num_envs // n_servers
    seed = train.seed + 10_000 * cfg.runner.seed + index * per_server
    if external_env:
        from services.env.remote import RemoteVecEnv

        env = RemoteVecEnv(external_env)
        if env.num_envs != per_server:
            raise SystemExit(f"config error: the external env at {external_env} hosts {env.num_envs} envs; "
                             f"env.train.total_num_envs / cluster.num_env_servers = {per_server}")
        eval_factory = lambda: env  # noqa: E731 - the external sim serves both
    else:
        env = VecEnv(train.env_id, per_server, max_episode_steps=train.max_episode_steps,
                     auto_reset=train.auto_reset, ignore_terminations=train.ignore_terminations,
                     init_params=dict(train.init_params), seed=seed)
        eval_factory = lambda: VecEnv(  # noqa: E731
            ev.env_id, ev.total_num_envs // n_servers, max_episode_steps=ev.max_episode_steps, auto_reset=False,
            init_params=dict(ev.init_params), seed=ev.seed)
    worker = RolloutWorker(env, cfg.rollout.pipeline_stage_num, auto_reset=train.auto_reset,
                           bootstrap_truncated=cfg.algorithm.bootstrap_truncated, eval_env_factory=eval_factory)
    return env, worker


def serve(cfg, address: str, index: int = 0, coordinator: str | None = None, external_env: str | None = None):
    env, worker = build_worker(cfg, index, external_env)
    server = rpc.make_server(max_workers=16)
    runtime = ServiceRuntime("env", index, server, "", coordinator, cfg.cluster.heartbeat_interval_s,
                             cfg.cluster.heartbeat_timeout_s)
    if not external_env:
        env_pb2_grpc.add_EnvServiceServicer_to_server(EnvServicer(env, runtime.incarnation), server)
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(worker, index, runtime.incarnation), server)
    runtime.address = rpc.bind(server, address)
    server.start()
    return server, runtime.address, worker, runtime


def main(argv=None) -> int:
    parser = common_args("rlfleet env server (envs + rollout worker)")
    parser.add_argument("--external-env", default=None,
                        help="address of an external EnvService to run the rollout worker in front of")
    args = parser.parse_args(argv)
    cfg = load_service_config(args)
    setup_process(args, cfg.cluster.torch_num_threads)
    server, bound, worker, runtime = serve(cfg, args.address, args.index, args.coordinator, args.external_env)
    code = runtime.serve_until_stopped(cfg, args)
    worker.close()
    return code


if __name__ == "__main__":
    exit_after(main)

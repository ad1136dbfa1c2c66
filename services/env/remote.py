"""RemoteVecEnv: the VecEnv interface over an external simulator's EnvService (gRPC).

A bridge process (``python -m services.env.server --external-env HOST:PORT``) runs the rollout worker in front of
any simulator that implements ``rlfleet.v1.EnvService``, in any language.
"""

from __future__ import annotations

import queue

import numpy as np

from rlfleet import codec, rpc
from rlfleet.rpc import InvalidRequest
from rlfleet.v1 import env_pb2, env_pb2_grpc
from services.env.vec_env import EpisodeStat, SpaceInfo, StepResult


class RemoteVecEnv:
    _END = object()

    def __init__(self, address: str, timeout: float = 60.0):
        self.address = address
        self.channel = rpc.wait_ready(address, timeout)
        self.stub = env_pb2_grpc.EnvServiceStub(self.channel)
        spec = self.stub.Describe(env_pb2.DescribeEnvRequest(), timeout=timeout)
        self.spec = spec
        self.env_id = spec.env_id
        self.num_envs = spec.num_envs
        self.max_episode_steps = spec.max_episode_steps
        self.obs_specs = dict(spec.observation_space)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = self.stub.Step(iter(self._requests.get, self._END))

    def space_info(self) -> SpaceInfo:
        s = self.spec
        obs = {k: (tuple(v.shape), codec.numpy_dtype(v.dtype), v.low, v.high) for k, v in s.observation_space.items()}
        return SpaceInfo(s.env_id, s.num_envs, obs, tuple(s.action_space.shape), s.action_space.low,
                         s.action_space.high, s.max_episode_steps, s.auto_reset, list(s.task_descriptions))

    def _obs(self, msg, n: int, name: str) -> dict[str, np.ndarray]:
        return codec.decode_map(msg, name, specs=self.obs_specs, batch=n, writable=True)

    def reset(self, env_ids=None, seeds=None) -> dict[str, np.ndarray]:
        ids = list(env_ids) if env_ids is not None else []
        resp = self.stub.Reset(env_pb2.ResetRequest(env_ids=ids, seeds=list(seeds or [])))
        return self._obs(resp.observations, len(ids) or self.num_envs, "observations")

    def step(self, env_ids, actions) -> StepResult:
        ids = [int(i) for i in env_ids]
        self._requests.put(env_pb2.StepRequest(env_ids=ids, actions=codec.encode(np.asarray(actions, np.float32))))
        resp = next(self._responses)
        n = len(ids) or self.num_envs
        try:
            out = StepResult(
                self._obs(resp.observations, n, "observations"),
                codec.decode(resp.rewards, "rewards", shape=[n], dtype=np.float32, finite=True),
                codec.decode(resp.terminated, "terminated", shape=[n], dtype=bool),
                codec.decode(resp.truncated, "truncated", shape=[n], dtype=bool),
                codec.decode(resp.success, "success", shape=[n], dtype=bool),
                self._obs(resp.final_observations, n, "final_observations"),
                [EpisodeStat(e.env_id, codec.episode_return(e), e.length, e.success_once, e.success_at_end)
                 for e in resp.episodes])
        except codec.CodecError as exc:
            raise InvalidRequest(f"external env {self.address} sent a bad StepResponse: {exc}") from exc
        return out

    def close(self) -> None:
        try:
            self.stub.Close(env_pb2.CloseRequest(), timeout=10)
        finally:
            self._requests.put(self._END)
            self.channel.close()

"""RemoteVecEnv: the VecEnv interface over an external simulator's EnvService (gRPC).

A bridge process (``python -m services.env.server --external-env HOST:PORT``) runs the rollout worker in front of
any simulator that implements ``rlfleet.v1.EnvService``, in any language. When the simulator dies, calls raise
``EnvConnectionLost``; ``reconnect`` then waits (with backoff, saying which address is down) until it is back.
"""

from __future__ import annotations

import queue
import sys
import time

import grpc
import numpy as np

from rlfleet import codec, rpc
from rlfleet.rpc import InvalidRequest
from rlfleet.spaces import TensorSpace, spaces_from_proto
from rlfleet.v1 import env_pb2, env_pb2_grpc
from services.env.vec_env import EpisodeStat, SpaceInfo, StepResult

LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED)


class EnvConnectionLost(RuntimeError):
    """The external simulator stopped answering (crashed, restarted, network); its episodes in flight are lost.
    ``env`` is the RemoteVecEnv that lost it (to reconnect)."""

    def __init__(self, message: str, env=None):
        super().__init__(message)
        self.env = env


class RemoteVecEnv:
    _END = object()

    def __init__(self, address: str, timeout: float = 60.0, call_timeout: float = 60.0):
        self.address = address
        self.call_timeout = call_timeout
        self.spec: env_pb2.EnvSpec | None = None
        self._responses = None
        self._connect(timeout)

    # --- connection -------------------------------------------------------------------------------------------
    def _connect(self, timeout: float) -> None:
        self.channel = rpc.wait_ready(self.address, timeout, credential=False)  # a simulator outside the run
        self.stub = env_pb2_grpc.EnvServiceStub(self.channel)
        spec = self.stub.Describe(env_pb2.DescribeEnvRequest(), timeout=timeout)
        if self.spec is not None:
            self._check_same(spec)
        self.spec = spec
        self.env_id = spec.env_id
        self.num_envs = spec.num_envs
        self.max_episode_steps = spec.max_episode_steps
        self.obs_specs = dict(spec.observation_space)
        self.action_space = TensorSpace.from_proto(spec.action_space)
        self._act_low = self.action_space.low.astype(np.float32)
        self._act_high = self.action_space.high.astype(np.float32)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = self.stub.Step(iter(self._requests.get, self._END))

    def _check_same(self, spec) -> None:
        old = self.spec
        if (spec.num_envs, dict(spec.observation_space), spec.action_space) != \
                (old.num_envs, dict(old.observation_space), old.action_space):
            raise InvalidRequest(f"external env {self.address} came back with different spaces or env count "
                                 f"({spec.num_envs} envs, was {old.num_envs}); restart the run")

    def _drop_stream(self) -> None:
        if self._responses is not None:
            self._requests.put(self._END)
            self._responses.cancel()
            self._responses = None
        self.channel.close()

    def reconnect(self, timeout: float, log=print) -> float:
        """Wait until the simulator answers again (backoff 0.5 s -> 5 s), up to ``timeout`` seconds; returns the
        seconds it was down. Raises EnvConnectionLost when it stays down."""
        self._drop_stream()
        t0 = time.monotonic()
        delay, last_say = 0.5, 0.0
        log(f"external env {self.address} is down; reconnecting (up to {timeout:.0f}s)", flush=True)
        while True:
            try:
                self._connect(min(2.0, max(0.5, timeout - (time.monotonic() - t0))))
                down = time.monotonic() - t0
                log(f"external env {self.address} is back after {down:.1f}s", flush=True)
                return down
            except (TimeoutError, grpc.RpcError) as exc:
                waited = time.monotonic() - t0
                if waited >= timeout:
                    raise EnvConnectionLost(f"external env {self.address} has been down for {waited:.0f}s "
                                            f"(cluster.external_env_reconnect_timeout_s={timeout:.0f}); last error: "
                                            f"{exc if isinstance(exc, TimeoutError) else rpc.describe_error(exc)}") from None
                if waited - last_say >= 5.0:
                    log(f"external env {self.address} is down ({waited:.0f}s); retrying until {timeout:.0f}s",
                        flush=True)
                    last_say = waited
                time.sleep(delay)
                delay = min(5.0, delay * 2)

    def _lost(self, exc: grpc.RpcError) -> EnvConnectionLost:
        return EnvConnectionLost(f"external env {self.address}: {rpc.describe_error(exc)}", self)

    # --- VecEnv interface -------------------------------------------------------------------------------------
    def space_info(self) -> SpaceInfo:
        s = self.spec
        return SpaceInfo(s.env_id, s.num_envs, spaces_from_proto(s.observation_space), self.action_space,
                         s.max_episode_steps, s.auto_reset, list(s.task_descriptions), int(s.num_reset_states),
                         max(1, s.max_action_chunk), s.simulator or "external", s.contract_version)

    def _obs(self, msg, n: int, name: str) -> dict[str, np.ndarray]:
        return codec.decode_map(msg, name, specs=self.obs_specs, batch=n, writable=True)

    def reset(self, env_ids=None, seeds=None, reset_state_ids=None) -> dict[str, np.ndarray]:
        ids = [int(i) for i in env_ids] if env_ids is not None else []
        try:
            resp = self.stub.Reset(env_pb2.ResetRequest(env_ids=ids, seeds=list(seeds or []),
                                                        reset_state_ids=list(reset_state_ids or [])),
                                   timeout=self.call_timeout)
        except grpc.RpcError as exc:
            if exc.code() in LOST_CODES:
                raise self._lost(exc) from exc
            raise
        if resp.instructions and self.spec is not None:
            descs = list(self.spec.task_descriptions) or [""] * self.num_envs
            for i, text in zip(ids or range(self.num_envs), resp.instructions):
                descs[i] = text
            del self.spec.task_descriptions[:]
            self.spec.task_descriptions.extend(descs)
        return self._obs(resp.observations, len(ids) or self.num_envs, "observations")

    def step(self, env_ids, actions) -> StepResult:
        ids = [int(i) for i in env_ids]
        actions = np.clip(np.asarray(actions, np.float32), self._act_low, self._act_high)  # the contract: in bounds
        self._requests.put(env_pb2.StepRequest(env_ids=ids, actions=codec.encode(actions)))
        try:
            resp = next(self._responses)
        except grpc.RpcError as exc:
            raise self._lost(exc) from exc
        except StopIteration:
            raise EnvConnectionLost(f"external env {self.address} closed the Step stream", self) from None
        n = len(ids) or self.num_envs
        per = [n] if actions.ndim == len(self.action_space.shape) + 1 else [n, actions.shape[1]]
        try:
            rows = [int(r) for r in resp.final_rows]
            if any(not 0 <= r < n for r in rows):
                raise codec.CodecError(f"final_rows: {rows} names rows outside 0..{n - 1}")
            out = StepResult(
                self._obs(resp.observations, n, "observations"),
                codec.decode(resp.rewards, "rewards", shape=per, dtype=np.float32, finite=True),
                codec.decode(resp.terminated, "terminated", shape=per, dtype=bool),
                codec.decode(resp.truncated, "truncated", shape=per, dtype=bool),
                codec.decode(resp.success, "success", shape=per, dtype=bool),
                self._obs(resp.final_observations, len(rows), "final_observations"), np.asarray(rows, np.int64),
                [EpisodeStat(e.env_id, codec.episode_return(e), e.length, e.success_once, e.success_at_end,
                             e.reset_state_id, e.instruction) for e in resp.episodes],
                list(resp.instructions) or [""] * n)
        except codec.CodecError as exc:
            raise InvalidRequest(f"external env {self.address} sent a bad StepResponse: {exc}") from exc
        return out

    def close(self) -> None:
        try:
            self.stub.Close(env_pb2.CloseRequest(), timeout=10)
        except grpc.RpcError as exc:
            print(f"external env {self.address}: Close failed: {rpc.describe_error(exc)}", file=sys.stderr)
        finally:
            self._drop_stream()

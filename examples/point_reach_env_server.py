"""A complete external simulator: rlfleet's EnvService implemented from scratch (numpy only, no rlfleet env code).

Any language works the same way: generate stubs from protos/rlfleet/v1/env.proto and serve Describe, Reset,
Step (bidi stream) and Close. Here: N point masses on a plane, each must reach its goal.

    python examples/point_reach_env_server.py --address 127.0.0.1:50100 --num-envs 16
    coordinatorctl start cluster.external_env_addresses=[127.0.0.1:50100] env.train.total_num_envs=16 \\
        env.eval.total_num_envs=16 env.train.max_episode_steps=30 env.eval.max_episode_steps=30

Observation 'state' (4): position, goal - position. Action (2): velocity in [-1, 1] (x 0.1 per step).
Reward: -|goal - position|; success: within 0.05 of the goal. Episodes end after --max-steps (truncation).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from concurrent import futures

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from rlfleet.v1 import env_pb2, env_pb2_grpc, tensor_pb2  # noqa: E402

F32, BOOL = tensor_pb2.FLOAT32, tensor_pb2.BOOL


def tensor(a: np.ndarray) -> tensor_pb2.Tensor:
    dtype = BOOL if a.dtype == bool else F32
    a = a.astype(bool if dtype == BOOL else np.float32)
    return tensor_pb2.Tensor(dtype=dtype, shape=list(a.shape), data=a.tobytes())


class PointReach(env_pb2_grpc.EnvServiceServicer):
    def __init__(self, num_envs: int, max_steps: int):
        self.n, self.max_steps = num_envs, max_steps
        self.rngs = [np.random.default_rng(i) for i in range(num_envs)]
        self.pos = np.zeros((num_envs, 2))
        self.goal = np.zeros((num_envs, 2))
        self.t = np.zeros(num_envs, int)
        self.ret = np.zeros(num_envs)
        self.hit = np.zeros(num_envs, bool)
        self.incarnation = uuid.uuid4().hex[:8]
        for i in range(num_envs):
            self._reset(i)

    def _reset(self, i, seed=None):
        if seed is not None:
            self.rngs[i] = np.random.default_rng(seed)
        self.pos[i], self.goal[i] = self.rngs[i].uniform(-1, 1, 2), self.rngs[i].uniform(-1, 1, 2)
        self.t[i], self.ret[i], self.hit[i] = 0, 0.0, False

    def _obs(self, ids):
        return tensor_pb2.TensorMap(tensors={"state": tensor(np.concatenate([self.pos[ids], self.goal[ids] - self.pos[ids]], 1))})

    def _ids(self, env_ids, context):
        ids = np.array(env_ids or range(self.n))
        if ids.size and (ids.min() < 0 or ids.max() >= self.n):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"env_ids: unknown env id (0..{self.n - 1})")
        return ids

    def Describe(self, request, context):
        spec = env_pb2.EnvSpec(env_id="PointReach-v0", num_envs=self.n, max_episode_steps=self.max_steps,
                               auto_reset=True, incarnation=self.incarnation, task_descriptions=["reach the goal"] * self.n)
        spec.observation_space["state"].CopyFrom(tensor_pb2.TensorSpec(dtype=F32, shape=[4], low=-4, high=4))
        spec.action_space.CopyFrom(tensor_pb2.TensorSpec(dtype=F32, shape=[2], low=-1, high=1))
        return spec

    def Reset(self, request, context):
        ids = self._ids(list(request.env_ids), context)
        for j, i in enumerate(ids):
            self._reset(i, request.seeds[j] if request.seeds else None)
        return env_pb2.ResetResponse(observations=self._obs(ids))

    def Step(self, request_iterator, context):
        for req in request_iterator:
            ids = self._ids(list(req.env_ids), context)
            if req.actions.dtype != F32 or list(req.actions.shape) != [len(ids), 2]:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"actions: expected FLOAT32 [{len(ids)}, 2]")
            act = np.frombuffer(req.actions.data, np.float32).reshape(len(ids), 2)
            if not np.isfinite(act).all():
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "actions: non-finite value")
            self.pos[ids] = np.clip(self.pos[ids] + 0.1 * np.clip(act, -1, 1), -2, 2)
            dist = np.linalg.norm(self.goal[ids] - self.pos[ids], axis=1)
            reward, success = -dist, dist < 0.05
            self.t[ids] += 1
            self.ret[ids] += reward
            self.hit[ids] |= success
            truncated = self.t[ids] >= self.max_steps
            final = self._obs(ids)
            episodes = []
            for j, i in enumerate(ids):
                if truncated[j]:
                    stats = tensor_pb2.EpisodeStats(env_id=int(i), length=int(self.t[i]), success_once=bool(self.hit[i]),
                                                    success_at_end=bool(success[j]))
                    setattr(stats, "return", float(self.ret[i]))
                    episodes.append(stats)
                    self._reset(i)
            yield env_pb2.StepResponse(observations=self._obs(ids), rewards=tensor(reward), terminated=tensor(np.zeros(len(ids), bool)),
                                       truncated=tensor(truncated), success=tensor(success), final_observations=final,
                                       episodes=episodes)

    def Close(self, request, context):
        return env_pb2.CloseResponse()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default="127.0.0.1:50100")
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument("--max-steps", type=int, default=30)
    args = ap.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    env_pb2_grpc.add_EnvServiceServicer_to_server(PointReach(args.num_envs, args.max_steps), server)
    port = server.add_insecure_port(args.address)
    server.start()
    print(f"PointReach-v0 EnvService on {args.address.rsplit(':', 1)[0]}:{port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()

"""A complete external simulator: rlfleet's EnvService (contract v1) written from scratch with numpy and the
generated stubs only, no rlfleet env code. docs/env-contract.md is the contract this follows.

Any language works the same way: generate stubs from protos/rlfleet/v1/env.proto and serve Describe, Reset,
Step (bidi stream) and Close. Here: N point masses on a plane, each must reach its goal.

    python examples/point_reach_env_server.py --address 127.0.0.1:50100 --num-envs 16
    coordinatorctl check-env 127.0.0.1:50100          # does it follow the contract?
    coordinatorctl start cluster.external_env_addresses=[127.0.0.1:50100] env.train.total_num_envs=16 \\
        env.eval.total_num_envs=16 env.train.max_episode_steps=30 env.eval.max_episode_steps=30 \\
        env.train.max_steps_per_rollout_epoch=32

Observation 'state' (4): position, goal - position. Action (2): velocity in [-1, 1] (x 0.1 per step); an action
chunk [n, chunk, 2] runs as `chunk` steps. Reward: -|goal - position|; success: within 0.05 of the goal.
Episodes end after --max-steps (truncation). 16 fixed initial states (position, goal) can be chosen by
reset_state_ids; each episode's instruction names its goal.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import uuid
from concurrent import futures

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from rlfleet.v1 import env_pb2, env_pb2_grpc, tensor_pb2  # noqa: E402

F32, BOOL = tensor_pb2.FLOAT32, tensor_pb2.BOOL
NUM_RESET_STATES = 16
MAX_ACTION_CHUNK = 8
MAX_STEP_STREAMS = 4


def tensor(a: np.ndarray) -> tensor_pb2.Tensor:
    dtype = BOOL if a.dtype == bool else F32
    a = np.ascontiguousarray(a.astype(bool if dtype == BOOL else np.float32))
    return tensor_pb2.Tensor(dtype=dtype, shape=list(a.shape), data=a.tobytes())


class BadRequest(Exception):
    """Answered with INVALID_ARGUMENT; the message names the bad field."""


class PointReach(env_pb2_grpc.EnvServiceServicer):
    def __init__(self, num_envs: int, max_steps: int):
        self.n, self.max_steps = num_envs, max_steps
        self.lock = threading.Lock()
        self.streams = threading.BoundedSemaphore(MAX_STEP_STREAMS)
        self.closed = False
        self.rngs = [np.random.default_rng(i) for i in range(num_envs)]
        self.pos = np.zeros((num_envs, 2))
        self.goal = np.zeros((num_envs, 2))
        self.t = np.zeros(num_envs, int)
        self.ret = np.zeros(num_envs)
        self.hit = np.zeros(num_envs, bool)
        self.state_id = np.full(num_envs, -1)
        self.incarnation = uuid.uuid4().hex[:8]
        for i in range(num_envs):
            self._reset(i, seed=i, state=-1)

    # --- simulation --------------------------------------------------------------------------------------------
    def _reset(self, i: int, seed: int | None, state: int) -> None:
        if seed is not None:
            self.rngs[i] = np.random.default_rng(seed)
        if state >= 0:  # a fixed initial state: the same start whatever the seed
            fixed = np.random.default_rng(1_000_000 + state)
            self.pos[i], self.goal[i] = fixed.uniform(-1, 1, 2), fixed.uniform(-1, 1, 2)
        else:
            self.pos[i], self.goal[i] = self.rngs[i].uniform(-1, 1, 2), self.rngs[i].uniform(-1, 1, 2)
        self.t[i], self.ret[i], self.hit[i], self.state_id[i] = 0, 0.0, False, state

    def _instruction(self, i: int) -> str:
        return f"move to ({self.goal[i, 0]:.2f}, {self.goal[i, 1]:.2f})"

    def _obs(self, ids) -> np.ndarray:
        return np.concatenate([self.pos[ids], self.goal[ids] - self.pos[ids]], 1)

    # --- validation ----------------------------------------------------------------------------------------------
    def _ids(self, env_ids) -> np.ndarray:
        ids = np.array(list(env_ids) or range(self.n), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n):
            raise BadRequest(
                f"env_ids: unknown env id {int(ids[(ids < 0) | (ids >= self.n)][0])} "
                f"(this server hosts 0..{self.n - 1})"
            )
        if len(set(ids.tolist())) != ids.size:
            raise BadRequest(f"env_ids: duplicate ids in {ids.tolist()}")
        return ids

    def _actions(self, msg, n: int) -> np.ndarray:
        """-> actions [n, chunk, 2], clipped to the action bounds."""
        shape = list(msg.shape)
        if msg.dtype != F32:
            raise BadRequest(f"actions: dtype {tensor_pb2.DType.Name(msg.dtype)} where FLOAT32 was expected")
        if shape not in ([n, 2],) and not (len(shape) == 3 and shape[0] == n and shape[2] == 2):
            raise BadRequest(f"actions: shape {shape} where [{n}, 2] or [{n}, chunk, 2] was expected")
        if len(msg.data) != 4 * int(np.prod(shape)):
            raise BadRequest(f"actions: {len(msg.data)} data bytes for shape {shape}")
        act = np.frombuffer(msg.data, np.float32).reshape(shape)
        act = act[:, None] if act.ndim == 2 else act
        if not 1 <= act.shape[1] <= MAX_ACTION_CHUNK:
            raise BadRequest(f"actions: chunk of {act.shape[1]} sub-steps; this server accepts 1..{MAX_ACTION_CHUNK}")
        if not np.isfinite(act).all():
            raise BadRequest("actions: non-finite value")
        return np.clip(act, -1.0, 1.0)

    # --- RPCs (one method each) ------------------------------------------------------------------------------
    def Describe(self, request, context):
        with self.lock:
            spec = env_pb2.EnvSpec(
                env_id="PointReach-v0",
                num_envs=self.n,
                max_episode_steps=self.max_steps,
                auto_reset=True,
                incarnation=self.incarnation,
                contract_version="1",
                num_reset_states=NUM_RESET_STATES,
                max_action_chunk=MAX_ACTION_CHUNK,
                max_step_streams=MAX_STEP_STREAMS,
                simulator="point-reach",
                task_descriptions=[self._instruction(i) for i in range(self.n)],
            )
        # per-element bounds: positions stay in [-2, 2], goal - position in [-3, 3]
        spec.observation_space["state"].CopyFrom(
            tensor_pb2.TensorSpec(
                dtype=F32, shape=[4], low=-3, high=3, low_per_element=[-2, -2, -3, -3], high_per_element=[2, 2, 3, 3]
            )
        )
        spec.action_space.CopyFrom(tensor_pb2.TensorSpec(dtype=F32, shape=[2], low=-1, high=1))
        return spec

    def Reset(self, request, context):
        with self.lock:
            try:
                self._check_open(context)
                ids = self._ids(request.env_ids)
                seeds, states = list(request.seeds), list(request.reset_state_ids)
                if seeds and len(seeds) != len(ids):
                    raise BadRequest(f"seeds: {len(seeds)} seeds for {len(ids)} envs")
                if states and len(states) != len(ids):
                    raise BadRequest(f"reset_state_ids: {len(states)} ids for {len(ids)} envs")
                bad = [s for s in states if s != -1 and not 0 <= s < NUM_RESET_STATES]
                if bad:
                    raise BadRequest(f"reset_state_ids: state id {bad[0]} is not in [0, {NUM_RESET_STATES})")
            except BadRequest as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            for j, i in enumerate(ids):
                self._reset(i, seeds[j] if seeds else None, states[j] if states else -1)
            return env_pb2.ResetResponse(
                observations=tensor_pb2.TensorMap(tensors={"state": tensor(self._obs(ids))}),
                instructions=[self._instruction(i) for i in ids],
            )

    def Step(self, request_iterator, context):
        if not self.streams.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this server accepts {MAX_STEP_STREAMS} concurrent Step streams; close one first",
            )
        # optional test hook: `check-env` asks for a simulated simulator failure with this metadata
        crash = ("rlfleet-fault", "simulator-crash") in [tuple(m) for m in context.invocation_metadata()]
        try:
            for req in request_iterator:
                with self.lock:
                    try:
                        self._check_open(context)
                        ids = self._ids(req.env_ids)
                        act = self._actions(req.actions, len(ids))
                    except BadRequest as exc:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    if crash:  # what a crash in physics answers: INTERNAL saying what failed; the server goes on
                        context.abort(
                            grpc.StatusCode.INTERNAL,
                            f"physics step of envs {ids.tolist()} failed (simulated on request: rlfleet-fault)",
                        )
                    yield self._step(ids, act, chunked=len(req.actions.shape) == 3)
        finally:
            self.streams.release()

    def Close(self, request, context):
        with self.lock:
            self.closed = True  # nothing to release here; later Reset/Step get FAILED_PRECONDITION
        return env_pb2.CloseResponse()

    def _check_open(self, context) -> None:
        if self.closed:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the envs were closed (Close); no more Reset or Step")

    def _step(self, ids: np.ndarray, act: np.ndarray, chunked: bool) -> env_pb2.StepResponse:
        n, chunk = act.shape[:2]
        reward, success = np.zeros((n, chunk), np.float32), np.zeros((n, chunk), bool)
        truncated = np.zeros((n, chunk), bool)
        ended = np.zeros(n, bool)
        final_rows, final_obs, episodes = [], [], []
        for c in range(chunk):
            for j, i in enumerate(ids):
                if ended[j]:
                    continue  # the episode ended at an earlier sub-step: the rest of the chunk is not executed
                self.pos[i] = np.clip(self.pos[i] + 0.1 * act[j, c], -2, 2)
                dist = float(np.linalg.norm(self.goal[i] - self.pos[i]))
                reward[j, c], success[j, c] = -dist, dist < 0.05
                self.t[i] += 1
                self.ret[i] += -dist
                self.hit[i] |= success[j, c]
                if self.t[i] >= self.max_steps:
                    truncated[j, c] = ended[j] = True
                    final_rows.append(j)
                    final_obs.append(self._obs([i])[0])
                    stats = tensor_pb2.EpisodeStats(
                        env_id=int(i),
                        length=int(self.t[i]),
                        success_once=bool(self.hit[i]),
                        success_at_end=bool(success[j, c]),
                        reset_state_id=int(self.state_id[i]),
                        instruction=self._instruction(i),
                    )
                    setattr(stats, "return", float(self.ret[i]))
                    episodes.append(stats)
        order = np.argsort(final_rows, kind="stable")
        final_rows = [final_rows[k] for k in order]
        final = np.stack([final_obs[k] for k in order]) if final_rows else np.zeros((0, 4), np.float32)
        for j in final_rows:  # auto-reset: the returned observation starts the next episode
            self._reset(ids[j], None, -1)
        if not chunked:
            reward, truncated, success = reward[:, 0], truncated[:, 0], success[:, 0]
        return env_pb2.StepResponse(
            observations=tensor_pb2.TensorMap(tensors={"state": tensor(self._obs(ids))}),
            rewards=tensor(reward),
            terminated=tensor(np.zeros_like(truncated)),
            truncated=tensor(truncated),
            success=tensor(success),
            final_observations=tensor_pb2.TensorMap(tensors={"state": tensor(final)}),
            final_rows=final_rows,
            episodes=episodes,
            instructions=[self._instruction(i) for i in ids],
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default="127.0.0.1:50100")
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument("--max-steps", type=int, default=30)
    args = ap.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_STEP_STREAMS + 4))
    env_pb2_grpc.add_EnvServiceServicer_to_server(PointReach(args.num_envs, args.max_steps), server)
    port = server.add_insecure_port(args.address)
    server.start()
    print(f"PointReach-v0 EnvService on {args.address.rsplit(':', 1)[0]}:{port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()

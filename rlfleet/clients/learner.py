"""Client side of the learner's PushRollout: a worker's rollout as a stream of time-sliced chunks."""

from __future__ import annotations

from collections.abc import Iterator

from rlfleet import codec, rpc
from rlfleet.v1 import learner_pb2, learner_pb2_grpc

CHUNK_BYTES = 4 << 20


def rollout_chunks(rollout, epoch: int, worker_index: int, incarnation: str,
                   chunk_bytes: int = CHUNK_BYTES) -> Iterator[learner_pb2.RolloutChunk]:
    T = next(iter(rollout.time_major.values())).shape[0]
    per_step = sum(v[0].nbytes for v in rollout.time_major.values())
    step = max(1, chunk_bytes // max(per_step, 1))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        last = t1 == T
        chunk = learner_pb2.RolloutChunk(epoch=epoch, worker_index=worker_index, worker_incarnation=incarnation,
                                         t_start=t0, num_steps=T, last=last)
        codec.encode_map({k: v[t0:t1] for k, v in rollout.time_major.items()}, chunk.data)
        if last:
            codec.encode_map(rollout.per_env, chunk.data)
            chunk.episodes.extend(codec.episode_to_proto(e) for e in rollout.episodes)
        yield chunk


def push_rollout(address: str, rollout, epoch: int, worker_index: int, incarnation: str,
                 timeout: float = 300.0) -> learner_pb2.PushRolloutResponse:
    with rpc.channel(address) as ch:
        stub = learner_pb2_grpc.LearnerServiceStub(ch)
        return stub.PushRollout(rollout_chunks(rollout, epoch, worker_index, incarnation), timeout=timeout,
                                wait_for_ready=True)

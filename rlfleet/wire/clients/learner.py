"""Client side of the learner's PushRollout: a worker's rollout as a stream of time-sliced chunks."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

from rlfleet.wire import codec, rpc
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


CONNECT_TIMEOUT_S = 10.0  # a learner that accepts no connection within this long is unreachable
MAX_CHANNELS = 4  # learner channels kept open across epochs (one per address; the least recently used closes)
_channels: OrderedDict = OrderedDict()
_channels_lock = threading.Lock()


def _channel(address: str):
    """A channel to the learner at ``address``, kept across epochs: a connected one costs nothing to check."""
    with _channels_lock:
        ch = _channels.pop(address, None) or rpc.channel(address)
        _channels[address] = ch
        while len(_channels) > MAX_CHANNELS:
            _channels.popitem(last=False)[1].close()
        return ch


def _drop_channel(address: str) -> None:
    with _channels_lock:
        ch = _channels.pop(address, None)
    if ch is not None:
        ch.close()


def learner_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise rpc.Unavailable naming ``address`` when no learner accepts a connection there within ``timeout``
    (checked before a rollout is collected for it, so that an unreachable learner costs seconds, not a rollout)."""
    import grpc

    try:
        grpc.channel_ready_future(_channel(address)).result(timeout=max(timeout, 0.0))
    except grpc.FutureTimeoutError:
        _drop_channel(address)
        raise rpc.Unavailable(f"learner_address: no learner answered at {address} within {timeout:.0f}s "
                              f"(unreachable)") from None


def push_rollout(address: str, rollout, epoch: int, worker_index: int, incarnation: str,
                 timeout: float = 300.0) -> learner_pb2.PushRolloutResponse:
    """Stream a rollout to the learner within ``timeout`` seconds. The learner's refusal or absence comes back as
    the matching rlfleet.wire.rpc error, naming the learner's address and carrying its message: INVALID_ARGUMENT,
    FAILED_PRECONDITION and RESOURCE_EXHAUSTED as the learner said them, a deadline as Cancelled, anything
    else (unreachable, a learner failure) as Unavailable."""
    import grpc

    stub = learner_pb2_grpc.LearnerServiceStub(_channel(address))
    try:
        return stub.PushRollout(rollout_chunks(rollout, epoch, worker_index, incarnation),
                                timeout=max(timeout, 0.001), wait_for_ready=True)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        why = f"the learner at {address} did not take the rollout of epoch {epoch}: {rpc.describe_error(exc)}"
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise rpc.InvalidRequest(why) from None
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            raise rpc.FailedPrecondition(why) from None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise rpc.ResourceExhausted(why) from None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise rpc.Cancelled(f"{why} (the caller's deadline, or {timeout:.0f}s, passed)") from None
        raise rpc.Unavailable(why) from None

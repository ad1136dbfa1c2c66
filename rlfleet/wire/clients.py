"""Each service's client, in shared code: the env side (rollout worker) talks to inference and learner through
this module, so the env side depends on ``rlfleet`` only, never on another service's package. The learner's
PushRollout stream and the policy clients (gRPC or in-process, one factory); the addresses a request names are
checked by rlfleet.wire.addresses."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
from opentelemetry import propagate

from rlfleet.errors import Cancelled, FailedPrecondition, InvalidRequest, ResourceExhausted, Unavailable
from rlfleet.v1 import inference_pb2, inference_pb2_grpc, learner_pb2, learner_pb2_grpc
from rlfleet.wire import channels, codec, shm, status, tracing
from rlfleet.wire.codec import PolicyOutput


# --- The wire's share of a call, and the shared-memory handshake --------------------------------------------------------
@dataclass
class WireStats:
    """What a path's messages cost the process that sends them: CPU seconds building and serialising them (and
    parsing and decoding the answers, for Act), bytes of serialised messages, bytes handed over in shared memory."""

    seconds: float = 0.0
    bytes: int = 0
    shm_bytes: int = 0

    def __add__(self, other: WireStats) -> WireStats:
        return WireStats(self.seconds + other.seconds, self.bytes + other.bytes, self.shm_bytes + other.shm_bytes)

    def __sub__(self, other: WireStats) -> WireStats:
        return WireStats(self.seconds - other.seconds, self.bytes - other.bytes, self.shm_bytes - other.shm_bytes)


def offer_shared_memory(method, timeout: float) -> tuple[bool, str]:
    """Offer shared memory to a server through its ``SharedMemory`` method (a stub's callable): -> (accepted, why
    not). A server that predates it (UNIMPLEMENTED), or any failure, means inline bytes."""
    why = shm.unavailable()
    if why:
        return False, why
    try:
        with shm.offer() as offer:
            answer = method(offer, timeout=max(timeout, 0.001))
    except grpc.RpcError as exc:
        return False, channels.describe_error(exc)
    except OSError as exc:  # no memfd here after all
        return False, str(exc)
    return answer.accepted, answer.reason


def timed_messages(stats: WireStats, messages: Iterator, shared=lambda m: 0) -> Iterator[bytes]:
    """``messages`` serialised, the time to build and serialise each one and their bytes added to ``stats``."""
    while True:
        t0 = time.perf_counter()
        msg = next(messages, None)
        if msg is None:
            return
        data = msg.SerializeToString()
        stats.seconds += time.perf_counter() - t0
        stats.bytes += len(data)
        stats.shm_bytes += shared(msg)
        yield data


# --- Client side of the learner's PushRollout: a worker's rollout as a stream of time-sliced chunks (was clients/learner.py)
CHUNK_BYTES = 4 << 20


def rollout_chunks(
    rollout, epoch: int, worker_index: int, incarnation: str, chunk_bytes: int = CHUNK_BYTES, *, arena=None
) -> Iterator[learner_pb2.RolloutChunk]:
    """The rollout's chunks; with ``arena`` (a learner that accepted shared memory) one chunk of handles."""
    T = next(iter(rollout.time_major.values())).shape[0]
    if arena is not None:
        chunk = learner_pb2.RolloutChunk(
            epoch=epoch, worker_index=worker_index, worker_incarnation=incarnation, t_start=0, num_steps=T, last=True
        )
        codec.encode_map({**rollout.time_major, **rollout.tail}, chunk.data, arena=arena)
        chunk.episodes.extend(codec.episode_to_proto(e) for e in rollout.episodes)
        yield chunk
        return
    per_step = sum(v[0].nbytes for v in rollout.time_major.values())
    step = max(1, chunk_bytes // max(per_step, 1))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        last = t1 == T
        chunk = learner_pb2.RolloutChunk(
            epoch=epoch, worker_index=worker_index, worker_incarnation=incarnation, t_start=t0, num_steps=T, last=last
        )
        codec.encode_map({k: v[t0:t1] for k, v in rollout.time_major.items()}, chunk.data)
        if last:
            codec.encode_map(rollout.tail, chunk.data)
            chunk.episodes.extend(codec.episode_to_proto(e) for e in rollout.episodes)
        yield chunk


CONNECT_TIMEOUT_S = 10.0  # a learner that accepts no connection within this long is unreachable
MAX_CHANNELS = 4  # learner channels kept open across epochs (one per address; the least recently used closes)
_channels: OrderedDict = OrderedDict()
_channels_lock = threading.Lock()
# learner addresses that accepted this process's shared memory (learner_takes_shared_memory)
_takes_shm: set[str] = set()


def _channel(address: str):
    """A channel to the learner at ``address``, kept across epochs: a connected one costs nothing to check."""
    with _channels_lock:
        ch = _channels.pop(address, None) or channels.channel(address)
        _channels[address] = ch
        while len(_channels) > MAX_CHANNELS:
            _channels.popitem(last=False)[1].close()
        return ch


def _drop_channel(address: str) -> None:
    with _channels_lock:
        ch = _channels.pop(address, None)
        _takes_shm.discard(address)
    if ch is not None:
        ch.close()


def learner_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise Unavailable naming ``address`` when no learner accepts a connection there within ``timeout``
    (checked before a rollout is collected for it, so that an unreachable learner costs seconds, not a rollout)."""
    import grpc

    try:
        grpc.channel_ready_future(_channel(address)).result(timeout=max(timeout, 0.0))
    except grpc.FutureTimeoutError:
        _drop_channel(address)
        raise Unavailable(
            f"learner_address: no learner answered at {address} within {timeout:.0f}s (unreachable)"
        ) from None


def learner_takes_shared_memory(address: str, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether the learner at ``address`` reads this process's shared memory (``offer_shared_memory``). A yes is
    kept for the next pushes (a learner on this host, in this pid namespace, as this uid, stays one) until a push to
    that address fails or its channel is dropped; a no is asked again each time. Asked at every push, the offer's
    round trip and probe segment took ~2.7 ms of each push, after the rollout: on the epoch's critical path."""
    with _channels_lock:
        if address in _takes_shm:
            return True
    stub = learner_pb2_grpc.LearnerServiceStub(_channel(address))
    ok = offer_shared_memory(stub.SharedMemory, min(timeout, CONNECT_TIMEOUT_S))[0]
    if ok:
        with _channels_lock:
            _takes_shm.add(address)
    return ok


def push_rollout(
    address: str,
    rollout,
    epoch: int,
    worker_index: int,
    incarnation: str,
    timeout: float = 300.0,
    *,
    arena=None,
    stats: WireStats | None = None,
) -> learner_pb2.PushRolloutResponse:
    """Stream a rollout to the learner within ``timeout`` seconds. The learner's refusal or absence comes back as
    the matching rlfleet.errors error, naming the learner's address and carrying its message: INVALID_ARGUMENT,
    FAILED_PRECONDITION and RESOURCE_EXHAUSTED as the learner said them, a deadline as Cancelled, anything
    else (unreachable, a learner failure) as Unavailable.

    ``arena`` (an ``rlfleet.wire.shm.Arena`` of this process): offered to the learner first
    (``learner_takes_shared_memory``); when it accepts, the rollout's tensors go by shared-memory handle (those in
    the arena's buffers without a copy) and the arena is released when the call ends. A push refused as invalid
    (INVALID_ARGUMENT) after a yes kept from an earlier push is offered again and sent once more: another learner
    may answer at that address now (one without shared memory: the rollout goes inline). ``stats`` (a WireStats)
    gets the push's serialisation time and bytes."""
    ch = _channel(address)
    stats = stats if stats is not None else WireStats()
    push = ch.stream_unary(
        "/rlfleet.v1.LearnerService/PushRollout",
        request_serializer=None,
        response_deserializer=learner_pb2.PushRolloutResponse.FromString,
    )
    deadline = time.monotonic() + timeout
    for attempt in range(2):
        with _channels_lock:
            kept = address in _takes_shm  # a yes an earlier push got, not asked now
        use = arena if arena is not None and learner_takes_shared_memory(address, timeout) else None
        chunks = rollout_chunks(rollout, epoch, worker_index, incarnation, arena=use)
        try:
            return push(
                timed_messages(stats, chunks, lambda c: codec.shared_bytes(c.data)),
                timeout=max(deadline - time.monotonic(), 0.001),
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            with _channels_lock:
                _takes_shm.discard(address)  # the next push asks again
            kind = status.error_type(exc.code() if hasattr(exc, "code") else None)
            if attempt == 0 and kept and use is not None and kind is InvalidRequest:
                continue  # the kept yes no longer holds (another learner at this address): asked again, pushed again
            why = f"the learner at {address} did not take the rollout of epoch {epoch}: {channels.describe_error(exc)}"
            if kind is Cancelled:
                why += f" (the caller's deadline, or {timeout:.0f}s, passed)"
            elif kind not in (InvalidRequest, FailedPrecondition, ResourceExhausted):
                kind = Unavailable  # unreachable, a learner failure
            raise kind(why) from None
        finally:
            if arena is not None:
                arena.release()  # the learner has copied what it keeps, or the call is over
    raise AssertionError("unreachable: the second attempt returns or raises")


# --- Policy clients used by the rollout worker: the same interface over gRPC or in-process (was clients/policy.py)
class PolicyError(Unavailable):
    """The inference side failed, could not be reached, or returned something unusable (a server answers the
    caller whose request needed it with UNAVAILABLE, naming the inference server's address)."""


CONNECT_TIMEOUT_S = 10.0  # an inference server that accepts no connection within this long is unreachable


def _check_result(res: PolicyOutput, n: int, action_dim: int | None) -> PolicyOutput:
    if res.actions.ndim != 3 or res.actions.shape[0] != n:
        raise PolicyError(
            f"inference returned actions shaped {list(res.actions.shape)} for {n} observations "
            f"([n, chunk, action_dim] expected)"
        )
    if action_dim is not None and res.actions.shape[2] != action_dim:
        raise PolicyError(
            f"inference returned actions shaped {list(res.actions.shape)}, the env takes [{n}, chunk, {action_dim}]"
        )
    if res.log_probs.ndim != 2 or res.log_probs.shape[0] != n:
        raise PolicyError(f"inference returned log_probs shaped {list(res.log_probs.shape)} for {n} rows")
    if res.values is not None and res.values.shape != (n,):
        raise PolicyError(f"inference returned values shaped {list(res.values.shape)} for {n} rows")
    for name, arr in (("actions", res.actions), ("log_probs", res.log_probs), ("values", res.values)):
        if arr is not None and not np.isfinite(arr).all():
            raise PolicyError(f"inference returned non-finite {name} (weights version {res.weights_version})")
    for name, arr in res.forward_inputs.items():
        if arr.shape[:1] != (n,):
            raise PolicyError(f"inference returned forward_inputs['{name}'] shaped {list(arr.shape)} for {n} rows")
    return res


class _Stream:
    """One Act bidi stream: requests go through a queue, responses come back in order.

    A reader thread moves responses into a queue so that ``result`` can wait with a deadline: an inference
    server that is unreachable or stops answering costs ``timeout`` seconds and a PolicyError naming it, never a
    wedged env server. The reader takes no more responses than requests were sent: one nobody asked for (a stream
    that never ends) ends the stream with a PolicyError, instead of queueing without bound. When tracing is set
    up, each request carries the asking rollout's trace context (the inference server's act batch links to it).
    """

    _END = object()

    def __init__(self, address: str, timeout: float, shared_memory: bool = True):
        self.address = address
        self.timeout = timeout
        self.channel = channels.channel(address)
        self.traced = tracing.enabled()
        connect = min(timeout, CONNECT_TIMEOUT_S)
        try:  # an unreachable address fails now, naming it, not after a whole act timeout per stage
            grpc.channel_ready_future(self.channel).result(timeout=connect)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise PolicyError(
                f"inference server {address} did not answer within {connect:.0f}s (unreachable; no connection)"
            ) from None
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        # observations by shared-memory handle when the server is on this host and reads this process's segments
        self.arena = None
        self.shared_memory_why = "not offered"
        if shared_memory:
            ok, self.shared_memory_why = offer_shared_memory(self.stub.SharedMemory, connect)
            self.arena = shm.Arena("act", slots=2) if ok else None
        self.wire = WireStats()  # requests built and serialised, replies decoded (this stream's caller's thread)
        self.parse_s = 0.0  # replies parsed (the reader thread)
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        act = self.channel.stream_stream(
            "/rlfleet.v1.InferenceService/Act", request_serializer=None, response_deserializer=self._parse
        )
        self.responses = act(iter(self.requests.get, self._END), wait_for_ready=True)
        if self.arena is not None:  # a request waiting for a segment gives up with the stream, or after the timeout
            self.arena.abandon, self.arena.timeout = self.responses.done, timeout
        self.received: queue.SimpleQueue = queue.SimpleQueue()
        self.ids = itertools.count()
        self.inflight: list[tuple[int, int]] = []
        self.sent = 0  # requests sent (counted before each is queued, so an answer never precedes its count)
        threading.Thread(target=self._read, name=f"act-{address}", daemon=True).start()

    def _parse(self, data: bytes) -> inference_pb2.ActResponse:
        t0 = time.perf_counter()
        msg = inference_pb2.ActResponse.FromString(data)
        self.parse_s += time.perf_counter() - t0
        return msg

    def stats(self) -> WireStats:
        return WireStats(self.wire.seconds + self.parse_s, self.wire.bytes, self.wire.shm_bytes)

    def _read(self) -> None:
        got = 0
        try:
            for resp in self.responses:
                got += 1
                if got > self.sent:
                    self.received.put(
                        PolicyError(
                            f"inference server {self.address} sent Act response {got} for "
                            f"{self.sent} requests (one response per request)"
                        )
                    )
                    self.responses.cancel()
                    return
                self.received.put(resp)
            self.received.put(PolicyError(f"inference server {self.address} closed the Act stream"))
        except grpc.RpcError as exc:
            self.received.put(PolicyError(f"inference server {self.address}: {channels.describe_error(exc)}"))

    def submit(self, obs: dict[str, np.ndarray], deterministic: bool, instructions=None, noise_keys=None) -> None:
        rid = next(self.ids)
        trace_context: dict[str, str] = {}
        if self.traced:
            propagate.inject(trace_context)
        t0 = time.perf_counter()
        try:
            req = inference_pb2.ActRequest(
                request_id=rid,
                observations=codec.encode_map(obs, arena=self.arena),
                deterministic=deterministic,
                instructions=list(instructions or []),
                trace_context=trace_context,
                noise_keys=[] if noise_keys is None else np.asarray(noise_keys, np.uint64).tolist(),
            )
        except shm.Abandoned as exc:  # the server took neither of the last two requests' observations
            raise PolicyError(f"inference server {self.address}: {exc}") from None
        data = req.SerializeToString()
        self.wire.seconds += time.perf_counter() - t0
        self.wire.bytes += len(data)
        self.wire.shm_bytes += codec.shared_bytes(req.observations)
        self.sent += 1
        self.requests.put(data)
        self.inflight.append((rid, next(iter(obs.values())).shape[0]))

    def result(self, action_dim: int | None) -> PolicyOutput:
        rid, n = self.inflight.pop(0)
        try:
            resp = self.received.get(timeout=self.timeout)
        except queue.Empty:
            self.responses.cancel()
            raise PolicyError(
                f"inference server {self.address} did not answer within {self.timeout:.0f}s "
                f"(unreachable or stuck; cluster.act_timeout_s)"
            ) from None
        if isinstance(resp, PolicyError):
            raise resp
        if resp.request_id != rid:
            raise PolicyError(f"inference server {self.address} answered request {resp.request_id}, expected {rid}")
        if self.arena is not None and not self.inflight:  # answered: the server is done with every request's segment
            self.arena.release()
        t0 = time.perf_counter()
        try:
            res = PolicyOutput(
                codec.decode(resp.actions, "actions", dtype=np.float32),
                codec.decode(resp.log_probs, "log_probs", dtype=np.float32),
                codec.decode(resp.values, "values", dtype=np.float32) if resp.HasField("values") else None,
                codec.decode_map(resp.forward_inputs, "forward_inputs"),
                resp.weights_version,
            )
        except codec.CodecError as exc:
            raise PolicyError(f"inference server {self.address}: {exc}") from exc
        finally:
            self.wire.seconds += time.perf_counter() - t0
        return _check_result(res, n, action_dim)

    def close(self) -> None:
        self.requests.put(self._END)
        self.responses.cancel()
        self.channel.close()
        if self.arena is not None:
            self.arena.close()


class GrpcPolicyClient:
    """Stage s talks to inference server s % len(addresses) over its own stream."""

    def __init__(
        self,
        addresses: list[str],
        num_stages: int,
        action_dim: int | None = None,
        timeout: float = 120.0,
        shared_memory: bool = True,
    ):
        if not addresses:
            raise PolicyError("no inference server address given")
        self.action_dim = action_dim
        self.streams: list[_Stream] = []
        try:
            for s in range(num_stages):
                self.streams.append(_Stream(addresses[s % len(addresses)], timeout, shared_memory))
        except BaseException:
            self.close()
            raise

    def wire_stats(self) -> WireStats:
        """The Act streams' wire cost so far (all stages)."""
        return sum((s.stats() for s in self.streams), WireStats())

    def submit(
        self, stage: int, obs: dict[str, np.ndarray], deterministic: bool = False, instructions=None, noise_keys=None
    ) -> None:
        self.streams[stage].submit(obs, deterministic, instructions, noise_keys)

    def result(self, stage: int) -> PolicyOutput:
        return self.streams[stage].result(self.action_dim)

    def close(self) -> None:
        for s in self.streams:
            s.close()


class LocalPolicyClient:
    """Same interface, calling an InferenceEngine in this process (no transport)."""

    def __init__(self, engine, num_stages: int, action_dim: int | None = None):
        self.engine = engine
        self.action_dim = action_dim
        self.pending: list[list] = [[] for _ in range(num_stages)]
        self.lock = threading.Lock()

    def submit(
        self, stage: int, obs: dict[str, np.ndarray], deterministic: bool = False, instructions=None, noise_keys=None
    ) -> None:
        self.pending[stage].append((obs, deterministic, instructions, noise_keys))

    def wire_stats(self) -> WireStats:
        return WireStats()  # no wire

    def result(self, stage: int) -> PolicyOutput:
        obs, deterministic, instructions, noise_keys = self.pending[stage].pop(0)
        n = next(iter(obs.values())).shape[0]
        return _check_result(self.engine.act_now(obs, deterministic, instructions, noise_keys), n, self.action_dim)

    def close(self) -> None:
        pass


def make_policy_client(
    target, num_stages: int, action_dim: int | None = None, timeout: float = 120.0, shared_memory: bool = True
):
    """target: a list of inference addresses (gRPC; ``shared_memory``: observations by shared-memory handle to a
    server on this host that accepts them) or an InferenceEngine (in-process)."""
    if isinstance(target, (list, tuple)):
        return GrpcPolicyClient(list(target), num_stages, action_dim, timeout, shared_memory)
    return LocalPolicyClient(target, num_stages, action_dim)

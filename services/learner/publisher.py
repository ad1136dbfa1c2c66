"""Weights from the learner to every inference server, bucket by bucket.

The learner's ranks gather the (sharded) parameters a bucket at a time (``actor.weights_bucket_mb``); rank 0 hands
each gathered bucket to one ``UpdateWeights`` stream per inference server, all in parallel, and gathers the next
bucket only once every stream has taken the previous one: rank 0 holds its shards plus about one bucket, never the
whole model twice. A server that holds a full set from this learner (``synced``) gets only the tensors that change
in training (LoRA: the adapters and the value head); any other gets the full set with the spaces. A partial update
that a server refuses (it restarted) is sent again in full, in a second pass.

A server on this host that accepts shared memory (its ``SharedMemory`` handshake, asked at each publish) gets each
bucket as handles into a ring of two segments of this process (``rlfleet.wire.shm``): a segment is rewritten only
once the server has copied the bucket before last, so rank 0 still holds about two buckets, never the set. A set
smaller than ``SET_SHM_MIN_BYTES`` (a small policy's, e.g. the default MLP's 0.2 MB) goes inline without the
handshake: the handshake and a fresh segment cost more than copying it. Each server's channel stays open from one
publish to the next (a failed call closes it; the next publish dials again). A server that reads packed chunks
(its ``Describe``, asked once per channel) gets a set's small tensors several to a message: the default MLP's 16
tensors in one message instead of 16, which took its publish from ~10 ms to ~3 ms per server.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from rlfleet.errors import FailedPrecondition, InvalidRequest
from rlfleet.v1 import inference_pb2, inference_pb2_grpc
from rlfleet.wire import channels, shm, weights
from rlfleet.wire.clients import WireStats, offer_shared_memory, timed_messages

Gather = Callable[[list[str]], Iterator[dict[str, torch.Tensor]]]  # names -> whole tensors, a bucket at a time
_DONE = object()
SET_SHM_MIN_BYTES = 16 * shm.MIN_BYTES  # a weights set below this goes inline (1 MiB; 0 with RLFLEET_SHM_MIN_BYTES=0)


class WeightPublisher:
    def __init__(self, timeout: float = 120.0, shared_memory: bool = True):
        self.timeout = timeout
        self.shared_memory = shared_memory  # offer shared memory to servers on this host (cluster.shared_memory)
        self.synced: set[str] = set()  # inference servers holding a full weights set from this learner
        self.last_bytes = 0  # bytes of the last publish per server (the largest)
        self.last_wire = WireStats()  # the last publish's serialisation, over every server
        self._channels: dict[str, grpc.Channel] = {}  # server -> its open channel (kept between publishes)
        self._packed: dict[str, bool] = {}  # server -> whether it reads packed chunks (asked once per channel)
        self._lock = threading.Lock()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = channels.channel(address)
            return ch

    def _reads_packed(self, address: str, stub) -> bool:
        """Whether the server at ``address`` reads ``WeightsChunk.tensors`` (servers before it say nothing, and a
        receiver that serves only UpdateWeights answers UNIMPLEMENTED: no)."""
        with self._lock:
            known = self._packed.get(address)
        if known is None:
            try:
                info = stub.Describe(inference_pb2.DescribeInferenceRequest(), timeout=min(self.timeout, 10.0))
                known = bool(info.reads_packed_weights)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                known = False
            with self._lock:
                self._packed[address] = known
        return known

    def _drop(self, address: str) -> None:
        with self._lock:
            ch = self._channels.pop(address, None)
            self._packed.pop(address, None)  # a server restarted at this address may be another version
        if ch is not None:
            ch.close()

    def close(self) -> None:
        """Close the servers' channels."""
        for address in list(self._channels):
            self._drop(address)

    def publish(
        self,
        addresses: list[str],
        version: int,
        gather: Gather,
        full_names: list[str],
        partial_names: list[str],
        obs_specs,
        action_dim: int,
        set_bytes: Callable[[list[str]], int] | None = None,
    ) -> int:
        """Send weights ``version`` to every server in ``addresses``; -> bytes sent per server (the largest).
        ``set_bytes``: the bytes of a set of names (None: unknown, shared memory offered whatever the size).
        Raises FailedPrecondition naming the first server that failed (the update itself stands)."""
        if not addresses:
            raise InvalidRequest("inference_addresses: empty")
        targets = {a: a in self.synced for a in addresses}  # address -> partial?
        self.last_wire = WireStats()
        sent, errors = self._pass(targets, version, gather, full_names, partial_names, obs_specs, action_dim, set_bytes)
        refused = [
            a
            for a, exc in errors.items()
            if targets[a]
            and isinstance(exc, grpc.RpcError)
            and exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
        ]
        if refused:  # a restarted server without a full set: send it one
            for a in refused:
                errors.pop(a)
            more, again = self._pass(
                {a: False for a in refused},
                version,
                gather,
                full_names,
                partial_names,
                obs_specs,
                action_dim,
                set_bytes,
            )
            sent.update(more)
            errors.update(again)
        for a in sent:
            self.synced.add(a)
        for a, exc in errors.items():
            self.synced.discard(a)
        if errors:
            address, exc = next(iter(errors.items()))
            why = channels.describe_error(exc) if isinstance(exc, grpc.RpcError) else str(exc)
            raise FailedPrecondition(f"weight update to inference server {address} failed: {why}")
        self.last_bytes = max(sent.values(), default=0)
        return self.last_bytes

    def _pass(
        self,
        targets: dict[str, bool],
        version: int,
        gather: Gather,
        full_names: list[str],
        partial_names: list[str],
        obs_specs,
        action_dim: int,
        set_bytes: Callable[[list[str]], int] | None = None,
    ):
        """One gather over the ranks, fanned out to ``targets`` -> ({address: bytes}, {address: error})."""
        partial_set = set(partial_names)
        names = partial_names if all(targets.values()) else full_names
        small = set_bytes is not None and set_bytes(names) < SET_SHM_MIN_BYTES  # None: unknown, taken for large
        offer = self.shared_memory and not small
        if small:
            return self._pass_small(targets, version, gather(names), partial_set, obs_specs, action_dim)
        queues = {a: queue.Queue(maxsize=1) for a in targets}
        sizes = dict.fromkeys(targets, 0)

        wire = {a: WireStats() for a in targets}
        ended = {a: threading.Event() for a in targets}
        packed = dict.fromkeys(targets, False)  # set by each server's call before its stream starts

        def requests(address: str, arena):
            """The set's chunks, serialised; ``wire[address]`` counts building and serialising them (not the wait
            for the next bucket's gather)."""
            partial, first = targets[address], True
            while (bucket := queues[address].get()) is not _DONE:
                part = {k: v for k, v in bucket.items() if k in partial_set} if partial else bucket
                sizes[address] += sum(t.numel() * t.element_size() for t in part.values())
                kw = (
                    {"partial": True}
                    if partial
                    else ({"obs_specs": obs_specs, "action_dim": action_dim} if first else {})
                )
                yield from timed_messages(
                    wire[address],
                    weights.iter_chunks(
                        part, version, arena=arena, abandon=ended[address].is_set, packed=packed[address], **kw
                    ),
                    lambda c: c.data.shared.length if c.data.HasField("shared") else 0,
                )
                first = first and not part

        def call(address: str) -> None:
            arena = None
            try:
                ch = self._channel(address)
                stub = inference_pb2_grpc.InferenceServiceStub(ch)
                packed[address] = self._reads_packed(address, stub)
                if offer and offer_shared_memory(stub.SharedMemory, min(self.timeout, 10.0))[0]:
                    arena = shm.Arena("weights", slots=2)
                update = self._update_call(ch)
                # fail fast on a dead server (no wait_for_ready): the coordinator restarts it, waits until it has
                # registered, and has the weights republished; waiting here would hold up Train
                update(requests(address, arena), timeout=self.timeout)
            except BaseException:
                self._drop(address)  # a restarted server (or another one at its address) gets a fresh channel
                raise
            finally:
                ended[address].set()
                if arena is not None:
                    arena.close()

        errors: dict[str, BaseException] = {}
        with ThreadPoolExecutor(len(targets)) as pool:
            futures = {a: pool.submit(contextvars.copy_context().run, call, a) for a in targets}  # in this trace

            def hand(address: str, item) -> None:
                while not futures[address].done():  # a failed stream takes nothing more
                    try:
                        queues[address].put(item, timeout=0.2)
                        return
                    except queue.Full:
                        continue

            buckets = gather(names)
            try:
                for bucket in buckets:
                    for a in targets:
                        hand(a, bucket)
            finally:
                for _ in buckets:  # every rank takes part in every gather, whatever happened here
                    pass
                for a in targets:
                    hand(a, _DONE)
            for a, fut in futures.items():
                try:
                    fut.result()
                except Exception as exc:  # noqa: BLE001 - reported per server
                    errors[a] = exc
        self.last_wire = sum(wire.values(), self.last_wire)
        return {a: sizes[a] for a in targets if a not in errors}, errors

    def _update_call(self, ch: grpc.Channel):
        return ch.stream_unary(
            "/rlfleet.v1.InferenceService/UpdateWeights",
            request_serializer=None,
            response_deserializer=inference_pb2.UpdateWeightsResponse.FromString,
        )

    def _pass_small(self, targets: dict[str, bool], version: int, buckets, partial_set: set, obs_specs, action_dim):
        """A set under SET_SHM_MIN_BYTES (inline, held whole without harm): gathered at once, each server's
        messages built and serialised here, and every server's stream sent at once by gRPC, without the bucket
        hand-over's threads and queues (which cost a small policy's publish more than its bytes); servers that read
        the same kind of set (full or partial, packed or not) get the same messages, serialised once ->
        ({address: bytes}, {address: error})."""
        bucket: dict[str, torch.Tensor] = {}
        for part in buckets:  # every rank takes part in every gather
            bucket.update(part)
        calls, errors = {}, {}
        built: dict[tuple[bool, bool], tuple[list, WireStats, int]] = {}  # one serialisation per kind of server
        for address, partial in targets.items():
            try:
                ch = self._channel(address)
                packed = self._reads_packed(address, inference_pb2_grpc.InferenceServiceStub(ch))
                if (partial, packed) not in built:
                    part = {k: v for k, v in bucket.items() if k in partial_set} if partial else bucket
                    kw = {"partial": True} if partial else {"obs_specs": obs_specs, "action_dim": action_dim}
                    wire = WireStats()
                    messages = list(timed_messages(wire, weights.iter_chunks(part, version, packed=packed, **kw)))
                    size = sum(t.numel() * t.element_size() for t in part.values())
                    built[(partial, packed)] = messages, wire, size
                    self.last_wire += wire
                else:  # the same messages again: their bytes go to this server too, built once
                    self.last_wire += WireStats(0.0, built[(partial, packed)][1].bytes, 0)
                messages, _, size = built[(partial, packed)]
                # fail fast on a dead server (no wait_for_ready), as in _pass
                calls[address] = (self._update_call(ch).future(iter(messages), timeout=self.timeout), size)
            except Exception as exc:  # noqa: BLE001 - reported per server
                self._drop(address)
                errors[address] = exc
        sent = {}
        for address, (future, size) in calls.items():
            try:
                future.result()
                sent[address] = size
            except Exception as exc:  # noqa: BLE001 - reported per server
                self._drop(address)
                errors[address] = exc
        return sent, errors

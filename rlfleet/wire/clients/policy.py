"""Policy clients used by the rollout worker: the same interface over gRPC or in-process.

``make_policy_client`` is the one factory: ``GrpcPolicyClient`` keeps one Act bidi stream per pipeline stage to
the inference servers; ``LocalPolicyClient`` calls an ``InferenceEngine`` in this process (no gRPC), which is what
the in-process benchmark loop uses.
"""

from __future__ import annotations

import itertools
import queue
import threading

import grpc
import numpy as np

from rlfleet.wire import codec, rpc, tracing
from rlfleet.wire.acting import PolicyOutput
from rlfleet.v1 import inference_pb2, inference_pb2_grpc


class PolicyError(rpc.Unavailable):
    """The inference side failed, could not be reached, or returned something unusable (a server answers the
    caller whose request needed it with UNAVAILABLE, naming the inference server's address)."""


CONNECT_TIMEOUT_S = 10.0  # an inference server that accepts no connection within this long is unreachable


def _check_result(res: PolicyOutput, n: int, action_dim: int | None) -> PolicyOutput:
    if res.actions.ndim != 3 or res.actions.shape[0] != n:
        raise PolicyError(f"inference returned actions shaped {list(res.actions.shape)} for {n} observations "
                          f"([n, chunk, action_dim] expected)")
    if action_dim is not None and res.actions.shape[2] != action_dim:
        raise PolicyError(f"inference returned actions shaped {list(res.actions.shape)}, the env takes "
                          f"[{n}, chunk, {action_dim}]")
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
    wedged env server.
    """

    _END = object()

    def __init__(self, address: str, timeout: float):
        self.address = address
        self.timeout = timeout
        self.channel = rpc.channel(address)
        connect = min(timeout, CONNECT_TIMEOUT_S)
        try:  # an unreachable address fails now, naming it, not after a whole act timeout per stage
            grpc.channel_ready_future(self.channel).result(timeout=connect)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise PolicyError(f"inference server {address} did not answer within {connect:.0f}s (unreachable; "
                              f"no connection)") from None
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.responses = self.stub.Act(iter(self.requests.get, self._END), wait_for_ready=True)
        self.received: queue.SimpleQueue = queue.SimpleQueue()
        self.ids = itertools.count()
        self.inflight: list[tuple[int, int]] = []
        threading.Thread(target=self._read, name=f"act-{address}", daemon=True).start()

    def _read(self) -> None:
        try:
            for resp in self.responses:
                self.received.put(resp)
            self.received.put(PolicyError(f"inference server {self.address} closed the Act stream"))
        except grpc.RpcError as exc:
            self.received.put(PolicyError(f"inference server {self.address}: {rpc.describe_error(exc)}"))

    def submit(self, obs: dict[str, np.ndarray], deterministic: bool, instructions=None, noise_keys=None) -> None:
        rid = next(self.ids)
        self.requests.put(inference_pb2.ActRequest(
            request_id=rid, observations=codec.encode_map(obs), deterministic=deterministic,
            instructions=list(instructions or []), trace_context=dict(tracing.inject()),
            noise_keys=[] if noise_keys is None else np.asarray(noise_keys, np.uint64).tolist()))
        self.inflight.append((rid, next(iter(obs.values())).shape[0]))

    def result(self, action_dim: int | None) -> PolicyOutput:
        rid, n = self.inflight.pop(0)
        try:
            resp = self.received.get(timeout=self.timeout)
        except queue.Empty:
            self.responses.cancel()
            raise PolicyError(f"inference server {self.address} did not answer within {self.timeout:.0f}s "
                              f"(unreachable or stuck; cluster.act_timeout_s)") from None
        if isinstance(resp, PolicyError):
            raise resp
        if resp.request_id != rid:
            raise PolicyError(f"inference server {self.address} answered request {resp.request_id}, expected {rid}")
        try:
            res = PolicyOutput(codec.decode(resp.actions, "actions", dtype=np.float32),
                               codec.decode(resp.log_probs, "log_probs", dtype=np.float32),
                               codec.decode(resp.values, "values", dtype=np.float32) if resp.HasField("values")
                               else None,
                               codec.decode_map(resp.forward_inputs, "forward_inputs"), resp.weights_version)
        except codec.CodecError as exc:
            raise PolicyError(f"inference server {self.address}: {exc}") from exc
        return _check_result(res, n, action_dim)

    def close(self) -> None:
        self.requests.put(self._END)
        self.responses.cancel()
        self.channel.close()


class GrpcPolicyClient:
    """Stage s talks to inference server s % len(addresses) over its own stream."""

    def __init__(self, addresses: list[str], num_stages: int, action_dim: int | None = None,
                 timeout: float = 120.0):
        if not addresses:
            raise PolicyError("no inference server address given")
        self.action_dim = action_dim
        self.streams: list[_Stream] = []
        try:
            for s in range(num_stages):
                self.streams.append(_Stream(addresses[s % len(addresses)], timeout))
        except BaseException:
            self.close()
            raise

    def submit(self, stage: int, obs: dict[str, np.ndarray], deterministic: bool = False, instructions=None,
               noise_keys=None) -> None:
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

    def submit(self, stage: int, obs: dict[str, np.ndarray], deterministic: bool = False, instructions=None,
               noise_keys=None) -> None:
        self.pending[stage].append((obs, deterministic, instructions, noise_keys))

    def result(self, stage: int) -> PolicyOutput:
        obs, deterministic, instructions, noise_keys = self.pending[stage].pop(0)
        n = next(iter(obs.values())).shape[0]
        return _check_result(self.engine.act_now(obs, deterministic, instructions, noise_keys), n, self.action_dim)

    def close(self) -> None:
        pass


def make_policy_client(target, num_stages: int, action_dim: int | None = None, timeout: float = 120.0):
    """target: a list of inference addresses (gRPC) or an InferenceEngine (in-process)."""
    if isinstance(target, (list, tuple)):
        return GrpcPolicyClient(list(target), num_stages, action_dim, timeout)
    return LocalPolicyClient(target, num_stages, action_dim)

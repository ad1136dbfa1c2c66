"""The coordinator's calls into the fleet, with what a failed call means: stubs for the current incarnation of a
service, waiting for the health monitor to notice a death, republishing weights after inference restarts, and
the lost-episode count. Shared by the run loop (collect, train) and the evaluator.

This is the coordinator's transport module: the core (coordinator.py, evaluation.py, preflight.py) calls peers
through it and never imports gRPC. A failed call reaches the core as :data:`CallFailed`, which it reads only
through :func:`retryable` and :func:`describe`; the status codes stay here."""

from __future__ import annotations

import threading
import time

import grpc

from rlfleet.config.views import CoordinatorView
from rlfleet.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2_grpc
from rlfleet.wire import channels, env_contract
from services.coordinator.service_registry import Registry, RunFailed, Service

RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
)

# a call into the fleet that failed, as the core catches it (gRPC's own error; read it through the two below)
CallFailed = grpc.RpcError


def retryable(exc: CallFailed) -> bool:
    """Whether the call may have failed because its service died or restarted (then it is worth settling)."""
    return exc.code() in RETRYABLE


def describe(exc: CallFailed) -> str:
    """A failed call in one line: its status code's name and the details."""
    return channels.describe_error(exc)


def describe_external(address: str, timeout: float):
    """The EnvSpec of the env server at ``address`` outside the run (no credential). TimeoutError when nothing
    answers within ``timeout``; CallFailed when it does not answer Describe; ValueError (rlfleet.untrusted.TooLarge)
    for a reply past the limits, whose counts are scanned before it is parsed (docs/env-contract.md#limits)."""
    channel = channels.wait_ready(address, timeout, credential=False)
    try:
        return env_contract.EnvClient(channel).describe(timeout)
    finally:
        channel.close()


class FleetCalls:
    def __init__(self, view: CoordinatorView, registry: Registry, local: bool):
        self.view = view
        self.registry = registry
        self.fate = registry.fate
        # how long a failed call waits for the monitor to notice a death: a local launcher sees process exits at
        # once; in attach mode only missing heartbeats tell
        self.patience = 3.0 if local else view.heartbeat_timeout_s + 5
        self.lock = threading.Lock()
        self.lost_episodes = 0
        self.weights_lock = threading.Lock()
        self.weights_generation: tuple = ()
        # a run whose env servers host different simulators: the joint spaces its policy acts in, sent with
        # every Collect and Evaluate (None: every server has the policy's spaces)
        self.policy_spec = None

    def add_lost(self, n: int) -> None:
        with self.lock:
            self.lost_episodes += n

    def learner(self):
        svc = self.registry.wait("learner", 0, 30)
        return learner_pb2_grpc.LearnerServiceStub(channels.channel(svc.address))

    def rollout_stub(self, index: int) -> tuple[Service, object]:
        svc = self.registry.wait("env", index, self.view.startup_timeout_s)
        return svc, rollout_pb2_grpc.RolloutServiceStub(channels.channel(svc.address))

    def settle(self, svc: Service, incarnation: str, generation: tuple | None = None) -> None:
        """After a failed call: wait (up to ``patience``) until the monitor has noticed whether ``svc`` died or
        an inference server changed; raises RunFailed when the run is over."""
        deadline = time.monotonic() + self.patience
        while (
            svc.incarnation == incarnation
            and svc.ready.is_set()
            and time.monotonic() < deadline
            and not self.fate.fatal
            and (generation is None or self.registry.inference_generation() == generation)
        ):
            time.sleep(0.1)
        self.fate.check()

    @staticmethod
    def same(svc: Service, incarnation: str) -> bool:
        return svc.incarnation == incarnation and svc.ready.is_set()

    def ensure_inference_weights(self) -> None:
        """After inference restarts: wait for every server, then have the learner republish the current weights.
        A server that dies under the republish (the monitor has not noticed yet) is waited for and tried again."""
        reg = self.registry
        deadline = time.monotonic() + self.view.startup_timeout_s
        with self.weights_lock:
            while True:
                role = reg.policy_role  # inference servers, or the env servers acting themselves (collocated)
                for i in range(reg.counts[role]):
                    reg.wait(role, i, max(1.0, deadline - time.monotonic()))
                generation = reg.inference_generation()
                if generation == self.weights_generation:
                    return
                try:
                    self.learner().PublishWeights(
                        learner_pb2.PublishWeightsRequest(inference_addresses=reg.policy_addresses()), timeout=120
                    )
                    self.weights_generation = generation
                    return
                except grpc.RpcError as exc:
                    settle = min(deadline, time.monotonic() + 5.0)
                    while (
                        reg.inference_generation() == generation and time.monotonic() < settle and not self.fate.fatal
                    ):
                        time.sleep(0.1)  # a death is noticed by the monitor within a fraction of a second
                    if self.fate.fatal:
                        raise RunFailed(self.fate.fatal) from exc
                    if reg.inference_generation() == generation or time.monotonic() >= deadline:
                        raise RunFailed(f"republishing weights failed: {channels.describe_error(exc)}") from exc

    def weights_published(self) -> None:
        """The learner has just published to the current set of inference servers."""
        self.weights_generation = self.registry.inference_generation()

    def republish(self) -> None:
        with self.weights_lock:
            self.weights_generation = ()
        self.ensure_inference_weights()

    def why_failed(self, exc: CallFailed, what: str) -> str:
        """A failed call's explanation: a service death noticed by the monitor says more than the RPC error. A
        service whose server cancelled the call is going away, and under load its exit (a learner's ranks torn down
        by torchrun's agent) can take longer than the local patience: the monitor is given up to the heartbeat
        timeout, the longest a death can go unnoticed."""
        deadline = time.monotonic() + self.view.heartbeat_timeout_s
        while not self.fate.fatal and time.monotonic() < deadline and retryable(exc):
            time.sleep(0.1)
        return self.fate.fatal or f"{what} failed: {channels.describe_error(exc)}"

    def await_(self, future):
        """Wait for a future (thread pool or gRPC) while watching for a fatal service death."""
        while True:
            if self.fate.fatal:
                if hasattr(future, "cancel"):
                    future.cancel()
                raise RunFailed(self.fate.fatal)
            try:
                return future.result(timeout=0.25)
            except (TimeoutError, grpc.FutureTimeoutError):
                continue

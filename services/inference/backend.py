"""The inference backend interface: how the inference engine (services.inference.engine) acts, whatever
implements it. A backend gets a validated ``ActRequest`` and answers it through the request's future, and is told
which policy copy (and weights version) to serve from when an update has been loaded into it. With it, its small
types: ``ActRequest``, ``BackendStats``, ``BackendOptions`` (what the factory, services.inference.factory, passes
on) and ``policy_lock`` (the lock a batch holds on a policy copy, which the engine takes to load weights into it).

The implementations live in their own modules: ``hf`` (services.inference.batcher) and ``vllm``
(services.inference.vllm_decoder); each imports this module, never the engine.
"""

from __future__ import annotations

import abc
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from rlfleet.wire.codec import PolicyOutput


@dataclass
class ActRequest:
    """One validated Act request (a batch of rows from one stream); its ``future`` gets the PolicyOutput."""

    obs: dict[str, np.ndarray]
    instructions: list[str] | None
    deterministic: bool
    rows: int
    stream: int
    future: Future
    t_submit: float
    trace_context: dict = field(default_factory=dict)  # the asking rollout's trace context (W3C traceparent)
    noise_keys: np.ndarray | None = None  # [rows] uint64 (rlfleet.wire.codec), or None: draw from this process's RNG


@dataclass(frozen=True)
class BackendStats:
    """What a backend has done, for the server's Describe."""

    requests_served: int
    batches_run: int  # act batches (hf) or engine steps (vllm)
    rows_run: int  # rows acted on over those batches (vllm: row-steps, each row taking several steps)

    @property
    def mean_batch_rows(self) -> float:
        return float(self.rows_run / self.batches_run) if self.batches_run else 0.0


class InferenceBackend(abc.ABC):
    """How the inference engine acts: ``submit`` a request (answered through its future) or ``act`` on one right
    now, ``set_weights`` to serve another policy copy, ``start`` / ``close`` the backend's thread, ``stats``."""

    name: str

    def __init__(self, on_fatal: Callable[[str], None] | None = None):
        # called with the reason when the backend is lost for good in this process (the inference server then exits
        # to be restarted); None: stay up and refuse requests until an update brings it back
        self.on_fatal = on_fatal
        self._open_streams = 0
        self._streams_lock = threading.Lock()

    def start(self) -> None:
        """Start serving (the backend's own thread); requests are answered once weights are set."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving: the backend's thread ends (requests still queued are dropped or failed)."""

    @abc.abstractmethod
    def set_weights(self, policy, version: int) -> None:
        """Serve ``policy`` (a policy copy that now holds weights ``version``) from now on: work in flight
        finishes on the copy it started on. Raises (e.g. rlfleet.errors.Unavailable) when it cannot serve it."""

    @abc.abstractmethod
    def submit(self, request: ActRequest) -> None:
        """Queue a validated request; its future gets the PolicyOutput (numpy, stamped with the weights version)
        or the exception."""

    def act(self, request: ActRequest) -> PolicyOutput:
        """Act on one validated request now and return its output (default: submit it and wait)."""
        self.submit(request)
        return request.future.result()

    @abc.abstractmethod
    def stats(self) -> BackendStats:
        """Requests served, batches (or engine steps) run and the rows over them."""

    # --- Act streams (a stream sends its next request only when the last one is answered) ----------------------
    def open_stream(self) -> int:
        with self._streams_lock:
            self._open_streams += 1
            return id(threading.current_thread()) ^ int(time.monotonic_ns())

    def close_stream(self) -> None:
        with self._streams_lock:
            self._open_streams -= 1


@dataclass(frozen=True)
class BackendOptions:
    """What the factory passes on (from the config: rollout.*, runner.seed), each implementation taking its part."""

    max_batch_size: int = 256
    max_wait_ms: float = 1.0
    batch_invariant_rows: int = 0
    device: str = "cpu"
    seed: int = 0
    on_fatal: Callable[[str], None] | None = None
    step_spans: bool = False  # a span per act batch (hf)


_IN_USE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_IN_USE_GUARD = threading.Lock()


def policy_lock(model) -> threading.Lock:
    """The lock that a batch holds on a policy copy while it runs on it (and that loading weights into the copy
    takes: a batch still running on it finishes first)."""
    with _IN_USE_GUARD:
        lock = _IN_USE.get(model)
        if lock is None:
            lock = _IN_USE[model] = threading.Lock()
        return lock

"""Inference backends: the one interface the inference engine acts through, and the one factory that picks an
implementation by ``rollout.backend`` (the names of rlfleet.policies.backends.BACKENDS).

- ``hf``: ``DynamicBatcher`` (services.inference.batcher): the policy's own ``act`` (transformers / torch) behind
  rlfleet's dynamic batcher.
- ``vllm``: ``VLLMDecoder`` (services.inference.vllm_decoder): vLLM's engine decodes the action tokens, batching the
  rows of every stream continuously.

The engine (services.inference.engine) owns what is the same for both: the versioned policy copies (double
buffering, checks of a weights set and of the spaces against memory) and the validation of a request. A backend
gets a validated ``ActRequest`` and answers it through the request's future, and is told which policy copy (and
weights version) to serve from when an update has been loaded into it.
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

from rlfleet.policies.backends import BACKENDS
from rlfleet.wire.acting import PolicyOutput
from rlfleet.registry import UnknownName, lookup


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
    trace_context: dict = field(default_factory=dict)  # the asking rollout's trace context (rlfleet.wire.tracing)
    noise_keys: np.ndarray | None = None  # [rows] uint64 (rlfleet.wire.noise), or None: draw from this process's RNG


@dataclass(frozen=True)
class BackendStats:
    """What a backend has done, for the server's Describe."""
    requests_served: int
    batches_run: int  # act batches (hf) or engine steps (vllm)
    rows_run: int     # rows acted on over those batches (vllm: row-steps, each row taking several steps)

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
        finishes on the copy it started on. Raises (e.g. rlfleet.wire.rpc.Unavailable) when it cannot serve it."""

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


def _hf(options: BackendOptions) -> InferenceBackend:
    from services.inference.batcher import DynamicBatcher

    return DynamicBatcher(max_batch_size=options.max_batch_size, max_wait_ms=options.max_wait_ms,
                          batch_invariant_rows=options.batch_invariant_rows, device=options.device,
                          on_fatal=options.on_fatal)


def _vllm(options: BackendOptions) -> InferenceBackend:
    from services.inference.vllm_decoder import VLLMDecoder

    return VLLMDecoder(max_num_seqs=options.max_batch_size, seed=options.seed, on_fatal=options.on_fatal)


# the implementation of each backend of the registry (rlfleet.policies.backends.BACKENDS), by its name
IMPLEMENTATIONS: dict[str, Callable[[BackendOptions], InferenceBackend]] = {"hf": _hf, "vllm": _vllm}


def make_backend(name: str, options: BackendOptions | None = None) -> InferenceBackend:
    """The backend ``rollout.backend`` names: a name of rlfleet.policies.backends.BACKENDS, built by its entry of
    IMPLEMENTATIONS."""
    try:
        lookup(BACKENDS, name, "backend")
        build = lookup(IMPLEMENTATIONS, name, "backend")
    except UnknownName as exc:
        raise ValueError(f"rollout.backend: {exc}") from None
    return build(options or BackendOptions())


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

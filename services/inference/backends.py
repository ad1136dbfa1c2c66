"""Inference backends: the one interface the inference engine acts through, and the one factory that picks an
implementation by ``rollout.backend`` (the names of rlfleet.policies.backends.BACKENDS).

- ``hf``: ``DynamicBatcher`` (services.inference.backends): the policy's own ``act`` (transformers / torch) behind
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
from concurrent.futures import Future
import contextlib
from dataclasses import dataclass, field
import queue
import threading
import time
from typing import Callable
import weakref

import numpy as np
from opentelemetry import metrics, propagate, trace
import torch

from rlfleet.policies.backends import BACKENDS
from rlfleet.policies.models.actor_critic import to_torch_obs
from rlfleet.registry import UnknownName, lookup
from rlfleet.wire.rollout_schema import PolicyOutput, RowNoise

_tracer = trace.get_tracer("rlfleet")
_meter = metrics.get_meter("rlfleet")
_BATCH_ROWS = _meter.create_histogram("rlfleet.inference.batch_rows", "1", "rows per act batch")
_QUEUE_WAIT = _meter.create_histogram("rlfleet.inference.queue_wait", "s", "time the oldest request of a batch waited")
_FORWARD_LATENCY = _meter.create_histogram("rlfleet.inference.forward_latency", "s", "one act batch")


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
    noise_keys: np.ndarray | None = None  # [rows] uint64 (rlfleet.wire.rollout_schema), or None: draw from this process's RNG


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
    step_spans: bool = False  # a span per act batch (hf)


def _hf(options: BackendOptions) -> InferenceBackend:
    return DynamicBatcher(max_batch_size=options.max_batch_size, max_wait_ms=options.max_wait_ms,
                          batch_invariant_rows=options.batch_invariant_rows, device=options.device,
                          on_fatal=options.on_fatal, step_spans=options.step_spans)


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


# --- DynamicBatcher: the ``rollout.backend: hf`` inference backend (services.inference.backends): the policy's own (was services/inference/batcher.py)
class DynamicBatcher(InferenceBackend):
    name = "hf"

    def __init__(self, *, max_batch_size: int = 256, max_wait_ms: float = 1.0, batch_invariant_rows: int = 0,
                 device: str = "cpu", on_fatal=None, step_spans: bool = False):
        super().__init__(on_fatal)
        self.step_spans = step_spans  # a span per act batch, linked to every request's trace context
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.batch_invariant_rows = batch_invariant_rows  # pad act batches to multiples of this (0: no padding)
        self.device = torch.device(device)
        self._model = None  # the policy copy served now
        self._version = -1
        self._served_lock = threading.Lock()
        self._queue: queue.SimpleQueue[ActRequest | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.requests_served = 0
        self.batches_run = 0
        self.rows_run = 0

    def set_weights(self, policy, version: int) -> None:
        with self._served_lock:  # the next batch runs on it; a batch running on the old copy finishes there
            self._model, self._version = policy, version

    def stats(self) -> BackendStats:
        return BackendStats(self.requests_served, self.batches_run, self.rows_run)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
            self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    def submit(self, request: ActRequest) -> None:
        self._queue.put(request)

    def act(self, request: ActRequest) -> PolicyOutput:
        """Run the policy on this request's rows right now, on the calling thread (not batched with others)."""
        return self._forward(request.obs, request.deterministic, request.instructions, request.noise_keys)

    @torch.inference_mode()
    def _forward(self, obs: dict[str, np.ndarray], deterministic: bool, instructions, keys) -> PolicyOutput:
        """One batch through the served policy copy. With ``keys`` (one per row) each row's sampling noise comes
        from its key (rlfleet.wire.rollout_schema), so the row's action does not depend on the batch."""
        rows = next(iter(obs.values())).shape[0]
        block = self.batch_invariant_rows
        if block > 0 and rows % block:  # a whole number of blocks: the kernels then treat every row alike
            pad = block - rows % block
            obs = {k: np.concatenate([v, np.repeat(v[:1], pad, 0)]) for k, v in obs.items()}
            instructions = None if instructions is None else [*instructions, *[instructions[0]] * pad]
            keys = None if keys is None else np.concatenate([keys, np.repeat(keys[:1], pad)])
        with self._served_lock:
            model, version = self._model, self._version
            lock = policy_lock(model)
            lock.acquire()  # held while the batch runs: an update never loads into a model in use
        try:
            tobs = {k: v.to(self.device) for k, v in to_torch_obs(obs).items()}
            with model.precision():
                out = model.act(tobs, deterministic, instructions, noise=None if keys is None else RowNoise(keys))
        finally:
            lock.release()
        return out.to_numpy(version, rows)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, rows = [first], first.rows
            deadline = first.t_submit + self.max_wait_s
            while rows < self.max_batch_size:
                if len({r.stream for r in batch}) >= self._open_streams:
                    try:  # everyone is waiting on us: take what is queued and go
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                else:
                    timeout = deadline - time.monotonic()
                    if timeout <= 0:
                        break
                    try:
                        item = self._queue.get(timeout=timeout)
                    except queue.Empty:
                        break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
                rows += item.rows
            self._run(batch)

    def _batch_span(self, group: list[ActRequest], rows: int):
        """A span for one act batch (only with ``step_spans``): a child of the first request's trace context, linked
        to every request's (one batch serves several rollouts)."""
        if not self.step_spans:
            return contextlib.nullcontext()
        contexts = [propagate.extract(r.trace_context) for r in group if r.trace_context]
        links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in contexts]
        return _tracer.start_as_current_span("act_batch", context=contexts[0] if contexts else None, links=links,
                                             attributes={"rlfleet.rows": rows, "rlfleet.requests": len(group)})

    def _run(self, batch: list[ActRequest]) -> None:
        for deterministic in (False, True):
            group = [r for r in batch if r.deterministic == deterministic]
            if not group:
                continue
            try:
                obs = {k: np.concatenate([r.obs[k] for r in group]) if len(group) > 1 else group[0].obs[k]
                       for k in group[0].obs}
                texts = [t for r in group for t in (r.instructions or [""] * r.rows)]
                keys = None
                if any(r.noise_keys is not None for r in group):  # keyless rows get keys from this process's RNG
                    keys = np.concatenate([r.noise_keys if r.noise_keys is not None else
                                           np.random.randint(0, 2 ** 63, r.rows, dtype=np.int64).astype(np.uint64)
                                           for r in group])
                t0 = time.monotonic()
                rows = sum(r.rows for r in group)
                with self._batch_span(group, rows):
                    res = self._forward(obs, deterministic, texts, keys)
                _BATCH_ROWS.record(rows)
                _QUEUE_WAIT.record(t0 - group[0].t_submit)
                _FORWARD_LATENCY.record(time.monotonic() - t0)
            except Exception as exc:  # noqa: BLE001 - delivered to each waiting stream
                for r in group:
                    r.future.set_exception(exc)
                continue
            start = 0
            for r in group:
                end = start + r.rows
                r.future.set_result(res.rows(start, end))
                start = end
            self.batches_run += 1
            self.rows_run += start
            self.requests_served += len(group)

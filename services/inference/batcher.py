"""The built-in ``hf`` inference backend, ``DynamicBatcher``: the policy's own ``act`` (transformers / torch)
behind rlfleet's dynamic batcher. Queued requests from every stream run together as soon as ``max_batch_size`` rows
are queued, every open stream has a request waiting, or the oldest request has waited ``max_wait_ms``. It implements
services.inference.backend's ``InferenceBackend``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import numpy as np
import torch
from opentelemetry import metrics, propagate, trace

from rlfleet.policies.local import forward
from rlfleet.wire.codec import PolicyOutput
from services.inference.backend import ActRequest, BackendStats, InferenceBackend, policy_lock

_tracer = trace.get_tracer("rlfleet")
_meter = metrics.get_meter("rlfleet")
_BATCH_ROWS = _meter.create_histogram("rlfleet.inference.batch_rows", "1", "rows per act batch")
_QUEUE_WAIT = _meter.create_histogram("rlfleet.inference.queue_wait", "s", "time the oldest request of a batch waited")
_FORWARD_LATENCY = _meter.create_histogram("rlfleet.inference.forward_latency", "s", "one act batch")


class DynamicBatcher(InferenceBackend):
    name = "hf"

    def __init__(
        self,
        *,
        max_batch_size: int = 256,
        max_wait_ms: float = 1.0,
        batch_invariant_rows: int = 0,
        device: str = "cpu",
        on_fatal=None,
        step_spans: bool = False,
    ):
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
        from its key (rlfleet.wire.codec), so the row's action does not depend on the batch."""
        with self._served_lock:
            model, version = self._model, self._version
            lock = policy_lock(model)
            lock.acquire()  # held while the batch runs: an update never loads into a model in use
        try:
            return forward(
                model, obs, deterministic, instructions, keys, self.device, self.batch_invariant_rows, version
            )
        finally:
            lock.release()

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
        return _tracer.start_as_current_span(
            "act_batch",
            context=contexts[0] if contexts else None,
            links=links,
            attributes={"rlfleet.rows": rows, "rlfleet.requests": len(group)},
        )

    def _run(self, batch: list[ActRequest]) -> None:
        for deterministic in (False, True):
            group = [r for r in batch if r.deterministic == deterministic]
            if not group:
                continue
            try:
                obs = {
                    k: np.concatenate([r.obs[k] for r in group]) if len(group) > 1 else group[0].obs[k]
                    for k in group[0].obs
                }
                texts = [t for r in group for t in (r.instructions or [""] * r.rows)]
                keys = None
                if any(r.noise_keys is not None for r in group):  # keyless rows get keys from this process's RNG
                    keys = np.concatenate(
                        [
                            r.noise_keys
                            if r.noise_keys is not None
                            else np.random.randint(0, 2**63, r.rows, dtype=np.int64).astype(np.uint64)
                            for r in group
                        ]
                    )
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

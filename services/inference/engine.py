"""The inference engine's module (no gRPC): the core, the one backend interface it acts through, the one factory
that picks an implementation, and the built-in backend. The rule: a core module holds its interface and its built-in
default implementation; optional implementations live in their own modules. Here, in sections:

- the interface, ``InferenceBackend`` (with ``ActRequest``, ``BackendStats``, ``BackendOptions`` and ``policy_lock``):
  a backend gets a validated ``ActRequest`` and answers it through the request's future, and is told which policy
  copy (and weights version) to serve from when an update has been loaded into it;
- the core, ``InferenceEngine``, which owns what is the same for every backend: the versioned policy (two copies,
  double buffered; checks of a weights set and of the spaces against memory) and the validation of a request
  (observations, instructions, noise keys), acting through one backend;
- the factory, ``make_backend``: the implementation ``rollout.backend`` names (a name of
  rlfleet.policies.backends.BACKENDS), built by its entry of ``IMPLEMENTATIONS``;
- the built-in ``hf`` backend, ``DynamicBatcher``: the policy's own ``act`` (transformers / torch) behind rlfleet's
  dynamic batcher: queued requests from every stream run together as soon as ``max_batch_size`` rows are queued,
  every open stream has a request waiting, or the oldest request has waited ``max_wait_ms``.

The optional ``vllm`` backend, ``VLLMDecoder``, lives in services.inference.vllm_decoder (the factory imports it only
when it is asked for: it needs vLLM's environment): vLLM's engine decodes the action tokens, batching the rows of
every stream continuously; weight updates reload vLLM's language model between decodes.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from opentelemetry import metrics, propagate, trace
import torch

from rlfleet.policies import build_policy, footprint
from rlfleet.policies.backends import BACKENDS
from rlfleet.policies.models.actor_critic import to_torch_obs
from rlfleet.registry import UnknownName, lookup
from rlfleet.wire.codec import PolicyOutput, RowNoise
from rlfleet.wire.rpc import FailedPrecondition, InvalidRequest
from rlfleet.wire.spaces import TensorSpace

log = logging.getLogger("rlfleet.inference")
_tracer = trace.get_tracer("rlfleet")
_meter = metrics.get_meter("rlfleet")
_BATCH_ROWS = _meter.create_histogram("rlfleet.inference.batch_rows", "1", "rows per act batch")
_QUEUE_WAIT = _meter.create_histogram("rlfleet.inference.queue_wait", "s", "time the oldest request of a batch waited")
_FORWARD_LATENCY = _meter.create_histogram("rlfleet.inference.forward_latency", "s", "one act batch")


# --- The backend interface: how the engine acts (what every implementation provides) ----------------------------------
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


# --- The core: InferenceEngine, the policy copies, weight checks, request validation ----------------------------------
# a weights version is the learner's count of updates, one per epoch (a resumed learner goes on from its
# checkpoint's): no run reaches 2**31 (68 years at an epoch a second); beyond it a version is made up
MAX_WEIGHTS_VERSION = 2**31 - 1

@dataclass(frozen=True)
class InferenceInfo:
    """What the server's Describe reports."""
    model_type: str
    weights_version: int
    num_parameters: int
    requests_served: int
    batches_run: int
    mean_batch_rows: float


class InferenceEngine:
    def __init__(self, model_cfg, *, normalize_obs: bool = True, max_batch_size: int = 256,
                 max_wait_ms: float = 1.0, device: str = "cpu", logprob_type: str = "action_level",
                 batch_invariant_rows: int = 0, backend: str = "hf", seed: int = 0, weights_precision: str = "fp32",
                 memory_budget_bytes: int | None = None, on_fatal=None, step_spans: bool = False):
        self.model_cfg = model_cfg
        # bytes a policy (two copies) may take here; None: what the device has available when the spaces arrive
        self.memory_budget_bytes = memory_budget_bytes
        self.weights_dtype = torch.bfloat16 if weights_precision == "bf16" else None
        # how requests are acted on (rollout.backend); on_fatal: called when the backend is lost for good;
        # step_spans: a span per act batch (tracing set up, telemetry.step_spans)
        self.backend: InferenceBackend = make_backend(backend, BackendOptions(
            max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, batch_invariant_rows=batch_invariant_rows,
            device=device, seed=seed, on_fatal=on_fatal, step_spans=step_spans))
        self.normalize_obs = normalize_obs
        self.logprob_type = logprob_type
        self.max_batch_size = max_batch_size
        self.device = torch.device(device)
        self.model = None  # a policy (rlfleet.policies), the served copy
        self._spare = None  # the idle copy the next update loads into
        self.bytes_loaded = 0
        self.obs_specs: dict[str, TensorSpace] | None = None
        self.action_dim: int | None = None
        self.version = -1
        self._swap_lock = threading.Lock()

    # --- weights ----------------------------------------------------------------------------------------------
    def set_weights(self, version: int, state: dict[str, torch.Tensor], *, obs_specs: dict[str, TensorSpace] | None = None,
                    action_dim: int | None = None, partial: bool = False) -> int:
        """Swap in a new weights set. In-flight batches finish on the old model; the next batch uses the new.

        Two copies of the policy are kept (double buffering): an update is loaded into the idle copy, in place,
        which then becomes the served one, so an update copies only the tensors it carries, never the whole
        model. A partial update (LoRA adapters, or whatever the policy trains) must carry every tensor that
        changes in training (``sync_state_dict``); the rest never changes after the first full set."""
        self.check_version(version)
        rebuild = obs_specs is not None and (obs_specs != self.obs_specs or action_dim != self.action_dim)
        if rebuild:
            # the declared spaces decide the policy's size: check them, and the state they imply, against this
            # server's memory before anything is built (a declared 2**31-element space used to be built first)
            planned = self._plan(obs_specs, action_dim)
            if planned is not None:
                self._check_state(state, {n: shape for n, (shape, _, _) in planned.items()}, partial=False)
            target = build_policy(self.model_cfg, obs_specs, action_dim, self.normalize_obs,
                                  self.logprob_type).to(self.device)
            if self.weights_dtype is not None:  # rollout.weights_precision: bf16: nothing trains here, so the
                for param in target.parameters():  # served copies may hold their parameters in bf16 (half the
                    param.data = param.data.to(self.weights_dtype)  # memory); buffers (statistics) stay fp32
        elif self.model is None:
            raise InvalidRequest("observation_space: the first weights set must describe the policy's spaces")
        else:
            target = self._spare
        self._check_state(state, {n: tuple(t.shape) for n, t in target.state_dict().items()},
                          partial=partial and not rebuild)
        for name, tensor in state.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise InvalidRequest(f"weights['{name}']: non-finite values")
        with policy_lock(target):  # a batch still running on this copy finishes first
            target.load_state_dict(state, strict=False)
            target.eval()
        self.backend.set_weights(target, version)  # work in flight finishes on the copy it started on
        spare = target
        if rebuild:  # the second buffer: one copy when the policy is (re)built, none per update
            import copy

            spare = copy.deepcopy(target)
        with self._swap_lock:
            old = self.model
            self.model, self.version = target, version
            if obs_specs is not None:
                self.obs_specs, self.action_dim = dict(obs_specs), action_dim
        self._spare = spare if rebuild else old
        self.bytes_loaded += sum(t.numel() * t.element_size() for t in state.values())
        log.info("serving weights version %d (%d tensors)", version, len(state))
        return version

    def check_version(self, version: int) -> None:
        """A weights set's version, before its tensors are read: a learner's (0..MAX_WEIGHTS_VERSION), and not older
        than the one served (the same again is a republish). Versions go up by one per epoch, but may skip: a
        server that missed a publish gets the next one (the learner sends it a full set), a restarted one (serving
        none) takes the learner's current one, whatever it is."""
        if not 0 <= version <= MAX_WEIGHTS_VERSION:
            raise InvalidRequest(f"version: {version} is no weights version (0..{MAX_WEIGHTS_VERSION}: the learner's "
                                 f"count of updates, one per epoch); serving {self.version}")
        if version < self.version:
            raise InvalidRequest(f"version: stale weights version {version} (serving {self.version})")

    def _plan(self, obs_specs: dict[str, TensorSpace], action_dim: int):
        """Before a (re)build for new spaces: their observation row, and the two copies of the policy they imply
        (double buffering), must fit this server's memory (``memory_budget_bytes``, or what is available).
        -> the planned state (rlfleet.policies.footprint.planned_state), or None where it cannot be planned."""
        row = footprint.observation_row_bytes(obs_specs)
        planned = footprint.planned_state(self.model_cfg, obs_specs, action_dim, self.normalize_obs,
                                        self.logprob_type)
        if planned is not None:
            copy = footprint.state_bytes(planned, self.weights_dtype)
            spaces = ", ".join(f"{k}{list(s.shape)}" for k, s in obs_specs.items())
            footprint.check_fits(2 * copy + self.max_batch_size * row,
                               f"observation_space: a {self.model_cfg.model_type} policy for spaces {spaces} "
                               f"(action {action_dim}-D: two copies of {copy / 2**30:.2f} GiB, and a batch)",
                               self.device, self.memory_budget_bytes)
        return planned

    def _check_state(self, state: dict[str, torch.Tensor], shapes: dict[str, tuple], partial: bool) -> None:
        """A weights set against the policy's tensors: no unknown names, every tensor in a full set, their shapes."""
        unknown = sorted(set(state) - set(shapes))
        if unknown:
            raise InvalidRequest(f"weights: unknown tensor '{unknown[0]}' for this {self.model_cfg.model_type} policy")
        if not partial:
            missing = sorted(set(shapes) - set(state))
            if missing:
                raise InvalidRequest(f"weights: full set is missing tensor '{missing[0]}'")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(shapes[name]):
                raise InvalidRequest(f"weights['{name}']: shape {list(tensor.shape)} where "
                                     f"{list(shapes[name])} was expected")

    # --- acting -----------------------------------------------------------------------------------------------
    def validate_obs(self, obs: dict[str, np.ndarray]) -> int:
        if self.model is None:
            raise FailedPrecondition("no policy weights loaded yet (the learner publishes them at start)")
        specs = self.obs_specs
        if set(obs) != set(specs):
            raise InvalidRequest(f"observations: keys {sorted(obs)} do not match the policy's {sorted(specs)}")
        n = None
        for key, arr in obs.items():
            spec = specs[key]
            if arr.ndim != len(spec.shape) + 1 or tuple(arr.shape[1:]) != spec.shape:
                raise InvalidRequest(f"observations['{key}']: shape {list(arr.shape)} where "
                                     f"{['N', *spec.shape]} was expected")
            if arr.dtype.name != spec.dtype:
                raise InvalidRequest(f"observations['{key}']: dtype {arr.dtype.name} where {spec.dtype} was expected")
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise InvalidRequest(f"observations['{key}']: non-finite values")
            if n is not None and arr.shape[0] != n:
                raise InvalidRequest(f"observations['{key}']: batch {arr.shape[0]} differs from the other keys' {n}")
            n = arr.shape[0]
        if not n:
            raise InvalidRequest("observations: empty batch")
        return n

    @staticmethod
    def check_noise_keys(noise_keys, rows: int) -> np.ndarray | None:
        if noise_keys is None or len(noise_keys) == 0:
            return None
        if len(noise_keys) != rows:
            raise InvalidRequest(f"noise_keys: {len(noise_keys)} keys for {rows} observation rows")
        return np.asarray(noise_keys, dtype=np.uint64)

    def _request(self, obs: dict[str, np.ndarray], deterministic: bool, stream: int, instructions,
                 trace_context: dict[str, str] | None, noise_keys) -> ActRequest:
        """A validated request (observations, instructions and noise keys checked against the served policy)."""
        rows = self.validate_obs(obs)
        if instructions and len(instructions) != rows:
            raise InvalidRequest(f"instructions: {len(instructions)} texts for {rows} observation rows")
        keys = self.check_noise_keys(noise_keys, rows)
        return ActRequest(obs, list(instructions) if instructions else None, deterministic, rows, stream, Future(),
                          time.monotonic(), trace_context or {}, keys)

    def act_now(self, obs: dict[str, np.ndarray], deterministic: bool, instructions=None,
                noise_keys=None) -> PolicyOutput:
        """Act on one batch right now (validated). With ``noise_keys`` (one per row) each row's sampling noise comes
        from its key (rlfleet.wire.codec), so the row's action does not depend on the batch."""
        return self.backend.act(self._request(obs, deterministic, 0, instructions, None, noise_keys))

    def submit(self, obs: dict[str, np.ndarray], deterministic: bool, stream: int = 0, instructions=None,
               trace_context: dict[str, str] | None = None, noise_keys=None) -> Future:
        """Queue one batch (validated) for the backend; -> the future of its PolicyOutput."""
        request = self._request(obs, deterministic, stream, instructions, trace_context, noise_keys)
        self.backend.submit(request)
        return request.future

    # --- serving ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.backend.start()

    def stop(self) -> None:
        self.backend.close()

    def open_stream(self) -> int:
        return self.backend.open_stream()

    def close_stream(self) -> None:
        self.backend.close_stream()

    @property
    def requests_served(self) -> int:
        return self.backend.stats().requests_served

    @property
    def batches_run(self) -> int:
        return self.backend.stats().batches_run

    def info(self) -> InferenceInfo:
        """The model served, its weights version and size, and what the backend has done."""
        model = self.model
        stats = self.backend.stats()
        return InferenceInfo(self.model_cfg.model_type, self.version,
                             sum(p.numel() for p in model.parameters()) if model is not None else 0,
                             stats.requests_served, stats.batches_run, stats.mean_batch_rows)


# --- The factory: the backend rollout.backend names -------------------------------------------------------------------
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


# --- The built-in `hf` backend: DynamicBatcher, the policy's own act behind rlfleet's dynamic batcher -----------------
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
        from its key (rlfleet.wire.codec), so the row's action does not depend on the batch."""
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

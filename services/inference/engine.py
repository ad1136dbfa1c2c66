"""InferenceEngine: the inference server's core (no gRPC). Holds the versioned policy, validates observations,
and acts with one of two backends (``rollout.backend``, rlfleet.policies.backends):

- ``hf``: a dynamic batcher over the policy's own ``act``: queued requests from every stream run together as soon as
  ``max_batch_size`` rows are queued, every open stream has a request waiting, or the oldest request has waited
  ``max_wait_ms``.
- ``vllm``: requests go to the VLLMDecoder (services.inference.vllm_decoder), whose vLLM engine batches the rows
  of every stream continuously; weight updates reload vLLM's language model between decodes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from rlfleet.wire.spaces import TensorSpace
from rlfleet.policies.models.actor_critic import to_torch_obs
from rlfleet.policies import build_policy, footprint
from rlfleet.wire.rpc import FailedPrecondition, InvalidRequest
from rlfleet.wire import tracing, weights
from rlfleet.wire.acting import ActResult
from rlfleet.wire.noise import RowNoise

log = logging.getLogger("rlfleet.inference")


@dataclass
class _Request:
    obs: dict[str, np.ndarray]
    instructions: list[str] | None
    deterministic: bool
    rows: int
    stream: int
    future: Future
    t_submit: float
    trace_context: dict = field(default_factory=dict)  # the asking rollout's trace context (rlfleet.wire.tracing)
    noise_keys: np.ndarray | None = None  # [rows] uint64 (rlfleet.wire.noise), or None: draw from this process's RNG


class InferenceEngine:
    def __init__(self, model_cfg, *, normalize_obs: bool = True, max_batch_size: int = 256,
                 max_wait_ms: float = 1.0, device: str = "cpu", logprob_type: str = "action_level",
                 batch_invariant_rows: int = 0, backend: str = "hf", seed: int = 0, weights_precision: str = "fp32",
                 memory_budget_bytes: int | None = None):
        self.model_cfg = model_cfg
        # bytes a policy (two copies) may take here; None: what the device has available when the spaces arrive
        self.memory_budget_bytes = memory_budget_bytes
        self.weights_dtype = torch.bfloat16 if weights_precision == "bf16" else None
        self.backend = backend
        self.decoder = None  # the vllm backend's VLLMDecoder
        if backend == "vllm":
            from services.inference.vllm_decoder import VLLMDecoder

            self.decoder = VLLMDecoder(max_num_seqs=max_batch_size, seed=seed)
        elif backend != "hf":
            raise ValueError(f"rollout.backend: unknown backend '{backend}' (hf or vllm)")
        self.batch_invariant_rows = batch_invariant_rows  # pad act batches to multiples of this (0: no padding)
        self.normalize_obs = normalize_obs
        self.logprob_type = logprob_type
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.device = torch.device(device)
        self.model = None  # a policy (rlfleet.policies), the served copy
        self._spare = None  # the idle copy the next update loads into
        self.bytes_loaded = 0
        self.obs_specs: dict[str, TensorSpace] | None = None
        self.action_dim: int | None = None
        self.version = -1
        self._swap_lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._open_streams = 0
        self._streams_lock = threading.Lock()
        self.requests_served = 0
        self.batches_run = 0
        self.rows_run = 0
        self._thread: threading.Thread | None = None

    # --- weights ----------------------------------------------------------------------------------------------
    def set_weights(self, version: int, state: dict[str, torch.Tensor], *, obs_specs: dict[str, TensorSpace] | None = None,
                    action_dim: int | None = None, partial: bool = False) -> int:
        """Swap in a new weights set. In-flight batches finish on the old model; the next batch uses the new.

        Two copies of the policy are kept (double buffering): an update is loaded into the idle copy, in place,
        which then becomes the served one, so an update copies only the tensors it carries, never the whole
        model. A partial update (LoRA adapters, or whatever the policy trains) must carry every tensor that
        changes in training (``sync_state_dict``); the rest never changes after the first full set."""
        if version < self.version:
            raise InvalidRequest(f"version: stale weights version {version} (serving {self.version})")
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
        with _lock_of(target):  # a batch still running on this copy finishes first
            target.load_state_dict(state, strict=False)
            target.eval()
        if self.decoder is not None:  # vLLM's copy of the language model follows (rows in flight finish first)
            self.decoder.update(target, version)
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

    @torch.inference_mode()
    def act_now(self, obs: dict[str, np.ndarray], deterministic: bool, instructions=None,
                noise_keys=None) -> ActResult:
        """Run the policy on one batch right now (validated). With ``noise_keys`` (one per row) each row's
        sampling noise comes from its key (rlfleet.wire.noise), so the row's action does not depend on the batch."""
        if self.decoder is not None:  # (submit validates)
            return self.submit(obs, deterministic, 0, instructions, None, noise_keys).result()
        rows = self.validate_obs(obs)
        keys = self.check_noise_keys(noise_keys, rows)
        block = self.batch_invariant_rows
        if block > 0 and rows % block:  # a whole number of blocks: the kernels then treat every row alike
            pad = block - rows % block
            obs = {k: np.concatenate([v, np.repeat(v[:1], pad, 0)]) for k, v in obs.items()}
            instructions = None if instructions is None else [*instructions, *[instructions[0]] * pad]
            keys = None if keys is None else np.concatenate([keys, np.repeat(keys[:1], pad)])
        with self._swap_lock:
            model, version = self.model, self.version
            lock = _lock_of(model)
            lock.acquire()  # held while the batch runs: an update never loads into a model in use
        try:
            tobs = {k: v.to(self.device) for k, v in to_torch_obs(obs).items()}
            with model.precision():
                out = model.act(tobs, deterministic, instructions, noise=None if keys is None else RowNoise(keys))
        finally:
            lock.release()
        numpy = lambda t: t[:rows].detach().cpu().numpy()  # noqa: E731
        return ActResult(numpy(out.actions.float()), numpy(out.log_probs.float()),
                         None if out.values is None else numpy(out.values.float()), version,
                         {k: numpy(v) for k, v in out.forward_inputs.items()})

    # --- batching ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.decoder is not None:
            self.decoder.start()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self.decoder is not None:
            self.decoder.stop()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    def open_stream(self) -> int:
        with self._streams_lock:
            self._open_streams += 1
            return id(threading.current_thread()) ^ int(time.monotonic_ns())

    def close_stream(self) -> None:
        with self._streams_lock:
            self._open_streams -= 1

    def submit(self, obs: dict[str, np.ndarray], deterministic: bool, stream: int = 0, instructions=None,
               trace_context: dict[str, str] | None = None, noise_keys=None) -> Future:
        rows = self.validate_obs(obs)
        if instructions and len(instructions) != rows:
            raise InvalidRequest(f"instructions: {len(instructions)} texts for {rows} observation rows")
        keys = self.check_noise_keys(noise_keys, rows)
        fut: Future = Future()
        if self.decoder is not None:
            self.decoder.submit(_Request(obs, list(instructions) if instructions else None, deterministic, rows, stream,
                                         fut, time.monotonic(), trace_context or {}, keys))
            self.requests_served += 1
            return fut
        self._queue.put(_Request(obs, list(instructions) if instructions else None, deterministic, rows, stream, fut,
                                 time.monotonic(), trace_context or {}, keys))
        return fut

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

    def _run(self, batch: list[_Request]) -> None:
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
                with tracing.step_span("act_batch", parents=[r.trace_context for r in group],
                                       **{"rlfleet.rows": rows, "rlfleet.requests": len(group)}):
                    res = self.act_now(obs, deterministic, texts, keys)
                tracing.record("rlfleet.inference.batch_rows", rows, "1", "rows per act batch")
                tracing.record("rlfleet.inference.queue_wait", t0 - group[0].t_submit, "s",
                               "time the oldest request of a batch waited")
                tracing.record("rlfleet.inference.forward_latency", time.monotonic() - t0, "s", "one act batch")
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


_IN_USE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_IN_USE_GUARD = threading.Lock()


def _lock_of(model) -> threading.Lock:
    """The lock that a batch holds on a policy copy while it runs on it."""
    with _IN_USE_GUARD:
        lock = _IN_USE.get(model)
        if lock is None:
            lock = _IN_USE[model] = threading.Lock()
        return lock

"""The inference engine (no gRPC): ``InferenceEngine``, the core, which owns what is the same for every backend:
the versioned policy (two copies, double buffered; checks of a weights set and of the spaces against memory) and the
validation of a request (observations, instructions, noise keys), acting through one backend.

Beside it, one role per module: the backend interface (services.inference.backend: ``InferenceBackend`` and its
types), the factory that builds the backend ``rollout.backend`` names (services.inference.factory), the built-in
``hf`` backend (services.inference.batcher: ``DynamicBatcher``) and the optional ``vllm`` one
(services.inference.vllm_decoder: ``VLLMDecoder``, vLLM's engine decoding the action tokens).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from rlfleet.errors import InvalidRequest
from rlfleet.policies import build_policy, footprint, local
from rlfleet.wire.codec import PolicyOutput
from rlfleet.wire.spaces import TensorSpace
from services.inference.backend import ActRequest, BackendOptions, InferenceBackend, policy_lock
from services.inference.factory import make_inference_backend

log = logging.getLogger("rlfleet.inference")


MAX_WEIGHTS_VERSION = local.MAX_WEIGHTS_VERSION  # (rlfleet.policies.local: the checks every policy holder makes)


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
    def __init__(
        self,
        model_cfg,
        *,
        normalize_obs: bool = True,
        max_batch_size: int = 256,
        max_wait_ms: float = 1.0,
        device: str = "cpu",
        logprob_type: str = "action_level",
        batch_invariant_rows: int = 0,
        backend: str = "hf",
        seed: int = 0,
        weights_precision: str = "fp32",
        memory_budget_bytes: int | None = None,
        on_fatal=None,
        step_spans: bool = False,
    ):
        self.model_cfg = model_cfg
        # bytes a policy (two copies) may take here; None: what the device has available when the spaces arrive
        self.memory_budget_bytes = memory_budget_bytes
        self.weights_dtype = torch.bfloat16 if weights_precision == "bf16" else None
        # how requests are acted on (rollout.backend); on_fatal: called when the backend is lost for good;
        # step_spans: a span per act batch (tracing set up, telemetry.step_spans)
        self.backend: InferenceBackend = make_inference_backend(
            backend,
            BackendOptions(
                max_batch_size=max_batch_size,
                max_wait_ms=max_wait_ms,
                batch_invariant_rows=batch_invariant_rows,
                device=device,
                seed=seed,
                on_fatal=on_fatal,
                step_spans=step_spans,
            ),
        )
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
    def set_weights(
        self,
        version: int,
        state: dict[str, torch.Tensor],
        *,
        obs_specs: dict[str, TensorSpace] | None = None,
        action_dim: int | None = None,
        partial: bool = False,
    ) -> int:
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
            target = build_policy(
                self.model_cfg, obs_specs, action_dim, self.normalize_obs, self.logprob_type, device=self.device
            )
            if self.weights_dtype is not None:  # rollout.weights_precision: bf16: nothing trains here, so the
                for param in target.parameters():  # served copies may hold their parameters in bf16 (half the
                    param.data = param.data.to(self.weights_dtype)  # memory); buffers (statistics) stay fp32
        elif self.model is None:
            raise InvalidRequest("observation_space: the first weights set must describe the policy's spaces")
        else:
            target = self._spare
        self._check_state(
            state, {n: tuple(t.shape) for n, t in target.state_dict().items()}, partial=partial and not rebuild
        )
        local.check_finite(state)
        with policy_lock(target):  # a batch still running on this copy finishes first
            target.load_state_dict(state, strict=False)
            target.eval()
            local.for_acting(target)
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
        local.check_version(version, self.version)

    def _plan(self, obs_specs: dict[str, TensorSpace], action_dim: int):
        """Before a (re)build for new spaces: their observation row, and the two copies of the policy they imply
        (double buffering), must fit this server's memory (``memory_budget_bytes``, or what is available).
        -> the planned state (rlfleet.policies.footprint.planned_state), or None where it cannot be planned."""
        row = footprint.observation_row_bytes(obs_specs)
        planned = footprint.planned_state(self.model_cfg, obs_specs, action_dim, self.normalize_obs, self.logprob_type)
        if planned is not None:
            copy = footprint.state_bytes(planned, self.weights_dtype)
            spaces = ", ".join(f"{k}{list(s.shape)}" for k, s in obs_specs.items())
            footprint.check_fits(
                2 * copy + self.max_batch_size * row,
                f"observation_space: a {self.model_cfg.model_type} policy for spaces {spaces} "
                f"(action {action_dim}-D: two copies of {copy / 2**30:.2f} GiB, and a batch)",
                self.device,
                self.memory_budget_bytes,
            )
        return planned

    def _check_state(self, state: dict[str, torch.Tensor], shapes: dict[str, tuple], partial: bool) -> None:
        """A weights set against the policy's tensors: no unknown names, every tensor in a full set, their shapes."""
        local.check_state(state, shapes, partial, self.model_cfg.model_type)

    # --- acting -----------------------------------------------------------------------------------------------
    def validate_obs(self, obs: dict[str, np.ndarray]) -> int:
        return local.validate_obs(obs, self.obs_specs if self.model is not None else None)

    @staticmethod
    def check_noise_keys(noise_keys, rows: int) -> np.ndarray | None:
        return local.check_noise_keys(noise_keys, rows)

    def _request(
        self,
        obs: dict[str, np.ndarray],
        deterministic: bool,
        stream: int,
        instructions,
        trace_context: dict[str, str] | None,
        noise_keys,
    ) -> ActRequest:
        """A validated request (observations, instructions and noise keys checked against the served policy)."""
        rows = self.validate_obs(obs)
        if instructions and len(instructions) != rows:
            raise InvalidRequest(f"instructions: {len(instructions)} texts for {rows} observation rows")
        keys = self.check_noise_keys(noise_keys, rows)
        return ActRequest(
            obs,
            list(instructions) if instructions else None,
            deterministic,
            rows,
            stream,
            Future(),
            time.monotonic(),
            trace_context or {},
            keys,
        )

    def act_now(
        self, obs: dict[str, np.ndarray], deterministic: bool, instructions=None, noise_keys=None
    ) -> PolicyOutput:
        """Act on one batch right now (validated). With ``noise_keys`` (one per row) each row's sampling noise comes
        from its key (rlfleet.wire.codec), so the row's action does not depend on the batch."""
        return self.backend.act(self._request(obs, deterministic, 0, instructions, None, noise_keys))

    def submit(
        self,
        obs: dict[str, np.ndarray],
        deterministic: bool,
        stream: int = 0,
        instructions=None,
        trace_context: dict[str, str] | None = None,
        noise_keys=None,
    ) -> Future:
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
        return InferenceInfo(
            self.model_cfg.model_type,
            self.version,
            sum(p.numel() for p in model.parameters()) if model is not None else 0,
            stats.requests_served,
            stats.batches_run,
            stats.mean_batch_rows,
        )

"""A policy held in the process that acts with it (issue 37, collocated acting), and the checks every holder of a
served policy makes: the inference engine (services.inference.engine) and a collocated env server
(``cluster.component_placement.rollout: env``) both use them, so a weights set, an observation batch and the noise
keys are checked, and a batch is acted on, the same way in either place.

``LocalPolicy`` is the small holder: one policy copy, set from published weights (a full set describing the spaces
first, then full or partial updates by version), acting on one batch at a time, deterministic or sampled, each row's
noise from its key (rlfleet.wire.codec's noise keys: the same actions as the inference server's for the same seed).
It has no batcher and no second copy: an update waits for the batch in progress (the policies it is meant for, the
MLP ones, load in well under a millisecond).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from rlfleet.errors import FailedPrecondition, InvalidRequest
from rlfleet.wire.codec import PolicyOutput, RowNoise
from rlfleet.wire.spaces import TensorSpace

# a weights version is the learner's count of updates, one per epoch (a resumed learner goes on from its
# checkpoint's): no run reaches 2**31 (68 years at an epoch a second); beyond it a version is made up
MAX_WEIGHTS_VERSION = 2**31 - 1


def check_version(version: int, serving: int) -> None:
    """A weights set's version, before its tensors are read: a learner's (0..MAX_WEIGHTS_VERSION), and not older
    than the one served (the same again is a republish)."""
    if not 0 <= version <= MAX_WEIGHTS_VERSION:
        raise InvalidRequest(
            f"version: {version} is no weights version (0..{MAX_WEIGHTS_VERSION}: the learner's "
            f"count of updates, one per epoch); serving {serving}"
        )
    if version < serving:
        raise InvalidRequest(f"version: stale weights version {version} (serving {serving})")


def check_state(state: dict[str, torch.Tensor], shapes: dict[str, tuple], partial: bool, model_type: str) -> None:
    """A weights set against the policy's tensors: no unknown names, every tensor in a full set, their shapes,
    finite values."""
    unknown = sorted(set(state) - set(shapes))
    if unknown:
        raise InvalidRequest(f"weights: unknown tensor '{unknown[0]}' for this {model_type} policy")
    if not partial:
        missing = sorted(set(shapes) - set(state))
        if missing:
            raise InvalidRequest(f"weights: full set is missing tensor '{missing[0]}'")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise InvalidRequest(
                f"weights['{name}']: shape {list(tensor.shape)} where {list(shapes[name])} was expected"
            )


def check_finite(state: dict[str, torch.Tensor]) -> None:
    for name, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise InvalidRequest(f"weights['{name}']: non-finite values")


def for_acting(model) -> None:
    """``model`` only acts from now on (an env server's or an inference server's copy): its modules that can keep
    numbers from call to call while their buffers stay as they are do (``RunningMeanStd.keep_for_acting``)."""
    for m in model.modules():
        if hasattr(m, "keep_for_acting"):
            m.keep_for_acting = True


def validate_obs(obs: dict[str, np.ndarray], specs: dict[str, TensorSpace] | None) -> int:
    """An observation batch against the served policy's spaces -> its rows."""
    if specs is None:
        raise FailedPrecondition("no policy weights loaded yet (the learner publishes them at start)")
    if set(obs) != set(specs):
        raise InvalidRequest(f"observations: keys {sorted(obs)} do not match the policy's {sorted(specs)}")
    n = None
    for key, arr in obs.items():
        spec = specs[key]
        if arr.ndim != len(spec.shape) + 1 or tuple(arr.shape[1:]) != spec.shape:
            raise InvalidRequest(
                f"observations['{key}']: shape {list(arr.shape)} where {['N', *spec.shape]} was expected"
            )
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


def check_noise_keys(noise_keys, rows: int) -> np.ndarray | None:
    if noise_keys is None or len(noise_keys) == 0:
        return None
    if len(noise_keys) != rows:
        raise InvalidRequest(f"noise_keys: {len(noise_keys)} keys for {rows} observation rows")
    return np.asarray(noise_keys, dtype=np.uint64)


@torch.inference_mode()
def forward(
    model, obs: dict[str, np.ndarray], deterministic: bool, instructions, keys, device, block: int, version: int
) -> PolicyOutput:
    """One batch through ``model`` (the caller holds whatever lock keeps its weights still). With ``keys`` (one per
    row) each row's sampling noise comes from its key (rlfleet.wire.codec), so the row's action does not depend on
    the batch; ``block`` > 0 pads the batch to a whole number of blocks (the kernels then treat every row alike)."""
    from rlfleet.policies.models.actor_critic import to_torch_obs

    rows = next(iter(obs.values())).shape[0]
    if block > 0 and rows % block:
        pad = block - rows % block
        obs = {k: np.concatenate([v, np.repeat(v[:1], pad, 0)]) for k, v in obs.items()}
        instructions = None if instructions is None else [*instructions, *[instructions[0]] * pad]
        keys = None if keys is None else np.concatenate([keys, np.repeat(keys[:1], pad)])
    tobs = {k: v.to(device) for k, v in to_torch_obs(obs).items()}
    with model.precision():
        out = model.act(tobs, deterministic, instructions, noise=None if keys is None else RowNoise(keys))
    return out.to_numpy(version, rows)


class LocalPolicy:
    """The policy of ``model_cfg`` in this process, set from published weights; ``act_now`` acts on one batch
    (the interface rlfleet.wire.clients.LocalPolicyClient calls)."""

    def __init__(
        self,
        model_cfg,
        *,
        normalize_obs: bool = True,
        logprob_type: str = "action_level",
        device: str = "cpu",
        batch_invariant_rows: int = 0,
        weights_precision: str = "fp32",
    ):
        self.model_cfg = model_cfg
        self.normalize_obs, self.logprob_type = normalize_obs, logprob_type
        self.device = torch.device(device)
        self.batch_invariant_rows = batch_invariant_rows
        self.weights_dtype = torch.bfloat16 if weights_precision == "bf16" else None
        self.model = None
        self.obs_specs: dict[str, TensorSpace] | None = None
        self.action_dim: int | None = None
        self.version = -1
        self.requests_served = 0
        self._lock = threading.Lock()  # an update waits for the batch in progress, and a batch for an update
        self._changed = threading.Condition(self._lock)  # notified when a weights set lands (wait_for_version)

    def check_version(self, version: int) -> None:
        check_version(version, self.version)

    def set_weights(
        self,
        version: int,
        state: dict[str, torch.Tensor],
        *,
        obs_specs: dict[str, TensorSpace] | None = None,
        action_dim: int | None = None,
        partial: bool = False,
    ) -> int:
        from rlfleet.policies import build_policy

        check_finite(state)
        with self._lock:
            self.check_version(version)
            rebuild = obs_specs is not None and (obs_specs != self.obs_specs or action_dim != self.action_dim)
            if rebuild:
                model = build_policy(self.model_cfg, obs_specs, action_dim, self.normalize_obs, self.logprob_type)
                model = model.to(self.device)
                if self.weights_dtype is not None:  # rollout.weights_precision: bf16 (parameters only)
                    for param in model.parameters():
                        param.data = param.data.to(self.weights_dtype)
            elif self.model is None:
                raise InvalidRequest("observation_space: the first weights set must describe the policy's spaces")
            else:
                model = self.model
            shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
            check_state(state, shapes, partial and not rebuild, self.model_cfg.model_type)
            model.load_state_dict(state, strict=False)
            model.eval()
            for_acting(model)
            self.model, self.version = model, version
            if rebuild:
                self.obs_specs, self.action_dim = dict(obs_specs), action_dim
            self._changed.notify_all()
        return version

    def wait_for_version(self, version: int, timeout: float, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Block until weights of at least ``version`` are set (-> True), or ``timeout`` seconds pass or
        ``should_stop()`` says so (-> False; it is asked about every 50 ms)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.version < version:
                left = deadline - time.monotonic()
                if left <= 0 or should_stop():
                    return False
                self._changed.wait(min(left, 0.05))
        return True

    def act_now(
        self, obs: dict[str, np.ndarray], deterministic: bool, instructions=None, noise_keys=None
    ) -> PolicyOutput:
        """Act on one batch right now (validated, like the inference engine's ``act_now``)."""
        with self._lock:
            rows = validate_obs(obs, self.obs_specs if self.model is not None else None)
            if instructions and len(instructions) != rows:
                raise InvalidRequest(f"instructions: {len(instructions)} texts for {rows} observation rows")
            keys = check_noise_keys(noise_keys, rows)
            out = forward(
                self.model,
                obs,
                deterministic,
                list(instructions) if instructions else None,
                keys,
                self.device,
                self.batch_invariant_rows,
                self.version,
            )
            self.requests_served += 1
            return out

    @property
    def num_parameters(self) -> int:
        model = self.model
        return sum(p.numel() for p in model.parameters()) if model is not None else 0

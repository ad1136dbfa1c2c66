"""The inference backend factory: the implementation of the backend ``rollout.backend`` names (a name of
rlfleet.policies.backends.BACKENDS, the registry), built by its entry of ``IMPLEMENTATIONS``. The built-in ``hf``
backend (services.inference.batcher) is imported with this module; the optional ``vllm`` one
(services.inference.vllm_decoder) only when it is asked for: it needs vLLM's environment.
"""

from __future__ import annotations

from typing import Callable

from rlfleet.policies.backends import BACKENDS
from rlfleet.registry import UnknownName, lookup
from services.inference.backend import BackendOptions, InferenceBackend
from services.inference.batcher import DynamicBatcher


def _hf(options: BackendOptions) -> InferenceBackend:
    return DynamicBatcher(
        max_batch_size=options.max_batch_size,
        max_wait_ms=options.max_wait_ms,
        batch_invariant_rows=options.batch_invariant_rows,
        device=options.device,
        on_fatal=options.on_fatal,
        step_spans=options.step_spans,
    )


def _vllm(options: BackendOptions) -> InferenceBackend:
    from services.inference.vllm_decoder import VLLMDecoder

    return VLLMDecoder(max_num_seqs=options.max_batch_size, seed=options.seed, on_fatal=options.on_fatal)


# the implementation of each backend of the registry (rlfleet.policies.backends.BACKENDS), by its name
IMPLEMENTATIONS: dict[str, Callable[[BackendOptions], InferenceBackend]] = {"hf": _hf, "vllm": _vllm}


def make_inference_backend(name: str, options: BackendOptions | None = None) -> InferenceBackend:
    """The backend ``rollout.backend`` names: a name of rlfleet.policies.backends.BACKENDS, built by its entry of
    IMPLEMENTATIONS."""
    try:
        lookup(BACKENDS, name, "backend")
        build = lookup(IMPLEMENTATIONS, name, "backend")
    except UnknownName as exc:
        raise ValueError(f"rollout.backend: {exc}") from None
    return build(options or BackendOptions())

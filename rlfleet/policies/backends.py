"""Inference backends by ``rollout.backend``: the one place that says which backends exist and which Python
environment its inference server runs in; which policies each serves is in the families' entries
(rlfleet.policies.families). Torch-free: the coordinator and config validation import it.

- ``hf``: the policy's own ``act`` (transformers / torch) behind rlfleet's dynamic batcher, in the main environment.
- ``vllm``: token-decoding VLAs (``openvla``) decoded by vLLM's engine (continuous batching, paged KV cache): the
  vision backbone, projector and value head run in rlfleet's policy code, vLLM decodes the action tokens from the
  prompt's embeddings. The server runs from its own environment (vLLM pins its own torch and transformers),
  built on first use like a simulator's (rlfleet.simulators: INFERENCE_ENVIRONMENTS).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.policies.families import FAMILIES, served_by
from rlfleet.registry import lookup
from rlfleet.simulators import INFERENCE_ENVIRONMENTS, Environment


@dataclass(frozen=True)
class Backend:
    name: str
    environment: Environment | None  # None: the main environment
    description: str

    @property
    def model_types(self) -> tuple[str, ...]:
        """actor.model.model_type values it serves: the families whose entry names it (rlfleet.policies.families)."""
        return served_by(self.name)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("hf", None, "the policy's own act() behind rlfleet's dynamic batcher"),
        Backend(
            "vllm",
            INFERENCE_ENVIRONMENTS["vllm"],
            "vLLM's engine decodes the action tokens (continuous batching over every Act stream)",
        ),
    )
}


def get_backend(name: str) -> Backend:
    return lookup(BACKENDS, name, "backend")


def check_backend(name: str, model_type: str) -> str | None:
    """None when ``name`` serves ``model_type``, else the reason it does not."""
    backend = get_backend(name)
    if model_type not in backend.model_types:
        family = FAMILIES.get(model_type)
        why = family.why_not.get(name, "") if family is not None else ""
        return (
            f"backend '{name}' does not serve model_type '{model_type}'"
            + (f" ({why})" if why else "")
            + f"; it serves {', '.join(backend.model_types)}"
        )
    return None


def describe(configured: str | None = None) -> list[dict]:
    """Rows for `coordinatorctl envs`: each inference backend that runs in an environment of its own."""
    from rlfleet.simulators import environments

    return [
        {
            "simulator": b.name,
            "environment": b.environment.name,
            "installed": environments.is_installed(b.environment, configured),
            "path": str(environments.env_path(b.environment, configured)),
            "description": f"inference backend (rollout.backend={b.name}): {b.description}",
            "examples": list(b.model_types),
            "notes": b.environment.notes,
        }
        for b in BACKENDS.values()
        if b.environment is not None
    ]

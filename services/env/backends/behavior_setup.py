"""BEHAVIOR-1K's host side (the backend is services.env.backends.behavior, which imports this module, never the other
way round): ``preflight`` checks in about a second, from any environment (no simulator import), that this host has
the RTX-class NVIDIA GPU that OmniGibson's Isaac Sim needs, naming what is missing.
"""

from __future__ import annotations

import shutil
import subprocess

from services.env.backends.base import BackendUnavailable

RTX_MARKERS = ("RTX", "L40", "L4", "A10", "A40", "A6000", "A5000", "A4000", "T4", "Quadro")


def gpu_names() -> list[str]:
    """NVIDIA GPUs on this host (empty when there is no driver)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split(":", 1)[1].split("(")[0].strip() for line in out.splitlines() if line.startswith("GPU")]


def preflight(cfg=None) -> None:
    """Raise BackendUnavailable, naming what is missing, when OmniGibson cannot run on this host."""
    gpus = gpu_names()
    if not gpus:
        raise BackendUnavailable(
            "Behavior/OmniGibson needs NVIDIA Isaac Sim, which needs an NVIDIA RTX-class GPU with its driver; "
            "this machine has none (nvidia-smi not found or lists no GPU). Run the behavior env servers on a GPU "
            "node (cluster.component_placement / Kubernetes) or point cluster.external_env_addresses at an "
            "OmniGibson EnvService running there"
        )
    if not any(m in name for name in gpus for m in RTX_MARKERS):
        raise BackendUnavailable(
            f"Behavior/OmniGibson needs an RTX-class GPU (ray-tracing cores) for Isaac Sim's renderer; this "
            f"machine has {', '.join(gpus)}, which Isaac Sim does not support for rendering"
        )

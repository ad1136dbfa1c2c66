"""How much memory a run's policy copies need, known before anything is allocated.

The local launcher checks it before it starts a service (``coordinatorctl start`` fails in seconds instead of a
service being killed for memory, restarted and killed again): a real-size VLA config on a machine without the memory
is told so with the numbers. Parameters come from building the configured policy on PyTorch's meta device (shapes,
no storage), or, for a checkpoint directory, from its safetensors headers.
"""

from __future__ import annotations

import json
import pathlib
import struct
from dataclasses import dataclass

VLA_TYPES = ("openvla", "openvla_oft", "openpi")
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}
GB = 1e9


@dataclass(frozen=True)
class Footprint:
    parameters: int
    trainable: int

    def inference_bytes(self, weights_precision: str) -> int:
        """One inference server: two copies of the policy (double buffering)."""
        return 2 * self.parameters * (2 if weights_precision == "bf16" else 4)

    def learner_bytes(self, reference_copy: bool = False) -> int:
        """The learner: fp32 weights, plus gradient and Adam's two moments for what trains, plus (``reference_copy``:
        algorithm.kl_beta > 0 without LoRA) a frozen fp32 copy of the starting weights as the KL reference."""
        return 4 * self.parameters + 12 * self.trainable + (4 * self.parameters if reference_copy else 0)


def checkpoint_parameters(path: pathlib.Path) -> int:
    """Element count over a checkpoint directory's safetensors files, read from their headers only."""
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for d in entry["shape"]:
                    count *= int(d)
                total += count
    return total


def estimate(model_cfg, logprob_type: str) -> Footprint:
    """Parameters and trainable parameters of the configured VLA policy, without allocating it."""
    import torch

    from rlfleet.models import ObsSpec
    from rlfleet.policies import build_policy

    if model_cfg.model_path:
        path = pathlib.Path(model_cfg.model_path)
        n = checkpoint_parameters(path)
        if n:
            # LoRA at the usual ranks trains 1-2% (rank 32 on OpenVLA-7B: 1.1%); a full fine-tune everything
            return Footprint(n, n // 50 if model_cfg.is_lora else n)
    sizes = model_cfg.openpi if model_cfg.model_type == "openpi" else model_cfg.vla
    size = int(sizes.image_size)
    specs = {k: ObsSpec((size, size, 3), "uint8") for k in [model_cfg.image_key or "image",
                                                          *(model_cfg.extra_image_keys or ())]}
    specs["state"] = ObsSpec((1,), "float32")
    with torch.device("meta"):
        policy = build_policy(model_cfg, specs, 1, True, logprob_type)
    params = sum(p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    return Footprint(params, trainable)


def available_memory() -> tuple[str, float]:
    """(where, bytes) the local launcher's services would allocate in: the smallest GPU, or this host's RAM. GPUs
    are asked through nvidia-smi, so the coordinator never creates a CUDA context of its own."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout.split()
            sizes = [float(v) * 2 ** 20 for v in out if v.replace(".", "", 1).isdigit()]
        except (OSError, subprocess.SubprocessError):
            sizes = []
        if sizes:
            return f"the smallest of {len(sizes)} GPU(s)", min(sizes)
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return "this machine's available RAM (no GPU)", float(line.split()[1]) * 1024
    return "this machine", float("inf")


def check(cfg, *, inference: bool = True) -> str | None:
    """None when the policy copies of a local run fit where they would live; else why not, with the numbers.
    ``inference=False``: the learner's copy only (supervised fine-tuning)."""
    model = cfg.actor.model
    if model.model_type not in VLA_TYPES:
        return None
    fp = estimate(model, cfg.algorithm.logprob_type)
    # RL with algorithm.kl_beta > 0 keeps the starting model as the KL reference (LoRA: the base with adapters off)
    reference_copy = inference and cfg.algorithm.kl_beta > 0 and not model.is_lora
    inference = fp.inference_bytes(cfg.rollout.weights_precision) if inference else 0
    learner = fp.learner_bytes(reference_copy)
    where, have = available_memory()
    on_gpu = where.startswith("the smallest")
    # on GPUs each service has a device of its own; on one host they all share its RAM
    need = max(inference, learner) if on_gpu else cfg.cluster.num_inference_servers * inference + learner
    if need <= have:
        return None
    servers = (f"each inference server holds 2 copies ({inference / GB:.1f} GB, rollout.weights_precision="
               f"{cfg.rollout.weights_precision}) and " if inference else "")
    return (f"the {model.model_type} policy of this config has {fp.parameters / 1e9:.2f}B parameters "
            f"({fp.trainable / 1e9:.3f}B trained): {servers}the learner {learner / GB:.1f} GB (fp32 weights, gradients and Adam state of what trains"
            f"{', a frozen copy as the KL reference of algorithm.kl_beta' if reference_copy else ''}); that is "
            f"{need / GB:.1f} GB where {where} has {have / GB:.1f} GB. Run it on a machine with the memory (GPU "
            f"nodes: coordinatorctl deploy k8s), or use a tiny config (e.g. pandapickcube_vision_ppo_openvla_tiny)")

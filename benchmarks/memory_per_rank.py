"""Learner memory per rank of the real-size VLA configs, as the start-up memory check estimates it.

    python -m benchmarks.memory_per_rank [key=value ...] [--ranks 1 2 4 8] [--gpu-gb 80]

Builds each real-size config on PyTorch's meta device (shapes only, no memory; rlfleet/policies/footprint.py) and
prints, per variant and learner world size on GPUs, the parameters, what trains, and one rank's share: its shard of
the fp32 weights, gradients and Adam moments (FSDP2 shards them evenly over the ranks), the FSDP units it gathers
whole in bf16 (over 2 or more ranks), the bf16 copies autocast makes of the weights (one rank: the learner does not
shard a group of one, so its weights stay fp32 while they run), the activations of one micro batch
(actor.micro_batch_size rows) and, with algorithm.kl_beta > 0 and no LoRA (e.g. the override algorithm.kl_beta=0.05),
its shard of the frozen KL reference, and the optimizer step's temporaries (10% of the rank's fp32 trainable weights,
measured on an H200). Estimates, not measurements: the per-rank total is compared with the GPU's
memory as given (default an 80 GB H100), without the CUDA context and the allocator's fragmentation, which take some
GB more. Runs in seconds on a CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlfleet.config import load_config  # noqa: E402
from rlfleet.policies import footprint  # noqa: E402

GB = footprint.GB
# (model, fine-tune, config, overrides)
VARIANTS = [
    ("π0 3.3B", "full", "metaworld_mt50_ppo_pi0", []),
    ("OpenVLA-7B", "full", "maniskill_pickcube_ppo_openvla", ["actor.model.is_lora=false"]),
    ("OpenVLA-7B", "LoRA r32", "maniskill_pickcube_ppo_openvla", ["actor.model.is_lora=true"]),
    ("OpenVLA-OFT 7B", "full", "libero_spatial_grpo_openvla_oft", ["actor.model.is_lora=false"]),
]


def rows(ranks: list[int], gpu_bytes: float, extra: list[str]) -> list[list[str]]:
    out = []
    for model, tune, name, overrides in VARIANTS:
        cfg = load_config(name, [*overrides, *extra])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fp = footprint.estimate(cfg.actor.model, cfg.algorithm.logprob_type)
        reference = cfg.algorithm.kl_beta > 0 and not cfg.actor.model.is_lora
        micro = cfg.actor.micro_batch_size
        for world in ranks:
            parts = fp.rank_parts(world, gpu=True, reference_copy=reference, rows=micro)
            total = sum(parts.values())
            out.append(
                [
                    model,
                    tune,
                    f"`{name}`",
                    str(world),
                    f"{fp.parameters / 1e9:.2f}B",
                    f"{fp.trainable / 1e9:.3f}B",
                    f"{parts['sharded'] / GB:.1f}",
                    f"{parts['reference'] / GB:.1f}",
                    f"{parts['gathered'] / GB:.1f}",
                    f"{parts['autocast'] / GB:.1f}",
                    f"{parts['activations'] / GB:.1f} ({micro} rows)",
                    f"{parts['transient'] / GB:.1f}",
                    f"**{total / GB:.1f}**",
                    "yes" if total <= gpu_bytes else "no",
                ]
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8], help="learner world sizes")
    ap.add_argument("--gpu-gb", type=float, default=80.0, help="one GPU's memory in GB (1e9 bytes)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides applied to every config")
    args = ap.parse_args()
    table = rows(args.ranks, args.gpu_gb * GB, args.overrides)
    head = [
        "model",
        "fine-tune",
        "config",
        "ranks",
        "parameters",
        "trained",
        "weights+grads+Adam shard (GB)",
        "KL ref. shard (GB)",
        "gathered units (GB)",
        "autocast copies (GB)",
        "activations (GB)",
        "step temporaries (GB)",
        "per rank (GB)",
        f"fits {args.gpu_gb:g} GB",
    ]
    if all(row[7] == "0.0" for row in table):  # no KL reference anywhere: leave its column out
        head, table = head[:7] + head[8:], [row[:7] + row[8:] for row in table]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in table:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()

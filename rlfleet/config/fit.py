"""Does a run fit where it would run: the policy copies of a local run (inference servers, learner ranks) against
the smallest GPU or this host's RAM, from the per-rank estimates of rlfleet.policies.footprint and the learner's
placement (:func:`rlfleet.config.learner_layout`). The coordinator asks before starting anything."""

from __future__ import annotations

import dataclasses

from rlfleet.config import learner_layout, parse_placement
from rlfleet.policies import footprint

GB = footprint.GB


def learner_world_size(cfg) -> int:
    """The learner's ranks (:func:`rlfleet.config.learner_layout`: one per GPU of the actor placement, else
    ``cluster.learner_world_size`` CPU ranks)."""
    nnodes, per_node = learner_layout(cfg)
    return nnodes * per_node


def shared_gpu(cfg) -> tuple[int | None, int]:
    """(GPU, inference servers on it) for the GPU that holds a learner rank and the most inference servers, as the
    placement puts them (each server acts on the first GPU of its slice of the rollout range, a learner rank on its
    GPU of the actor range: RLinf's collocated `actor,rollout: 0`); (None, 0) where no GPU holds both."""
    cl = cfg.cluster
    placement = parse_placement(cl.component_placement, cl.num_nodes * cl.num_gpus_per_node)
    learner, ranks, n = set(placement["actor"]), placement["rollout"], int(cl.num_inference_servers)
    counts: dict[int, int] = {}
    for i in range(n):
        mine = ranks[i * (len(ranks) // n) : (i + 1) * (len(ranks) // n)] if ranks and len(ranks) >= n else ranks
        if mine and mine[0] in learner:
            counts[mine[0]] = counts.get(mine[0], 0) + 1
    if not counts:
        return None, 0
    gpu = max(counts, key=lambda g: (counts[g], -g))
    return gpu, counts[gpu]


def learner_footprint(cfg) -> footprint.Footprint:
    """The learner's footprint of ``cfg.actor.model`` (a VLA); with ``runner.only_eval`` (`coordinatorctl eval`) a
    learner that never trains or runs the policy: its weights only (no gradients, Adam state, autocast copies,
    activations or optimizer temporaries)."""
    fp = footprint.estimate(cfg.actor.model, cfg.algorithm.logprob_type)
    if cfg.runner.only_eval:
        fp = dataclasses.replace(
            fp, trainable=0, largest_unit_trainable=0, root_trainable=0, activations_per_row=0, autocast_parameters=0
        )
    return fp


def check(cfg, *, inference: bool = True) -> str | None:
    """None when the policy copies of a local run fit where they would live; else why not, with the numbers (per
    learner rank, and the smallest number of ranks that would fit). ``inference=False``: the learner's copy only
    (supervised fine-tuning, one process)."""
    model = cfg.actor.model
    if not footprint.is_vla(model.model_type):  # (a family without a footprint function: no check)
        return None
    fp = learner_footprint(cfg)
    only_eval = bool(cfg.runner.only_eval)
    # RL with algorithm.kl_beta > 0 keeps the starting model as the KL reference (LoRA: the base with adapters off)
    reference_copy = inference and cfg.algorithm.kl_beta > 0 and not model.is_lora and not only_eval
    rl = inference  # the RL learner is a group of ranks; supervised fine-tuning runs as one process
    servers = cfg.cluster.num_inference_servers if rl else 0
    inference = fp.inference_bytes(cfg.rollout.weights_precision) if rl else 0
    where, have = footprint.available_memory()
    on_gpu = where.startswith("the smallest")
    world = learner_world_size(cfg) if rl else 1
    rows = cfg.actor.micro_batch_size if rl else cfg.sft.batch_size  # SFT: one batch per gradient step
    kw = dict(gpu=on_gpu, reference_copy=reference_copy, rows=rows)
    parts = fp.rank_parts(world, **kw)
    per_rank = sum(parts.values())
    # on GPUs each learner rank and each inference server has its device, unless the placement puts both on one
    # (then they add up there); on one host they all share its RAM
    gpu, sharing = shared_gpu(cfg) if on_gpu and rl else (None, 0)
    need = max(inference, per_rank + sharing * inference) if on_gpu else servers * inference + world * per_rank
    if need <= have:
        return None
    copies = (
        f"each inference server holds 2 copies ({inference / GB:.1f} GB, rollout.weights_precision="
        f"{cfg.rollout.weights_precision}) and "
        if inference
        else ""
    )
    sharded = f"its 1/{world} shard" if world > 1 else "unsharded"
    what = (
        "fp32 weights (runner.only_eval: no gradients or Adam state)"
        if only_eval
        else "fp32 weights, gradients and Adam state of what trains"
    )
    learner = [f"{parts['sharded'] / GB:.1f} GB of {what} ({sharded})"]
    if parts["reference"]:
        learner.append(
            f"{parts['reference'] / GB:.1f} GB of the KL reference (a frozen copy for algorithm.kl_beta, "
            f"sharded the same way)"
        )
    if parts["gathered"]:
        dtype = "bf16" if on_gpu and fp.precision == "bf16" else "fp32"
        learner.append(f"{parts['gathered'] / GB:.1f} GB of FSDP units gathered whole ({dtype})")
    if parts["autocast"]:
        learner.append(f"{parts['autocast'] / GB:.1f} GB of bf16 autocast copies of the weights")
    learner.append(f"{parts['activations'] / GB:.1f} GB of activations (estimated, a micro batch of {rows} rows)")
    if parts["transient"]:
        learner.append(f"{parts['transient'] / GB:.1f} GB of optimizer-step temporaries")
    learner = (
        f"the learner, per rank of {world}: {', '.join(learner)} = {per_rank / GB:.1f} GB for "
        f"{'one rank' if world == 1 else 'each rank'}"
    )
    total = "" if on_gpu or world == 1 else f"; its {world} ranks {world * per_rank / GB:.1f} GB together"
    if sharing:
        total = (
            f"; GPU {gpu} holds a learner rank and {sharing} inference server{'s' if sharing > 1 else ''} "
            f"(cluster.component_placement): {per_rank / GB:.1f} + {sharing * inference / GB:.1f} GB"
        )
    hint = ""
    if rl:
        fit = footprint.smallest_fitting_world(fp, have, on_gpu=on_gpu, others=servers * inference, **kw)
        if on_gpu and inference > have:
            hint = " An inference server's copies alone do not fit one GPU."
        elif sharing and per_rank <= have:
            hint = (
                f" Apart they fit: give the inference server{'s' if sharing > 1 else ''} a GPU of {'their' if sharing > 1 else 'its'} own "
                f"(cluster.component_placement, e.g. {{'env,rollout': 1, actor: 0}}), or lower what the learner "
                f"holds."
            )
        elif fit is not None and fit != world:
            each = fp.rank_bytes(fit, **kw)
            hint = (
                f" {fit} ranks need {each / GB:.1f} GB each: place the actor on {fit} GPUs "
                f"(cluster.component_placement, e.g. actor: 0-{fit - 1})."
                if on_gpu
                else f" With {fit} rank{'s' if fit > 1 else ''} ({each / GB:.1f} GB{' each' if fit > 1 else ''}) the "
                f"run would need {(servers * inference + fit * each) / GB:.1f} GB: set "
                f"cluster.learner_world_size={fit}."
            )
        elif fit is None:
            from omegaconf import OmegaConf

            lighter = footprint.get_family(model.model_type).lighter  # its ways to train less, the first one first
            unset = [o for o in lighter if str(OmegaConf.select(cfg, o.split("=")[0])).lower() != o.split("=")[1]]
            smaller = f"set {(unset or lighter or ('actor.model.gradient_checkpointing=true',))[0]}"
            floor = fp.rank_parts(2, **kw)  # what does not shrink with more ranks
            floor = floor["gathered"] + floor["autocast"] + floor["activations"]
            hint = (
                f" No number of ranks fits: the gathered units and activations alone are {floor / GB:.1f} GB per "
                f"rank (lower actor.micro_batch_size or {smaller})."
                if on_gpu
                else " Ranks on one machine share its RAM, and each adds its gathered units and activations: no "
                "number of ranks fits here."
            )
    return (
        f"the {model.model_type} policy of this config has {fp.parameters / 1e9:.2f}B parameters "
        f"({fp.trainable / 1e9:.3f}B trained): {copies}{learner}{total}; that is {need / GB:.1f} GB where {where} "
        f"has {have / GB:.1f} GB.{hint} Run it on a machine with the memory (GPU nodes: coordinatorctl deploy "
        f"k8s), or use a tiny config (e.g. pandapickcube_vision_ppo_openvla_tiny)"
    )

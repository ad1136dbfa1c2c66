"""The policy sharded over the learner's ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Every policy goes through ``shard_policy``: in a group of one it is returned as it is; over N ranks each transformer
block (the classes that transformers' models list in ``_no_split_modules``: the SigLIP / DINOv2 encoder layers, the
Llama or Gemma decoder layers, π0's action expert layers) becomes an FSDP unit, then the root (the MLP and CNN
policies: the root alone). Parameters, gradients and Adam state are then split evenly over the ranks; a unit's
parameters are gathered only while it runs. LoRA is applied before sharding (the frozen base is sharded, the
adapters train). On GPUs with ``actor.model.precision=bf16`` the gathered parameters are bf16 and gradients are
reduced in fp32 (``MixedPrecisionPolicy``); on CPU everything stays in the parameters' dtype.

Gradients are summed over the ranks (divide factor 1): the trainer divides each loss by the global sample count, so
N ranks step exactly as one process on the whole batch would.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from services.learner.group import RankGroup

# FSDP2 warns on every forward whose output is a view (a value head's squeeze): in-place edits of such an output
# would skip its backward hook; no policy edits its outputs in place
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

FORWARD_METHODS = ("evaluate",)  # policy methods the learner calls on the root instead of forward()


def block_classes(model: nn.Module) -> set[str]:
    """Names of the transformer block classes inside ``model`` (transformers' ``_no_split_modules``)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units before the root: every transformer block, innermost first."""
    names = block_classes(model)
    units = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    return list(reversed(units))  # children before their parents (fully_shard's order)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_policy(model: nn.Module, group: RankGroup) -> nn.Module:
    """Shard ``model`` (in place) over ``group``'s ranks; a group of one leaves it as it is."""
    if not group.distributed:
        return model
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    kw = {}
    if group.device.type == "cuda" and getattr(model, "autocast_dtype", None) == torch.bfloat16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in fsdp_units(model):
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    for name in FORWARD_METHODS:
        if hasattr(model, name):
            register_fsdp_forward_method(model, name)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # a sum over ranks: the loss is already divided by the global count
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM / AVG)
    return model


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard only)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather over the ranks for a DTensor: every rank must call it, in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def gather_buckets(state: dict[str, torch.Tensor], bucket_bytes: int, keep: bool) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of ``state`` (a state dict whose parameters may be DTensor shards), whole and on the CPU, a
    bucket of about ``bucket_bytes`` at a time: every rank gathers each bucket (collectives, same order); only
    where ``keep`` (rank 0) are they kept and yielded. A process never holds more than one gathered bucket."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in state.items():
        whole = full_tensor(t.detach())
        nbytes = whole.numel() * whole.element_size()
        if keep:
            bucket[name] = whole.cpu()
        size += nbytes
        del whole
        if size >= bucket_bytes:
            yield bucket
            bucket, size = {}, 0
    if bucket or size:
        yield bucket


def full_state_dict(model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """The whole state dict on the CPU where ``keep`` (rank 0); every rank must call it (for export)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in gather_buckets(model.state_dict(), 1 << 62, keep):
        out.update(bucket)
    return out

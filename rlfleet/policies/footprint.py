"""How much memory a run's policy copies need, known before anything is allocated.

The local launcher checks it before it starts a service (``coordinatorctl start`` fails in seconds instead of a
service being killed for memory, restarted and killed again): a real-size VLA config on a machine without the memory
is told so with the numbers. Parameters come from building the configured policy on PyTorch's meta device (shapes,
no storage), or, for a checkpoint directory, from its safetensors headers.

The learner is a group of ranks (torch.distributed; over N > 1 ranks FSDP2 ``fully_shard`` shards the policy as
services/learner/sharding.py does: every transformer block a unit, then the root), so its need is counted per rank
(:meth:`Footprint.rank_parts`), all of it an estimate made from the shapes and the config, not a measurement:

* ``sharded``: fp32 parameters (4 B each) + gradient and Adam's two moments of what trains (12 B each), divided by
  the world size (FSDP2 shards each tensor evenly over the ranks);
* ``reference``: with ``algorithm.kl_beta > 0`` and no LoRA, the frozen fp32 KL reference, 4 B per parameter, sharded
  the same way;
* ``gathered`` (N > 1): the FSDP units held whole. The units are the modules whose classes transformers lists in
  ``_no_split_modules`` (SigLIP / DINOv2 encoder layers and embeddings, Llama / Gemma decoder layers, ...); the
  rest (token tables, LM head, projector, heads) is the root unit, which FSDP2 keeps gathered from its forward to
  the end of its backward. Counted: the root and the largest unit, the next unit prefetched, all at b bytes (2 on a
  GPU with ``actor.model.precision: bf16``: FSDP2's bf16 gather; else 4), and the unsharded gradients of the root
  and that unit before their fp32 reduce-scatter (4 B, + b for the bf16 gradient it is cast from);
* ``autocast`` (``precision: bf16`` where the parameters stay fp32 while they run: one rank, which is not sharded,
  or CPU ranks): the bf16 copies autocast makes of the trained weights, cached for the whole forward (2 B each),
  and under LoRA without gradient checkpointing those of the frozen weights too (kept for backward);
* ``activations``: what one micro batch (``actor.micro_batch_size`` rows) keeps for backward, :func:`activation_bytes`.
"""

from __future__ import annotations

import math
import pathlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlfleet.policies.families import get_family, is_vla  # noqa: F401 - is_vla: which families are checked
from rlfleet.registry import load_object
from rlfleet.wire.limits import MAX_MESSAGE_BYTES
from rlfleet.wire.spaces import TensorSpace

if TYPE_CHECKING:  # annotations only: importing this module never imports torch
    import torch

_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}
GB = 1e9
ACTION_DIM = 7  # action dimensions assumed by the activation estimate (the env's are not in the config): arm + gripper
MAX_WORLD = 1024  # the largest learner world size the check looks at for a fitting one
# a checkpoint tensor inside a transformer block: "...layers.12.", "...encoder.layer.3.", timm's "...blocks.7."
_BLOCK_NAME = re.compile(r"^(.*?\.(?:layers|layer|blocks)\.\d+)\.")


@dataclass(frozen=True)
class Footprint:
    """Parameter counts of a policy, the sizes of its FSDP units and its activations per micro-batch row."""

    parameters: int
    trainable: int
    largest_unit: int = 0  # parameters of the largest FSDP unit below the root (a transformer block)
    largest_unit_trainable: int = 0  # ... of them trained
    root: int = 0  # parameters outside every unit: the root FSDP unit (token tables, LM head, projector, heads)
    root_trainable: int = 0  # ... of them trained
    activations_per_row: int = 0  # bytes kept for backward per micro-batch row (activation_bytes: an estimate)
    precision: str = "fp32"  # actor.model.precision: bf16 runs the forward under bf16 autocast
    autocast_parameters: int = 0  # weights whose bf16 autocast copies live through a forward (see the module doc)

    def inference_bytes(self, weights_precision: str) -> int:
        """One inference server: two copies of the policy (double buffering)."""
        return 2 * self.parameters * (2 if weights_precision == "bf16" else 4)

    def learner_bytes(self, reference_copy: bool = False) -> int:
        """Weights, gradients, Adam state (and the KL reference) of a one-rank learner, without the transient parts:
        fp32 weights, plus gradient and Adam's two moments for what trains, plus (``reference_copy``:
        algorithm.kl_beta > 0 without LoRA) a frozen fp32 copy of the starting weights as the KL reference."""
        return 4 * self.parameters + 12 * self.trainable + (4 * self.parameters if reference_copy else 0)

    def gathered_bytes(self, gather_bytes: int) -> int:
        """The FSDP units a rank holds whole at once: the root unit (gathered from its forward to the end of
        backward), the largest unit and the next one prefetched, ``gather_bytes`` per element (2: bf16 mixed
        precision, 4: fp32), and the unsharded gradients of the root and that unit before their fp32
        reduce-scatter (4 B, plus the bf16 gradient they are cast from)."""
        grad = 4 + (gather_bytes if gather_bytes != 4 else 0)
        return gather_bytes * (self.root + 2 * self.largest_unit) + grad * (
            self.root_trainable + self.largest_unit_trainable
        )

    def rank_parts(self, world: int, *, gpu: bool, reference_copy: bool = False, rows: int = 1) -> dict[str, int]:
        """Bytes one of ``world`` learner ranks holds, by part (the module doc): ``sharded``, ``reference``,
        ``gathered``, ``autocast``, ``activations`` (``rows`` rows of a micro batch) and, on a GPU, ``transient``. ``gpu``: each rank runs on
        a GPU (FSDP2 gathers in bf16 there with ``precision: bf16``), else on CPU."""
        world = max(1, int(world))
        bf16 = self.precision == "bf16"
        sharded_bf16 = gpu and bf16 and world > 1  # FSDP2's mixed precision: the weights run as bf16 already
        return {
            "sharded": math.ceil((4 * self.parameters + 12 * self.trainable) / world),
            "reference": math.ceil(4 * self.parameters / world) if reference_copy else 0,
            "gathered": self.gathered_bytes(2 if sharded_bf16 else 4) if world > 1 else 0,
            "autocast": 2 * self.autocast_parameters if bf16 and not sharded_bf16 else 0,
            "activations": int(rows) * self.activations_per_row,
            # on CUDA: the optimizer step's temporaries and the caching allocator's rounding, 10% of the
            # rank's fp32 trainable weights (measured 5-7% above the other parts on an H200:
            # docs/learner-ranks.md, the GPU test set)
            "transient": math.ceil(0.4 * self.trainable / world) if gpu else 0,
        }

    def rank_bytes(self, world: int, **kw) -> int:
        """One learner rank's total (:meth:`rank_parts`)."""
        return sum(self.rank_parts(world, **kw).values())


def checkpoint_parameters(path: pathlib.Path) -> int:
    """Element count over a checkpoint directory's safetensors files, read from their headers only."""
    return sum(checkpoint_tensors(path).values())


def checkpoint_tensors(path: pathlib.Path) -> dict[str, int]:
    """{tensor name: element count} over a checkpoint directory's safetensors files, from their headers only (each
    file inside the folder, its header bounded and checked against the file's size: rlfleet.policies.model_folder)."""
    from rlfleet.policies.model_folder import tensor_headers

    names = sorted(p.name for p in path.glob("*.safetensors"))
    return {name: math.prod(entry["shape"]) for name, entry in tensor_headers(path, names).items()}


def _units_of_module(policy) -> list[tuple[int, int]]:
    """(parameters, trained) of every FSDP unit below the root, as services/learner/sharding.py makes them: the
    modules whose classes a transformers model lists in ``_no_split_modules``, each counted without the units
    inside it."""
    names: set[str] = set()
    for m in policy.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    units = [m for m in policy.modules() if m is not policy and type(m).__name__ in names]
    seen: set[int] = set()
    out: list[tuple[int, int]] = []
    for unit in reversed(units):  # innermost first: a unit's parameters are those no inner unit took
        params = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        out.append((sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)))
    return out


def _sizes(model_cfg) -> dict:
    """The architecture the activation estimate reads: the config's size group of the family (``vla``,
    ``openpi``: its entry's ``sizes_group``, over the group's defaults), or those that rlfleet's checkpoint layout
    records in its config.json under the group's name."""
    family = get_family(model_cfg.model_type)
    key = family.sizes_group
    if key is None:
        return {}
    sizes = {**family.defaults(), **dict(model_cfg.get(key) or {})}
    if model_cfg.model_path:
        from rlfleet.policies.hub import resolve_model_path
        from rlfleet.policies.model_folder import check_sizes, read_config

        folder = pathlib.Path(resolve_model_path(model_cfg.model_path))
        saved = (read_config(folder, required=False) or {}).get(key)  # inside the folder, bounded
        if isinstance(saved, dict):
            check_sizes(saved, folder / "config.json", key)
            sizes.update({k: v for k, v in saved.items() if k in sizes and v is not None})
    return sizes


def _stack(tokens: int, layers: int, hidden: int, inter: int, e: int, checkpointed: bool = False) -> int:
    """Bytes a stack of transformer blocks keeps for backward: per token per block, 10 hidden-wide tensors (two
    normed inputs, q, k, v, attention output, its projection, the MLP output, two residual sums) and 4
    intermediate-wide ones (gate, up, activated gate, their product), e bytes each; fused attention keeps no score
    matrix. Checkpointed: each block's input hidden state (fp32) and one block recomputed during its backward."""
    block = e * (10 * hidden + 4 * inter)
    return tokens * (layers * 4 * hidden + block) if checkpointed else tokens * layers * block


def activation_bytes(model_cfg, sizes: dict | None = None) -> int:
    """Bytes of activations one micro-batch row keeps for the learner's backward: an estimate from the config, not
    a measurement (:func:`_stack` per transformer stack; e = 2 with ``precision: bf16``, else 4), by the family's
    footprint function (its entry's ``footprint``; 0 for a family without one). A stack in which
    nothing trains keeps none (no gradient flows into it: LoRA's frozen vision backbone, π0's VLM with
    ``train_expert_only``). Left out as small: embeddings, projector, heads, the action logits.

    * openvla / openvla_oft: per image, SigLIP over its (image_size / patch_size)^2 patches and DINOv2 over them plus
      CLS and register tokens (when they train); the Llama over T = patches x images (+1 proprio token) +
      max_prompt_tokens + num_action_chunks x 7 action tokens + 2, checkpointed with ``gradient_checkpointing``
      (which rlfleet applies to the Llama only).
    * openpi: per image, SigLIP over its patches and the Gemma VLM over patches x images + max_prompt_tokens (when the
      VLM trains); the action expert over num_action_chunks + 1 tokens per pass (one pass with Flow-SDE,
      num_denoise_steps with Flow-Noise), plus the prefix keys and values each pass attends to. rlfleet does not
      checkpoint π0, so ``gradient_checkpointing`` changes nothing here.
    """
    family = get_family(model_cfg.model_type)
    if family.footprint is None:
        return 0
    e = 2 if model_cfg.get("precision", "fp32") == "bf16" else 4
    return int(load_object(family.footprint)(model_cfg, sizes or _sizes(model_cfg), e))


def _images_patches(model_cfg, s: dict) -> tuple[int, int]:
    """(cameras, patches per camera) of a VLA's input."""
    return 1 + len(model_cfg.extra_image_keys or ()), (int(s["image_size"]) // int(s["patch_size"])) ** 2


def openpi_activations(model_cfg, s: dict, e: int) -> int:
    """openpi's entry in :func:`activation_bytes`."""
    images, patches = _images_patches(model_cfg, s)
    vlm_trains = not s.get("train_expert_only")
    prefix = images * patches + int(model_cfg.max_prompt_tokens)
    total = 0
    if vlm_trains:
        total += _stack(
            images * patches,
            int(s["vision_layers"]),
            int(s["vision_hidden_size"]),
            int(s["vision_intermediate_size"]),
            e,
        )
        total += _stack(prefix, int(s["vlm_layers"]), int(s["vlm_hidden_size"]), int(s["vlm_intermediate_size"]), e)
    passes = int(s["num_denoise_steps"]) if s.get("noise_method") == "flow_noise" else 1
    total += _stack(
        passes * (int(model_cfg.num_action_chunks) + 1),
        int(s["expert_layers"]),
        int(s["expert_hidden_size"]),
        int(s["expert_intermediate_size"]),
        e,
    )
    total += passes * prefix * int(s["vlm_layers"]) * 2 * int(s["head_dim"]) * e  # one key/value head
    return total


def openvla_activations(model_cfg, s: dict, e: int) -> int:
    """openvla's and openvla_oft's entry in :func:`activation_bytes`."""
    images, patches = _images_patches(model_cfg, s)
    total = 0
    if not model_cfg.is_lora:  # LoRA trains adapters in the Llama only: the vision backbone keeps nothing
        total += _stack(
            images * patches,
            int(s["vision_layers"]),
            int(s["vision_hidden_size"]),
            int(s["vision_intermediate_size"]),
            e,
        )
        if s.get("use_dinov2"):
            width = int(s.get("dino_hidden_size") or s["vision_hidden_size"])
            total += _stack(
                images * (patches + 1 + int(s.get("dino_registers") or 0)),
                int(s.get("dino_layers") or s["vision_layers"]),
                width,
                int(s.get("dino_intermediate_size") or s["vision_intermediate_size"]),
                e,
            )
    tokens = (
        images * patches
        + (1 if model_cfg.get("use_proprio") else 0)
        + int(model_cfg.max_prompt_tokens)
        + int(model_cfg.num_action_chunks) * ACTION_DIM
        + 2
    )
    total += _stack(
        tokens,
        int(s["llm_layers"]),
        int(s["llm_hidden_size"]),
        int(s["llm_intermediate_size"]),
        e,
        checkpointed=bool(model_cfg.gradient_checkpointing),
    )
    return total


def estimate(model_cfg, logprob_type: str) -> Footprint:
    """Parameters, trainable parameters, FSDP units and activations per row of the configured VLA policy, without
    allocating it."""
    import torch

    from rlfleet.policies import build_policy
    from rlfleet.wire.spaces import TensorSpace

    activations = activation_bytes(model_cfg)
    precision = model_cfg.get("precision", "fp32")
    # autocast's bf16 copies: the trained weights (cached for the forward); under LoRA without gradient
    # checkpointing also the frozen base (its copies are kept for the backward into the adapters below)
    frozen_kept = bool(model_cfg.is_lora) and not model_cfg.gradient_checkpointing
    if model_cfg.model_path:
        from rlfleet.policies.hub import resolve_model_path

        tensors = checkpoint_tensors(pathlib.Path(resolve_model_path(model_cfg.model_path)))
        if tensors:
            # LoRA at the usual ranks trains 1-2% (rank 32 on OpenVLA-7B: 1.1%); a full fine-tune everything
            trained = (lambda n: n // 50) if model_cfg.is_lora else (lambda n: n)
            units: dict[str, int] = {}  # the transformer blocks, by their tensor names
            for name, count in tensors.items():
                m = _BLOCK_NAME.match(name)
                if m:
                    units[m.group(1)] = units.get(m.group(1), 0) + count
            n = sum(tensors.values())
            unit = max(units.values(), default=0)
            root = n - sum(units.values())
            return Footprint(
                n,
                trained(n),
                unit,
                trained(unit),
                root,
                trained(root),
                activations,
                precision,
                n if frozen_kept else trained(n),
            )
    sizes = model_cfg[get_family(model_cfg.model_type).sizes_group]
    size = int(sizes.image_size)
    specs = {
        k: TensorSpace((size, size, 3), "uint8")
        for k in [model_cfg.image_key or "image", *(model_cfg.extra_image_keys or ())]
    }
    specs["state"] = TensorSpace((1,), "float32")
    with torch.device("meta"):
        policy = build_policy(model_cfg, specs, 1, True, logprob_type)
    params = sum(p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    units = _units_of_module(policy)
    unit, unit_trained = max(units, default=(0, 0))
    return Footprint(
        params,
        trainable,
        unit,
        unit_trained,
        params - sum(u for u, _ in units),
        trainable - sum(t for _, t in units),
        activations,
        precision,
        params if frozen_kept else trainable,
    )


def available_memory() -> tuple[str, float]:
    """(where, bytes) the local launcher's services would allocate in: the smallest GPU, or this host's RAM. GPUs
    are asked through nvidia-smi, so the coordinator never creates a CUDA context of its own."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.split()
            sizes = [float(v) * 2**20 for v in out if v.replace(".", "", 1).isdigit()]
        except (OSError, subprocess.SubprocessError):
            sizes = []
        if sizes:
            return f"the smallest of {len(sizes)} GPU(s)", min(sizes)
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return "this machine's available RAM (no GPU)", float(line.split()[1]) * 1024
    return "this machine", float("inf")


def smallest_fitting_world(fp: Footprint, have: float, *, on_gpu: bool, others: int = 0, **kw) -> int | None:
    """The smallest learner world size whose need fits ``have`` bytes, or None up to MAX_WORLD ranks. On GPUs each
    rank has a device of its own (the per-rank total must fit one); on one host the ranks and ``others`` (the
    inference servers) share its RAM (the sum must fit)."""
    for world in range(1, MAX_WORLD + 1):
        per_rank = fp.rank_bytes(world, **kw)
        if (per_rank if on_gpu else others + world * per_rank) <= have:
            return world
        if not on_gpu:  # the shards add up to the same whole; every further rank adds its units and activations
            return None
    return None


# --- what a policy for declared spaces would cost, known before anything is allocated --------------------------
MAX_OBS_ROW_BYTES = MAX_MESSAGE_BYTES  # one observation row must fit one Act request


def observation_row_bytes(obs_specs: dict[str, TensorSpace], name: str = "observation_space") -> int:
    """Bytes of one observation row of the declared spaces; refused (InvalidRequest naming ``name``) beyond what
    one Act request can carry, so that nothing is built for spaces no request could ever fill."""
    from rlfleet.errors import InvalidRequest

    total, sizes = 0, {}
    for k, s in obs_specs.items():
        sizes[k] = int(np.prod(s.shape, dtype=object)) * np.dtype(s.dtype).itemsize
        total += sizes[k]
    if total > MAX_OBS_ROW_BYTES:
        big = max(sizes, key=sizes.get)
        raise InvalidRequest(
            f"{name}: one observation row declares {total / 2**20:.0f} MiB ('{big}': "
            f"{list(obs_specs[big].shape)} {obs_specs[big].dtype}, {sizes[big] / 2**20:.0f} MiB); "
            f"at most {MAX_OBS_ROW_BYTES / 2**20:.0f} MiB, what one request can carry"
        )
    return total


def planned_state(
    model_cfg,
    obs_specs: dict[str, TensorSpace],
    action_dim: int,
    normalize_obs: bool,
    logprob_type: str,
    name: str = "observation_space",
) -> dict[str, tuple[tuple[int, ...], torch.dtype, bool]] | None:
    """The state dict the configured policy would have for these spaces, built on PyTorch's meta device (shapes
    and dtypes, no storage): {name: (shape, dtype, is_parameter)}. None where it is not planned: a policy loaded
    from a checkpoint directory (``model_path``: its size is the checkpoint's, and reading it here would cost as
    much as the build), or one that cannot be built on the meta device (both are checked after their real build,
    as before). Spaces the policy cannot take: InvalidRequest naming ``name``."""
    import torch

    from rlfleet.errors import InvalidRequest
    from rlfleet.policies import build_policy

    if model_cfg.get("model_path"):
        return None
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            policy = build_policy(model_cfg, obs_specs, action_dim, normalize_obs, logprob_type)
    except ValueError as exc:  # the spaces do not suit this policy (e.g. images for an MLP)
        raise InvalidRequest(f"{name}: {exc}") from None
    except Exception:  # noqa: BLE001 - e.g. a checkpoint directory that cannot load onto meta tensors
        return None
    params = {n for n, _ in policy.named_parameters()}
    return {n: (tuple(t.shape), t.dtype, n in params) for n, t in policy.state_dict().items()}


def state_bytes(planned: dict, parameter_dtype: torch.dtype | None = None) -> int:
    """Bytes of a planned state (``parameter_dtype``: the dtype parameters are held in, e.g. bf16 copies)."""
    import torch

    total = 0
    for shape, dtype, is_param in planned.values():
        dt = parameter_dtype if is_param and parameter_dtype is not None and dtype.is_floating_point else dtype
        total += math.prod(shape) * torch.empty((), dtype=dt).element_size()
    return total


def free_bytes(device: str | torch.device = "cpu") -> int | None:
    """Bytes this process could still allocate on ``device``: a GPU's free memory (plus what PyTorch's cache holds
    unused), or the host's MemAvailable bounded by this container's cgroup limit (what it may still use, its
    reclaimable page cache counted as free). None when unknown."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
    if dev.type != "cpu":
        return None
    have = None
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                have = int(line.split()[1]) * 1024
    except OSError:
        pass
    cg = pathlib.Path("/sys/fs/cgroup")
    try:
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cg / "memory.current").read_text())
            stat = dict(line.split() for line in (cg / "memory.stat").read_text().splitlines() if " " in line)
            room = int(limit) - used + int(stat.get("inactive_file", 0))
            have = room if have is None else min(have, room)
    except (OSError, ValueError):
        pass
    return have


def check_fits(need: int, what: str, device: str | torch.device = "cpu", budget: int | None = None) -> None:
    """Refuse (ResourceExhausted, with the numbers) what would need more than ``budget`` bytes (None: what
    what :func:`free_bytes` says is left on ``device``)."""
    import torch

    from rlfleet.errors import ResourceExhausted

    have = budget if budget is not None else free_bytes(device)
    if have is not None and need > have:
        raise ResourceExhausted(
            f"{what} would need {need / 2**30:.2f} GiB; {have / 2**30:.2f} GiB are available on {torch.device(device)}"
        )

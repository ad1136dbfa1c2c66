"""Policy families by ``actor.model.model_type``: one declarative entry each (data only, torch-free: the coordinator
and config validation import it), read by every place that needs to know a family.

An entry says where the family's code is (``module``, "package.module:Class", imported only when a policy is built),
the ``actor.model`` keys it owns (its size group, whose defaults live in a YAML beside its module, and which of
those may be null), which optional ``actor.model`` keys it takes, its memory footprint (VLA families: checked before
a run starts), which inference backends serve it, how ``coordinatorctl export`` writes it and which model folders
``coordinatorctl eval`` may load into it. The readers:

- ``rlfleet.policies.build_policy``: ``module``;
- ``rlfleet.config``: the schema (each ``sizes_group`` merged at ``actor.model.<group>`` from ``sizes_file``), the
  nullable keys (``nullable``), the model checks (``options``);
- ``rlfleet.policies.backends``: which backends serve it (``backends``, and ``why_not`` in the refusal);
- ``rlfleet.policies.footprint`` and ``rlfleet.config.fit``: ``footprint`` (None: no memory check), ``lighter``;
- ``services.coordinator.cli`` (export), ``services.coordinator.offline_eval`` (model folders): ``export_layouts``,
  ``upstream_refused_by``, ``loads``;
- ``services.inference.server``: ``batch_invariant_rows``.

Adding a family: its module (a class implementing ``rlfleet.policies.base``: ``act``, ``evaluate``,
``from_config``), its size YAML if it has one, and one entry here.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from rlfleet.registry import lookup

# optional actor.model keys (with the value that means "not used"): a family takes those it lists in ``options``
OPTION_KEYS = {
    "num_action_chunks": (1, "an action chunk per call"),
    "use_proprio": (False, "a proprio projector"),
    "extra_image_keys": ([], "more than one camera"),
    "is_lora": (False, "training LoRA adapters"),
    "critic_layer_norm": (False, "LayerNorm in twin Q critics"),
}
PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent  # rlfleet/: where relative ``sizes_file`` paths start


@dataclass(frozen=True)
class Family:
    """One policy family (one ``actor.model.model_type``)."""

    model_type: str
    module: str  # "package.module:Class" implementing rlfleet.policies.base (lazily imported)
    description: str
    sizes_group: str | None = None  # actor.model.<group> this family owns (its sizes), or None
    sizes_file: str | None = None  # YAML of that group's defaults: a path under rlfleet/ (or absolute)
    nullable: dict[str, type] = field(default_factory=dict)  # keys of the group that may be null, and their type
    options: tuple[str, ...] = ()  # keys of OPTION_KEYS it takes (others must keep their "unused" value)
    footprint: str | None = None  # "module:function" (model_cfg, sizes, e) -> activation bytes per row; None:
    # a small policy, no memory check before a run
    lighter: tuple[str, ...] = ()  # overrides that make it train less when it does not fit (the first one
    # not already set is suggested)
    backends: tuple[str, ...] = ("hf",)  # rollout.backend values that serve it (rlfleet.policies.backends)
    why_not: dict[str, str] = field(default_factory=dict)  # backend -> why it does not serve this family
    export_layouts: tuple[str, ...] = ()  # `coordinatorctl export --layout` values it writes (): refused
    upstream_refused_by: tuple[str, str] | None = None  # (actor.model key, reason): true rules out --layout upstream
    loads: tuple[str, ...] = ()  # config.json model types of model folders its loader takes (eval)
    batch_invariant_rows: int = 0  # rollout.batch_invariant_rows when null (padding cost: 0 for big models)
    # may act in each env server's own process (cluster.component_placement.rollout: env): small policies whose
    # Act round trip costs more than the policy (issue 37); never a VLA (one copy per env server, no batching)
    collocated: bool = False

    def export_refusal(self, model_cfg, layout: str) -> str | None:
        """None when `coordinatorctl export --layout LAYOUT` writes this family (with this ``actor.model``), else
        why not, in one line."""
        if not self.export_layouts:
            return (
                f"{self.model_type} policies have no released layout to export; the checkpoint itself is what "
                f"`coordinatorctl eval` and `coordinatorctl start --resume` take"
            )
        if layout not in self.export_layouts:
            return f"--layout {layout}: {self.model_type} exports as {', '.join(self.export_layouts)}"
        if layout == "upstream" and self.upstream_refused_by:
            from omegaconf import OmegaConf

            key, why = self.upstream_refused_by
            if OmegaConf.select(model_cfg, key):
                return why
        return None

    def defaults(self) -> dict:
        """The size group's defaults (its YAML), {} without one."""
        if not self.sizes_file:
            return {}
        from omegaconf import OmegaConf

        return OmegaConf.to_container(OmegaConf.load(sizes_path(self.sizes_file)))


def sizes_path(name: str) -> pathlib.Path:
    path = pathlib.Path(name)
    return path if path.is_absolute() else PACKAGE_DIR / path


_WHY_NOT_VLLM_GAUSSIAN = "a Gaussian {} decodes no tokens"

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "mlp",
            "rlfleet.policies.models.actor_critic:ActorCritic",
            "Gaussian actor-critic on state observations",
            why_not={"vllm": _WHY_NOT_VLLM_GAUSSIAN.format("MLP")},
            batch_invariant_rows=32,
            collocated=True,
        ),
        Family(
            "cnn",
            "rlfleet.policies.models.actor_critic:ActorCritic",
            "Gaussian actor-critic on images + state (a small CNN)",
            why_not={"vllm": _WHY_NOT_VLLM_GAUSSIAN.format("CNN")},
            collocated=True,
        ),
        Family(
            "sac",
            "rlfleet.policies.models.sac:SacAgent",
            "SAC: squashed-Gaussian actor, twin Q critics and targets, learned temperature (state and cameras)",
            why_not={"vllm": _WHY_NOT_VLLM_GAUSSIAN.format("SAC actor")},
            batch_invariant_rows=32,
            collocated=True,
            options=("critic_layer_norm",),
        ),
        Family(
            "openvla",
            "rlfleet.policies.models.openvla:OpenVLAPolicy",
            "OpenVLA: SigLIP (+ DINOv2) -> projector -> Llama, one token per action dimension",
            sizes_group="vla",
            sizes_file="policies/models/openvla/sizes.yaml",
            nullable={
                "dino_hidden_size": int,
                "dino_layers": int,
                "dino_heads": int,
                "dino_intermediate_size": int,
                "action_token_end": int,
            },
            options=("is_lora",),
            footprint="rlfleet.policies.footprint:openvla_activations",
            lighter=("actor.model.gradient_checkpointing=true", "actor.model.is_lora=true"),
            backends=("hf", "vllm"),
            export_layouts=("upstream", "rlfleet"),
            loads=("openvla", "openvla_oft"),
        ),
        Family(
            "openvla_oft",
            "rlfleet.policies.models.openvla:OpenVLAPolicy",
            "OpenVLA-OFT: the same backbone, a chunk of action tokens decoded in one parallel pass",
            sizes_group="vla",
            sizes_file="policies/models/openvla/sizes.yaml",
            nullable={
                "dino_hidden_size": int,
                "dino_layers": int,
                "dino_heads": int,
                "dino_intermediate_size": int,
                "action_token_end": int,
            },
            options=("num_action_chunks", "use_proprio", "extra_image_keys", "is_lora"),
            footprint="rlfleet.policies.footprint:openvla_activations",
            lighter=("actor.model.gradient_checkpointing=true", "actor.model.is_lora=true"),
            why_not={
                "vllm": "OpenVLA-OFT decodes its whole chunk in one bidirectional forward, which vLLM's causal "
                "scheduler does not run"
            },
            export_layouts=("upstream", "rlfleet"),
            loads=("openvla", "openvla_oft"),
        ),
        Family(
            "openpi",
            "rlfleet.policies.models.openpi:Pi0Policy",
            "π0 / π0.5: PaliGemma + a Gemma action expert, flow matching",
            sizes_group="openpi",
            sizes_file="policies/models/openpi_sizes.yaml",
            options=("num_action_chunks",),
            footprint="rlfleet.policies.footprint:openpi_activations",
            lighter=("actor.model.openpi.train_expert_only=true",),
            why_not={"vllm": "π0 generates actions by flow matching, not by decoding tokens"},
            export_layouts=("upstream", "rlfleet"),
            upstream_refused_by=(
                "openpi.pi05",
                "π0.5 (actor.model.openpi.pi05) has no upstream layout transformers "
                "loads (transformers has no π0.5 class): export it with --layout rlfleet",
            ),
            loads=("openpi", "pi0"),
        ),
    )
}


def get_family(model_type: str) -> Family:
    """The entry of ``model_type``, or UnknownName (a KeyError) with the did-you-mean."""
    return lookup(FAMILIES, model_type, "model_type")


def batch_invariant_rows(configured: int | None, model_type: str) -> int:
    """rollout.batch_invariant_rows, with null resolved by the policy family's entry (its ``batch_invariant_rows``):
    the block size every holder of the policy pads its batches to (the inference server's acting, the learner's
    bootstrap values), so a row's numbers do not depend on what it was batched with."""
    return get_family(model_type).batch_invariant_rows if configured is None else int(configured)


def size_groups() -> dict[str, Family]:
    """{group: the first family that owns it}; families sharing a group must name the same file."""
    groups: dict[str, Family] = {}
    for family in FAMILIES.values():
        if family.sizes_group is None:
            continue
        first = groups.setdefault(family.sizes_group, family)
        if sizes_path(first.sizes_file or "") != sizes_path(family.sizes_file or ""):
            raise ValueError(
                f"model types {first.model_type} and {family.model_type} share actor.model."
                f"{family.sizes_group} but name different files ({first.sizes_file}, "
                f"{family.sizes_file})"
            )
    return groups


def nullable_keys() -> dict[str, type]:
    """{'actor.model.<group>.<key>': type} of every family's keys that may be null."""
    return {
        f"actor.model.{f.sizes_group}.{k}": t for f in FAMILIES.values() if f.sizes_group for k, t in f.nullable.items()
    }


def is_vla(model_type: str) -> bool:
    """A family whose memory is checked before a run (it has a footprint)."""
    family = FAMILIES.get(model_type)
    return family is not None and family.footprint is not None


def served_by(backend: str) -> tuple[str, ...]:
    """The model types ``backend`` serves."""
    return tuple(name for name, f in FAMILIES.items() if backend in f.backends)


__all__ = ["FAMILIES", "Family", "OPTION_KEYS", "get_family", "is_vla", "nullable_keys", "served_by", "size_groups"]

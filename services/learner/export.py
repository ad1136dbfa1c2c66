"""A checkpoint's policy in its model family's released layout: what `coordinatorctl export` runs (one process, on
the CPU) and what ``Learner.export`` writes from a running group.

    python -m services.learner.export CHECKPOINT OUT --config RUN/config.yaml [--layout upstream|rlfleet]
        [--lora merged|adapter] [--max-shard-size 5GB]

``--layout upstream`` (the default), per family (``actor.model.model_type``):

* openvla / openvla_oft: OpenVLA's released layout (``openvla/openvla-7b``, Prismatic's HF export): config.json
  with Prismatic's keys (``vision_backbone_id``, ``text_config``, ``norm_stats``, ...), safetensors in Prismatic's
  names (sharded, model.safetensors.index.json), the tokenizer's files, preprocessor_config.json and
  processor_config.json, dataset_statistics.json; OFT's proprio projector as ``proprio_projector--<step>_checkpoint.pt``.
  The key mapping is ``rlfleet.policies.models.openvla.hub_layout``'s table, the one its loader reads. Refused: an
  OFT action query trained away from zero (OFT's layout has none).
* openpi (π0): transformers' π0 layout (``lerobot/pi0_base`` as rlfleet loads it): ``PI0ForConditionalGeneration``'s
  own ``save_pretrained`` (lerobot's key names) and the tokenizer's files. π0.5 is refused (transformers has no π0.5
  class).
* Not written in the upstream layout: the value head (and π0's Flow-Noise head): RL-side modules the releases do not
  have; a load starts them fresh.

``--layout rlfleet``: rlfleet's own ``save_pretrained`` (config.json, model.safetensors in the policy's tensor names,
``tokenizer/``, dataset_statistics.json): every module, the value head included; any VLA type, π0.5 too.

LoRA is merged into the weights (``--lora merged``, the default). ``--lora adapter`` (a run with
``actor.model.is_lora``): the LM's adapters as a peft adapter (adapter_config.json with ``base_model_name_or_path``
= the run's ``actor.model.model_path``, adapter_model.safetensors). With the upstream layout its keys are the
release's module names (``base_model.model.language_model.model.layers...``: ``PeftModel.from_pretrained`` puts them
on the released VLA, whose LM is ``language_model``), and what trained in full beside the adapters is written as the
release keeps it (OFT's proprio projector file; the value head is not written). With ``--layout rlfleet`` the keys
are those of the LM alone (``PeftModel.from_pretrained(base_lm, OUT)``), plus ``modules.safetensors``: the value
head and OFT's proprio projector in the policy's tensor names.

mlp / cnn: refused; they have no released layout (their checkpoint is what ``coordinatorctl eval`` and
``coordinatorctl start --resume`` take).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

LORA_MODES = ("merged", "adapter")
LAYOUTS = ("upstream", "rlfleet")


class ExportError(Exception):
    """What cannot be exported, in one line."""


def write_export(
    policy,
    path: str | pathlib.Path,
    lora: str = "merged",
    base: str | None = None,
    layout: str = "upstream",
    step: int | None = None,
    max_shard_size: int | str = "5GB",
) -> pathlib.Path:
    """Write ``policy`` (whole, on this process) to ``path`` in ``layout``: merged, or LoRA as a peft adapter."""
    path = pathlib.Path(path)
    if not hasattr(policy, "save_pretrained"):
        raise ExportError(f"{type(policy).__name__}: no released layout to export (VLA policies have one)")
    if layout not in LAYOUTS:
        raise ExportError(f"--layout: '{layout}' is not one of {', '.join(LAYOUTS)}")
    if lora not in LORA_MODES:
        raise ExportError(f"--lora: '{lora}' is not one of {', '.join(LORA_MODES)}")
    if lora == "merged":
        if layout == "rlfleet":
            policy.save_pretrained(path)
            return path
        try:
            return policy.save_upstream(path, step=step, max_shard_size=max_shard_size)
        except ValueError as exc:
            raise ExportError(str(exc)) from None
    if not getattr(policy, "is_lora", False):
        raise ExportError(
            "--lora adapter: the policy trained without LoRA (actor.model.is_lora=false); export it "
            "merged (the default)"
        )
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    llm = policy.llm  # a PeftModel: its adapters, peft's own layout
    for cfg in llm.peft_config.values():
        cfg.base_model_name_or_path = base
    llm.save_pretrained(str(path))
    full = {
        n: p.detach().contiguous().clone()
        for n, p in policy.named_parameters()
        if p.requires_grad and not n.startswith("llm.")
    }
    stats = policy._stats_entry() if hasattr(policy, "_stats_entry") else None
    if layout == "upstream":  # the release's module names: its LM is language_model, the proprio projector a file
        from rlfleet.policies.models.openvla.hub_layout import HUB_LLM, PROPRIO_LAYERS

        adapters = path / "adapter_model.safetensors"
        peft_prefix = "base_model.model."
        tensors = load_file(str(adapters))
        save_file(
            {peft_prefix + HUB_LLM + k[len(peft_prefix) :]: v for k, v in tensors.items()},
            str(adapters),
            metadata={"format": "pt"},
        )
        config = json.loads((path / "adapter_config.json").read_text())
        config["auto_mapping"] = None  # peft recorded the LM's class (Llama); the base is the whole released VLA
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if "proprio_projector.0.weight" in full:
            proj = {
                f"module.{fc}.{kind}": full[f"proprio_projector.{i}.{kind}"]
                for fc, i in PROPRIO_LAYERS
                for kind in ("weight", "bias")
            }
            import torch

            torch.save(proj, path / f"proprio_projector--{int(step or 0)}_checkpoint.pt")
    elif full:
        save_file(full, str(path / "modules.safetensors"))
    if stats:
        (path / "dataset_statistics.json").write_text(json.dumps(stats, indent=1))
    return path


def export_checkpoint(
    view,
    ckpt: str | pathlib.Path,
    out: str | pathlib.Path,
    lora: str = "merged",
    layout: str = "upstream",
    max_shard_size: int | str = "5GB",
) -> pathlib.Path:
    """One process on the CPU: build the run's policy for the checkpoint's spaces, load the checkpoint's weights
    (any world size saved it: DCP reshards), write it. ``view``: the learner's view of the run config (or the run
    config: its view is built)."""
    import torch

    from rlfleet.config.views import LearnerView, as_view
    from rlfleet.data.checkpoint_files import specs_from_json, step_of, verify_checkpoint
    from rlfleet.policies import build_policy
    from services.learner import checkpoint

    ckpt = pathlib.Path(ckpt)
    state = verify_checkpoint(ckpt).state  # every file checked before anything is built or loaded
    obs_specs, action_dim = specs_from_json(state["obs_specs"]), int(state["action_dim"])
    view = as_view(LearnerView, view)
    torch.manual_seed(view.seed)
    policy = build_policy(view.model, obs_specs, action_dim, view.algorithm.normalize_obs, view.algorithm.logprob_type)
    checkpoint.load_policy_state(ckpt, policy)
    return write_export(
        policy,
        out,
        lora,
        base=view.model.get("model_path"),
        layout=layout,
        step=step_of(ckpt),
        max_shard_size=max_shard_size,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.learner.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="RUN/checkpoints/global_step_N (complete: learner_state.json)")
    p.add_argument("out")
    p.add_argument("--config", required=True, help="the run's config.yaml")
    p.add_argument("--lora", choices=LORA_MODES, default="merged")
    p.add_argument("--layout", choices=LAYOUTS, default="upstream")
    p.add_argument("--max-shard-size", default="5GB", help="upstream layout: the largest safetensors shard")
    args = p.parse_args(argv)
    from rlfleet.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
        shard = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
        out = export_checkpoint(cfg, args.checkpoint, args.out, args.lora, args.layout, shard)
    except (ConfigError, ExportError, FileNotFoundError, ValueError, KeyError) as exc:
        print(f"coordinatorctl export: {exc}", file=sys.stderr)
        return 2
    lora = args.lora if cfg.actor.model.is_lora else "none"
    print(f"exported {args.checkpoint} ({cfg.actor.model.model_type}, {args.layout} layout, LoRA {lora}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

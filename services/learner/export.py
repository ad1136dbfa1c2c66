"""A checkpoint's policy in its model family's released layout: what `coordinatorctl export` runs (one process, on
the CPU) and what ``Learner.export`` writes from a running group.

    python -m services.learner.export CHECKPOINT OUT --config RUN/config.yaml [--lora merged|adapter]

Per family (``actor.model.model_type``):

* openvla / openvla_oft / openpi: ``save_pretrained`` (config.json, model.safetensors, the tokenizer's files,
  dataset_statistics.json where the policy un-normalises actions), the folder ``actor.model.model_path`` and
  ``coordinatorctl eval MODEL_DIR`` load. LoRA is merged into the weights (``--lora merged``, the default).
* ``--lora adapter`` (a run with ``actor.model.is_lora``): the LM's adapters as a peft adapter
  (adapter_config.json with ``base_model_name_or_path`` = the run's ``actor.model.model_path``,
  adapter_model.safetensors: ``PeftModel.from_pretrained`` puts them on the base LM), plus ``modules.safetensors``:
  what trained in full beside the adapters (value head, OFT's proprio projector), in the policy's tensor names.
* mlp / cnn: refused; they have no released layout (their checkpoint is what ``coordinatorctl eval`` and
  ``coordinatorctl start --resume`` take).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

LORA_MODES = ("merged", "adapter")


class ExportError(Exception):
    """What cannot be exported, in one line."""


def write_export(policy, path: str | pathlib.Path, lora: str = "merged", base: str | None = None) -> pathlib.Path:
    """Write ``policy`` (whole, on this process) to ``path``: merged (``save_pretrained``) or as a peft adapter."""
    path = pathlib.Path(path)
    if not hasattr(policy, "save_pretrained"):
        raise ExportError(f"{type(policy).__name__}: no released layout to export (VLA policies have one)")
    if lora == "merged":
        policy.save_pretrained(path)
        return path
    if lora != "adapter":
        raise ExportError(f"--lora: '{lora}' is not one of {', '.join(LORA_MODES)}")
    if not getattr(policy, "is_lora", False):
        raise ExportError("--lora adapter: the policy trained without LoRA (actor.model.is_lora=false); export it "
                          "merged (the default)")
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    llm = policy.llm  # a PeftModel: its adapters, peft's own layout
    for cfg in llm.peft_config.values():
        cfg.base_model_name_or_path = base
    llm.save_pretrained(str(path))
    full = {n: p for n, p in policy.named_parameters() if p.requires_grad and not n.startswith("llm.")}
    if full:
        save_file({k: v.detach().contiguous().clone() for k, v in full.items()}, str(path / "modules.safetensors"))
    if getattr(policy, "unnorm_stats", None):
        entry = {"action": policy.unnorm_stats, **({"proprio": policy.proprio_stats} if policy.proprio_stats else {})}
        (path / "dataset_statistics.json").write_text(json.dumps({policy.unnorm_name: entry}, indent=1))
    return path


def export_checkpoint(cfg, ckpt: str | pathlib.Path, out: str | pathlib.Path, lora: str = "merged") -> pathlib.Path:
    """One process on the CPU: build the run's policy for the checkpoint's spaces, load the checkpoint's weights
    (any world size saved it: DCP reshards), write it."""
    import torch

    from rlfleet.policies import build_policy
    from services.learner import checkpoint
    from services.learner.learner import _specs_from_json

    ckpt = pathlib.Path(ckpt)
    state = json.loads((ckpt / "learner_state.json").read_text())
    obs_specs, action_dim = _specs_from_json(state["obs_specs"]), int(state["action_dim"])
    torch.manual_seed(cfg.runner.seed)
    policy = build_policy(cfg.actor.model, obs_specs, action_dim, cfg.algorithm.normalize_obs,
                          cfg.algorithm.logprob_type)
    checkpoint.load_policy_state(ckpt, policy)
    return write_export(policy, out, lora, base=cfg.actor.model.get("model_path"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.learner.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="RUN/checkpoints/global_step_N (complete: learner_state.json)")
    p.add_argument("out")
    p.add_argument("--config", required=True, help="the run's config.yaml")
    p.add_argument("--lora", choices=LORA_MODES, default="merged")
    args = p.parse_args(argv)
    from rlfleet.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
        out = export_checkpoint(cfg, args.checkpoint, args.out, args.lora)
    except (ConfigError, ExportError, FileNotFoundError, ValueError, KeyError) as exc:
        print(f"coordinatorctl export: {exc}", file=sys.stderr)
        return 2
    lora = args.lora if cfg.actor.model.is_lora else "none"
    print(f"exported {args.checkpoint} ({cfg.actor.model.model_type}, LoRA {lora}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

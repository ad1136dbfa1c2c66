"""Save/load: rlfleet's checkpoint layout (safetensors, never pickle), building from config, and LoRA adapters."""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from rlfleet.policies.hub import resolve_model_path
from rlfleet.policies.model_folder import check_build_fits, check_sizes, has_file, load_tensors, read_config
from rlfleet.policies.models.openvla.architecture import TINY
from rlfleet.policies.models.openvla.hub_layout import _pick_stats, load_openvla_hub_dir
from rlfleet.policies.models.openvla.tokenizers import load_hf_tokenizer, save_tokenizer
from rlfleet.untrusted import BadFile, check_count

_Policy = TypeVar("_Policy", bound="CheckpointMixin")  # the policy class that mixes this in (OpenVLAPolicy)


class CheckpointMixin:
    """Construction from ``actor.model`` (sizes or ``model_path``), ``save_pretrained`` and LoRA for
    ``OpenVLAPolicy``."""

    @classmethod
    def from_config(
        cls: type[_Policy],
        model_cfg,
        obs_specs: Mapping,
        action_dim: int,
        normalize_obs: bool,
        logprob_type: str = "token_level",
    ) -> _Policy:
        sizes = {k: (list(v) if k == "prompt_suffix_ids" else v) for k, v in model_cfg.vla.items()}
        tokenizer, stats, state = None, None, None
        model_path = resolve_model_path(model_cfg.model_path)  # a folder, or a hub id's snapshot in the hub cache
        if model_path:
            sizes, tokenizer, stats, state = load_checkpoint_dir(model_path, model_cfg.unnorm_key, sizes)
            if stats:
                _check_stats_width(stats, action_dim)

        def make():
            return cls(
                obs_specs,
                action_dim,
                model_type=model_cfg.model_type,
                sizes=sizes,
                num_action_chunks=model_cfg.num_action_chunks,
                temperature=model_cfg.temperature,
                image_key=model_cfg.image_key,
                max_prompt_tokens=model_cfg.max_prompt_tokens,
                add_value_head=model_cfg.add_value_head,
                is_lora=False,
                gradient_checkpointing=model_cfg.gradient_checkpointing,
                unnorm_stats=stats["action"] if stats else None,
                tokenizer=tokenizer,
                logprob_type=logprob_type,
                use_proprio=model_cfg.use_proprio,
                proprio_stats=stats["proprio"] if stats else None,
                extra_image_keys=list(model_cfg.extra_image_keys or ()),
            )

        if state is not None:  # the sizes the folder gave must not build more than its weights fill
            check_build_fits(make, sum(v.numel() for v in state.values()), Path(model_path) / "config.json")
        policy = make()
        if stats:  # kept under the key they were picked by, so save_pretrained / export write them back there
            policy.unnorm_name = model_cfg.unnorm_key
        if model_path:
            _check_cameras(Path(model_path), policy.image_keys)
        if state is not None:
            missing, unexpected = policy.load_state_dict(state, strict=False)
            # a fresh critic is expected; DINOv2's mask token is never used for inference; OpenVLA-OFT's released
            # checkpoints have no action query: OFT zeroes the action positions' embeddings, as its zero init does
            missing = [
                k
                for k in missing
                if not k.startswith("value_head.") and not k.endswith("mask_token") and k != "action_query"
            ]
            if missing or unexpected:
                hint = ""
                if any(k.startswith("proprio_projector.") for k in missing + unexpected):
                    hint = (
                        f"; the checkpoint was trained {'without' if model_cfg.use_proprio else 'with'} a "
                        f"proprio projector: set actor.model.use_proprio={str(not model_cfg.use_proprio).lower()}"
                    )
                raise ValueError(
                    f"{model_cfg.model_path}/model.safetensors: missing tensors {missing[:3]}, "
                    f"unexpected {unexpected[:3]}{hint}"
                )
        if model_cfg.is_lora:
            policy.enable_lora(model_cfg.lora_rank)
        return policy

    def enable_lora(self, rank: int) -> None:
        from peft import LoraConfig, get_peft_model

        for p in self.parameters():
            p.requires_grad_(False)
        with warnings.catch_warnings():  # peft asks transformers a deprecated question; nothing for users to do
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            self.llm = get_peft_model(
                self.llm,
                LoraConfig(
                    r=int(rank),
                    lora_alpha=int(rank),
                    lora_dropout=0.0,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                ),
            )
        for head in (self.value_head, self.proprio_projector):  # new modules train in full (OFT trains its projector)
            if head is not None:
                for p in head.parameters():
                    p.requires_grad_(True)
        self.is_lora = True

    @property
    def trains_adapters_only(self) -> bool:
        # enable_lora freezes every base weight; the value head does not touch log-probs, a proprio projector does
        return self.is_lora and self.proprio_projector is None

    @contextlib.contextmanager
    def adapters_disabled(self):
        if not self.is_lora:
            raise NotImplementedError("OpenVLAPolicy: no adapters to disable (actor.model.is_lora is false)")
        with self.llm.disable_adapter():
            yield

    def _merged_state(self) -> dict:
        """The weights with LoRA merged into the base (this object goes on as the merged model)."""
        llm = self.llm.merge_and_unload() if self.is_lora else self.llm
        state = {f"llm.{k}": v for k, v in llm.state_dict().items()}
        state.update({k: v for k, v in self.state_dict().items() if not k.startswith("llm.")})
        self.llm, self.is_lora = llm, False
        return state

    def _stats_entry(self) -> dict | None:
        if not self.unnorm_stats:
            return None
        return {
            self.unnorm_name: {
                "action": self.unnorm_stats,
                **({"proprio": self.proprio_stats} if self.proprio_stats else {}),
            }
        }

    def save_upstream(self, path: str | Path, step: int | None = None, max_shard_size: int | str = "5GB") -> Path:
        """Write this model in OpenVLA's released layout (``openvla/openvla-7b``'s; OpenVLA-OFT's proprio projector
        file), LoRA merged: ``hub_layout.save_openvla_hub_dir``, the inverse of the loader's key mapping."""
        from rlfleet.policies.models.openvla.hub_layout import save_openvla_hub_dir

        return save_openvla_hub_dir(
            Path(path),
            self._merged_state(),
            self.sizes,
            model_type=self.model_type,
            tokenizer=self.tokenizer,
            stats=self._stats_entry(),
            num_images=self.num_images,
            image_keys=self.image_keys,
            step=step,
            max_shard_size=max_shard_size,
        )

    def save_pretrained(self, path: str | Path) -> None:
        """Write this model in the checkpoint layout ``model_path`` loads (LoRA merged into the base weights)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = self._merged_state()
        save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(path / "model.safetensors"))
        (path / "config.json").write_text(
            json.dumps(
                {
                    "model_type": self.model_type,
                    "vla": self.sizes,
                    "num_images_in_input": self.num_images,
                    "image_keys": self.image_keys,
                },
                indent=2,
            )
        )
        save_tokenizer(self.tokenizer, path)
        if self.unnorm_stats:
            (path / "dataset_statistics.json").write_text(json.dumps(self._stats_entry(), indent=1))


def load_checkpoint_dir(path: str | Path, unnorm_key: str | None, fallback: Mapping | None = None):
    """A checkpoint directory -> (sizes, tokenizer or None, dataset statistics ``{"action", "proprio"}`` or None,
    state dict). Two
    layouts: rlfleet's (``save_pretrained``) and OpenVLA's own hub layout (``openvla/openvla-7b``: Prismatic's
    timm key names, sharded safetensors, ``norm_stats`` in config.json), mapped key by key without remote code.
    Every file is read as model_folder reads them: inside the folder, bounded, safetensors headers checked first."""
    path = Path(path)
    cfg = read_config(path, required=False)
    if cfg is not None and "vision_backbone_id" in cfg:
        return load_openvla_hub_dir(path, unnorm_key, fallback)
    if cfg is None or not has_file(path, "model.safetensors"):
        raise FileNotFoundError(
            f"actor.model.model_path: {path} needs config.json and model.safetensors (rlfleet's VLA checkpoint layout)"
        )
    vla = cfg.get("vla", {})
    if not isinstance(vla, dict):
        raise BadFile(path / "config.json", "vla", "a JSON object of sizes", type(vla).__name__)
    check_sizes(vla, path / "config.json", "vla")
    sizes = {**TINY, **vla}
    tokenizer = load_hf_tokenizer(path / "tokenizer", within=path) if (path / "tokenizer").is_dir() else None
    stats_file = path / "dataset_statistics.json"
    stats = _pick_stats(read_config(path, stats_file.name, required=False) or {}, unnorm_key, stats_file)
    return sizes, tokenizer, stats, load_tensors(path, ["model.safetensors"])


def _check_stats_width(stats: Mapping, action_dim: int) -> None:
    """The picked action statistics un-normalise ``action_dim`` dimensions."""
    n = len(stats["action"]["q01"])
    if n != action_dim:
        raise BadFile(
            stats["source"], f"{stats['field']}.q01", f"{action_dim} values (the action's dimensions)", f"{n}"
        )


def _check_cameras(path: Path, image_keys: Sequence[str]) -> None:
    """A checkpoint trained on N cameras (config.json ``num_images_in_input``, OpenVLA-OFT's name) loads into a
    policy that sees N cameras: the weights alone cannot tell, the patch sequence the LM learned can."""
    cfg = read_config(path, required=False) or {}
    n = cfg.get("num_images_in_input")
    if n is not None and check_count("num_images_in_input", n, 64, source=path / "config.json") != len(image_keys):
        trained = cfg.get("image_keys") or f"{n} cameras"
        raise ValueError(
            f"actor.model.model_path: {path} was trained on {n} image(s) ({trained}); this policy sees "
            f"{len(image_keys)} ({list(image_keys)}): set actor.model.image_key and "
            f"actor.model.extra_image_keys to match"
        )

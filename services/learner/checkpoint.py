"""Learner checkpoints: ``checkpoints/global_step_N/`` in the run folder.

- ``state/``: the policy and the optimizer, written by every rank with ``torch.distributed.checkpoint`` (each
  rank its shards, rank 0 the metadata), keyed by parameter name, so a checkpoint saved by N ranks loads into M
  ranks (resharded on load; a group of one included). Several nodes need the run folder on a shared filesystem.
- ``reward_rms.safetensors``: the reward normaliser (rank 0 owns it).
- ``learner_state.json``: epoch, weights version, env steps, wall time, spaces, world size; written last by rank
  0: its presence marks the checkpoint complete.

Nothing is pickled: DCP stores tensors and plain metadata, the rest is safetensors and JSON.
"""

from __future__ import annotations

import json
import pathlib
import warnings
from contextlib import contextmanager

import torch
from safetensors.torch import load_file, save_file

STATE_DIR = "state"


def latest_checkpoint(run_dir: str | pathlib.Path) -> pathlib.Path | None:
    """The newest complete checkpoint of a run folder, or None; a complete checkpoint folder itself
    (``RUN/checkpoints/global_step_N``, what `coordinatorctl eval` may name) is its own newest."""
    if (pathlib.Path(run_dir) / "learner_state.json").is_file():
        return pathlib.Path(run_dir)
    ckpts = sorted((pathlib.Path(run_dir) / "checkpoints").glob("global_step_*"),
                   key=lambda p: int(p.name.rsplit("_", 1)[1]))
    ckpts = [p for p in ckpts if (p / "learner_state.json").exists()]
    return ckpts[-1] if ckpts else None


@contextmanager
def _quiet():
    """DCP warns that a group of one saves 'in a single process' and that it overwrites: both intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(single process|existing checkpoint).*", category=UserWarning)
        yield


def save_sharded(path: pathlib.Path, model, optimizer) -> None:
    """Every rank: the policy and optimizer state under ``path/state`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / STATE_DIR))


def load_sharded(path: pathlib.Path, model, optimizer) -> None:
    """Every rank: load ``path/state`` into this rank's shards, whatever world size wrote it (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (path / STATE_DIR).is_dir():
        raise FileNotFoundError(f"{path}: no '{STATE_DIR}/' folder (a checkpoint from before sharded checkpoints? "
                                f"it cannot be resumed by this version)")
    from torch.distributed.checkpoint import DefaultLoadPlanner

    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet():
        dcp.load({"model": model_sd}, checkpoint_id=str(path / STATE_DIR))  # every tensor of the policy
        # the optimizer's state where it has one: a parameter that never had a gradient (e.g. a VLA's vision tower
        # layer that gets none) has no Adam moments in the checkpoint and keeps the fresh ones
        dcp.load({"optim": optim_sd}, checkpoint_id=str(path / STATE_DIR),
                 planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def load_policy_state(path: str | pathlib.Path, model) -> None:
    """A single process (evaluation, export): the policy's weights from a checkpoint, without its optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    sd = get_model_state_dict(model)
    state = {"model": sd}
    with _quiet():
        dcp.load(state, checkpoint_id=str(pathlib.Path(path) / STATE_DIR))
    set_model_state_dict(model, state["model"])


def write_leader_files(path: pathlib.Path, reward_state: dict[str, torch.Tensor], state: dict) -> None:
    """Rank 0, after every rank has written its shards: the reward normaliser, then the completion marker."""
    save_file({k: v.contiguous() for k, v in reward_state.items()}, str(path / "reward_rms.safetensors"))
    (path / "learner_state.json").write_text(json.dumps(state, indent=1))


def read_leader_files(path: pathlib.Path) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(str(path / "reward_rms.safetensors")), json.loads((path / "learner_state.json").read_text())

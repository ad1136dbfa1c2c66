"""Learner checkpoints: ``checkpoints/global_step_N/`` in the run folder.

- ``state/``: the policy and the optimizer, written by every rank with ``torch.distributed.checkpoint`` (each
  rank its shards, rank 0 the metadata), keyed by parameter name, so a checkpoint saved by N ranks loads into M
  ranks (resharded on load; a group of one included). Several nodes need the run folder on a shared filesystem.
- ``reward_rms.safetensors``: the reward normaliser (rank 0 owns it).
- ``learner_state.json``: epoch, weights version, env steps, wall time, spaces, world size; written last by rank
  0: its presence marks the checkpoint complete.

What is pickled, and how it is read back: DCP writes ``state/.metadata`` as a pickle of its metadata classes and
stores the optimizer's hyper-parameters (``optim.param_groups.*``) with ``torch.save`` inside the ``.distcp``
shards; tensors are torch.save'd zip records. Nothing is read with a plain ``pickle.load``: the metadata goes through
a restricted unpickler admitting only DCP's plain metadata classes and is checked against the files it names, the
hyper-parameters and tensors through ``torch.load(weights_only=True)`` (rlfleet.data.checkpoint_files). The rest
is safetensors and JSON, read bounded and checked. A bad file is one line naming it
(:class:`rlfleet.untrusted.BadFile`), never a code execution, a read outside the run folder or a hang.
"""

from __future__ import annotations

import json
import pathlib
import warnings
from contextlib import contextmanager

import torch
from safetensors.torch import load_file, save_file

from rlfleet.data.checkpoint_files import (
    STATE_DIR,
    check_reward_rms,
    latest_checkpoint,
    read_learner_state,
    run_folder_of,
)
from rlfleet.untrusted import BadFile

__all__ = [
    "STATE_DIR",
    "latest_checkpoint",
    "load_policy_state",
    "load_sharded",
    "read_leader_files",
    "save_sharded",
    "write_leader_files",
]


@contextmanager
def _quiet():
    """DCP warns that a group of one saves 'in a single process' and that it overwrites: both intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(single process|existing checkpoint).*", category=UserWarning)
        yield


def save_sharded(path: pathlib.Path, model, optimizer) -> None:
    """Every rank: the policy and optimizer state under ``path/state`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        with _quiet():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / STATE_DIR))
    except CheckpointException as exc:  # a BaseException: it would escape every `except Exception` (a hang)
        rank, (first, _trace) = min(exc.failures.items())
        raise OSError(
            f"{path / STATE_DIR}: writing the checkpoint failed on rank {rank}: "
            f"{type(first).__name__}: {' '.join(str(first).split())[:200]}"
        ) from None


def load_sharded(path: pathlib.Path, model, optimizer) -> None:
    """Every rank: load ``path/state`` into this rank's shards, whatever world size wrote it (collective). The
    metadata and every non-tensor item are read without unpickling anything the files choose
    (rlfleet.data.checkpoint_files); a bad file is a BadFile on every rank."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from rlfleet.data.dcp_files import load_state  # torch.distributed.checkpoint: ~0.6 s of every start otherwise

    path = pathlib.Path(path)
    if not (path / STATE_DIR).is_dir():
        raise FileNotFoundError(
            f"{path}: no '{STATE_DIR}/' folder (a checkpoint from before sharded checkpoints? "
            f"it cannot be resumed by this version)"
        )
    root = run_folder_of(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet():
        load_state({"model": model_sd}, path / STATE_DIR, root=root)  # every tensor of the policy
        # the optimizer's state where it has one: a parameter that never had a gradient (e.g. a VLA's vision tower
        # layer that gets none) has no Adam moments in the checkpoint and keeps the fresh ones
        load_state({"optim": optim_sd}, path / STATE_DIR, root=root, allow_partial_load=True)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def load_policy_state(path: str | pathlib.Path, model) -> None:
    """A single process (evaluation, export): the policy's weights from a checkpoint, without its optimizer."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from rlfleet.data.dcp_files import load_state

    path = pathlib.Path(path)
    if not (path / STATE_DIR).is_dir():
        raise FileNotFoundError(
            f"{path}: no '{STATE_DIR}/' folder (a checkpoint from before sharded checkpoints? "
            f"it cannot be read by this version)"
        )
    state = {"model": get_model_state_dict(model)}
    with _quiet():
        load_state(state, path / STATE_DIR, root=run_folder_of(path))
    set_model_state_dict(model, state["model"])


def write_leader_files(path: pathlib.Path, reward_state: dict[str, torch.Tensor], state: dict) -> None:
    """Rank 0, after every rank has written its shards: the reward normaliser, then the completion marker."""
    save_file({k: v.contiguous() for k, v in reward_state.items()}, str(path / "reward_rms.safetensors"))
    (path / "learner_state.json").write_text(json.dumps(state, indent=1))


def read_leader_files(path: pathlib.Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The reward normaliser and learner_state.json of checkpoint ``path``, both checked before use (the
    safetensors header and the JSON fields: rlfleet.data.checkpoint_files); a bad file is a BadFile naming it."""
    path = pathlib.Path(path)
    root = run_folder_of(path)
    state = read_learner_state(path, root=root)
    check_reward_rms(path, root=root)
    src = path / "reward_rms.safetensors"
    reward = load_file(str(src))
    for k, v in reward.items():
        if not torch.isfinite(v).all():
            raise BadFile(src, f"tensor '{k}'", "finite values (the learner never saves others)", "NaN or infinity")
    if reward and (float(reward["var"]) < 0 or float(reward["count"]) < 0):
        raise BadFile(
            src, "var, count", "non-negative values", f"var {float(reward['var'])}, count {float(reward['count'])}"
        )
    return reward, state

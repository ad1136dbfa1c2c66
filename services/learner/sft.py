"""Supervised fine-tuning (behaviour cloning) of a policy on a demonstration dataset.

The base policy of an RL fine-tuning run, as the seeds' guides start from one: build the configured policy
(``actor.model``, the same registry the learner uses), train it for ``sft.max_steps`` steps on (observation,
instruction, action chunk) samples of the dataset with the policy's own ``bc_loss`` (for token VLAs: the
cross-entropy of the demonstrated action tokens, computed by the same ``evaluate`` that scores RL samples), and write
it with ``save_pretrained`` where ``actor.model.model_path`` of an RL config loads it. Progress lines go to stdout
and every step's loss to ``<output>/metrics.jsonl``.

    python -m services.learner.sft --config CONFIG [key=value ...]      (``coordinatorctl sft CONFIG``)

A sample at step t of an episode carries actions t .. t+chunk-1; past the episode's end the last action repeats.
Deliberately little data or few steps gives a weak base policy, which is the point of an RL-gain experiment.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np
import torch

from rlfleet.config.views import SftView, as_view, service_view
from rlfleet.data.datasets import Dataset
from rlfleet.policies import build_policy
from rlfleet.policies.hub import parse_hub_id, resolve_model_path
from rlfleet.policies.models.actor_critic import to_torch_obs
from rlfleet.wire.spaces import TensorSpace


def default_paths(view: SftView) -> tuple[pathlib.Path, pathlib.Path]:
    """(dataset folder or hub id, output folder) of the ``sft`` group (the SFT view, or a run config)."""
    view = as_view(SftView, view)
    base = pathlib.Path(view.log_path) / view.experiment_name
    return (pathlib.Path(view.dataset_path or base / "demos"), pathlib.Path(view.output_path or base / "sft_model"))


def open_dataset(view: SftView) -> Dataset:
    """The dataset of ``sft.dataset_path`` (a folder, or a hub dataset id resolved from the Hugging Face cache, as
    ``actor.model.model_path`` is) with the policy's inputs mapped by ``sft.dataset_keys``. Every file of it is read
    as hostile until checked (``rlfleet.data.datasets.Dataset``): paths inside the dataset, footers and shapes
    checked before anything is allocated, a bad file one line naming it, the field and what was expected."""
    view = as_view(SftView, view)
    return open_demonstrations(view.dataset_path, view.dataset_keys, view.log_path, view.experiment_name)


def open_demonstrations(dataset_path: str | None, dataset_keys, log_path: str, experiment_name: str) -> Dataset:
    """:func:`open_dataset` from the keys themselves (``sft.dataset_path``, ``sft.dataset_keys``; a null path is
    ``<log_path>/<experiment_name>/demos``), for the learner's algorithms that read demonstrations (RLPD)."""
    path = dataset_path or str(pathlib.Path(log_path) / experiment_name / "demos")
    hub = None if pathlib.Path(path).expanduser().is_dir() else parse_hub_id(path, key="sft.dataset_path")
    root = resolve_model_path(path, key="sft.dataset_path", repo_type="dataset") if hub else path
    return Dataset(root, keys=dict(dataset_keys), name=hub[0] if hub else None)


def chunk_samples(dataset: Dataset, chunk: int) -> tuple[dict[str, np.ndarray], np.ndarray, list[str]]:
    """All samples of a dataset: observations {key: [N, ...]}, action chunks [N, chunk, action_dim], instructions."""
    obs: dict[str, list] = {}
    actions, instructions = [], []
    for ep in dataset:
        T = ep.length
        idx = np.minimum(np.arange(T)[:, None] + np.arange(chunk)[None, :], T - 1)  # [T, chunk]
        actions.append(ep.actions.reshape(T, -1)[idx])
        for k, v in ep.observations.items():
            obs.setdefault(k, []).append(v)
        instructions += [ep.instruction] * T
    if not actions:
        raise ValueError(f"{dataset.root}: the dataset holds no episodes")
    return {k: np.concatenate(v) for k, v in obs.items()}, np.concatenate(actions).astype(np.float32), instructions


class SFTTrainer:
    """Behaviour cloning of the view's policy (``actor.model``) on one dataset; ``train()`` then ``save()``."""

    def __init__(self, view: SftView, dataset: Dataset, output: pathlib.Path, device: str = "cpu", log=print):
        if not isinstance(view, SftView):
            raise TypeError(
                f"SFTTrainer takes the SFT config view (rlfleet.config.views.SftView), not {type(view).__name__}"
            )
        self.view, self.dataset, self.output, self.log = view, dataset, pathlib.Path(output), log
        self.device = torch.device(device)
        feats = dataset.observation_features
        self.obs_specs = {k: TensorSpace(tuple(v["shape"]), v["dtype"]) for k, v in feats.items()}
        torch.manual_seed(view.seed)
        self.policy = build_policy(
            view.model, self.obs_specs, dataset.action_dim, view.normalize_obs, view.logprob_type
        ).to(self.device)
        if not hasattr(self.policy, "save_pretrained"):
            raise ValueError(
                f"actor.model.model_type '{view.model.model_type}' has no checkpoint layout for "
                f"actor.model.model_path; supervised fine-tuning supports the VLA model types"
            )
        stats = dataset.action_statistics()
        if hasattr(self.policy, "set_action_statistics"):  # un-normalise with the demonstrations' own statistics
            proprio = dataset.observation_statistics("state") if view.model.use_proprio else None
            self.policy.set_action_statistics(stats, name=dataset.meta["env_id"], proprio=proprio)
        self.image_keys = sorted(k for k, spec in self.obs_specs.items() if spec.is_image)  # what image_shift moves
        self.obs, self.actions, self.instructions = chunk_samples(dataset, self.policy.num_action_chunks)
        self.optimizer = torch.optim.Adam(
            [p for p in self.policy.parameters() if p.requires_grad], lr=view.lr, eps=view.adam_eps
        )
        self.rng = np.random.default_rng(view.seed)

    @property
    def num_samples(self) -> int:
        return int(self.actions.shape[0])

    def augment(self, obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Random-shift augmentation (``sft.image_shift`` = s > 0): every image (uint8 [B, H, W, C]) is padded by
        s pixels on each side, repeating its edge, and cropped back to H x W at an offset drawn per sample."""
        s = self.view.image_shift
        if s <= 0:
            return obs
        out = dict(obs)
        for k in self.image_keys:
            v = obs[k]
            B, H, W = v.shape[:3]
            padded = np.pad(v, ((0, 0), (s, s), (s, s), (0, 0)), mode="edge")
            dy, dx = self.rng.integers(0, 2 * s + 1, size=(2, B))
            out[k] = np.stack([padded[i, dy[i] : dy[i] + H, dx[i] : dx[i] + W] for i in range(B)])
        return out

    def step(self, rows: np.ndarray) -> float:
        batch = self.augment({k: v[rows] for k, v in self.obs.items()})
        obs = {k: v.to(self.device) for k, v in to_torch_obs(batch).items()}
        actions = torch.from_numpy(self.actions[rows]).to(self.device)
        with self.policy.precision():
            loss = self.policy.bc_loss(obs, actions, [self.instructions[i] for i in rows]).float()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"behaviour-cloning loss is {loss.item()} (rows {rows[:4].tolist()}...)")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.view.max_grad_norm)
        self.optimizer.step()
        return float(loss.item())

    def train(self) -> dict:
        sft = self.view
        self.output.mkdir(parents=True, exist_ok=True)
        self.policy.train()
        t0 = time.perf_counter()
        losses = []
        every = max(1, sft.max_steps // 20)
        with open(self.output / "metrics.jsonl", "w") as metrics:
            for step in range(1, sft.max_steps + 1):
                rows = self.rng.choice(self.num_samples, size=min(sft.batch_size, self.num_samples), replace=False)
                loss = self.step(rows)
                losses.append(loss)
                metrics.write(json.dumps({"step": step, "sft/loss": loss}) + "\n")
                if step % every == 0 or step == sft.max_steps:
                    self.log(
                        f"  sft step {step:5d}/{sft.max_steps} | loss {np.mean(losses[-every:]):.4f} | "
                        f"{time.perf_counter() - t0:6.1f}s"
                    )
        self.policy.eval()
        return {
            "steps": sft.max_steps,
            "samples": self.num_samples,
            "episodes": len(self.dataset),
            "first_loss": losses[0],
            "final_loss": float(np.mean(losses[-every:])),
            "wall_time_s": round(time.perf_counter() - t0, 2),
        }

    def save(self, summary: dict) -> pathlib.Path:
        self.policy.save_pretrained(self.output)
        (self.output / "sft_summary.json").write_text(
            json.dumps(
                {**summary, "dataset": str(self.dataset.root), "model_type": self.view.model.model_type}, indent=1
            )
        )
        return self.output


def main(argv=None) -> int:
    from rlfleet.config import load_cli_config

    p = argparse.ArgumentParser(description="supervised fine-tuning of actor.model on a demonstration dataset")
    p.add_argument("--config", required=True, help="run config (YAML or built-in name)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    _, cfg = load_cli_config(p, argv)
    view = service_view(SftView, cfg)
    # nothing else runs beside supervised fine-tuning: every core, unless cluster.learner_num_threads says otherwise
    threads = view.learner_num_threads
    torch.set_num_threads(threads if threads is not None else max(1, len(os.sched_getaffinity(0))))
    _, out_dir = default_paths(view)
    try:
        dataset = open_dataset(view)
        trainer = SFTTrainer(view, dataset, out_dir, log=lambda s: print(s, flush=True))
    except (FileNotFoundError, ValueError, KeyError) as exc:  # a bad file is one line naming it (rlfleet.untrusted)
        print(f"sft: {exc.args[0] if isinstance(exc, KeyError) and exc.args else exc}", file=sys.stderr)
        return 1
    print(
        f"sft: {view.model.model_type} on {len(dataset)} episodes ({trainer.num_samples} samples) from "
        f"{dataset.root}, {view.max_steps} steps of batch {view.batch_size}",
        flush=True,
    )
    summary = trainer.train()
    path = trainer.save(summary)
    print(
        f"sft: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} in {summary['wall_time_s']:.0f}s; "
        f"model written to {path}\n  fine-tune it with RL: actor.model.model_path={path}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

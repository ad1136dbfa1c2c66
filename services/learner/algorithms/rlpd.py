"""RLPD (``algorithm.name: rlpd``; Ball et al. 2023, "Efficient Online RL with Offline Data"): SAC whose every batch
is drawn half from the replay buffer of the run's own transitions and half from demonstrations.

The demonstrations are a LeRobot v3.0 dataset (``sft.dataset_path``; what ``coordinatorctl collect-demos`` writes),
read once at set-up as hostile files (rlfleet.data.datasets) and kept as transitions in a second buffer: frame t of an
episode with frame t + 1 as its next observation and ``next.reward`` as its reward (an episode's last frame has no
next observation and is left out). Each rank keeps its share of them, as of the replay buffer. The rest is SAC's
(sac.py): ``algorithm.demo_ratio`` of each rank's rows come from the demonstrations, the others from the replay
buffer. RLPD's other two ingredients are keys of the config (``pandapickcube_vision_rlpd_cnn``): LayerNorm in the
critics (``actor.model.critic_layer_norm``) and a high update-to-data ratio (``algorithm.utd_ratio``).
"""

from __future__ import annotations

import logging

import numpy as np

from rlfleet.errors import FailedPrecondition
from services.learner.algorithms.sac import SacAlgorithm
from services.learner.replay import ReplayBuffer, buffer_bytes

log = logging.getLogger(__name__)


def demo_transitions(dataset, obs_keys, action_dim: int) -> dict[str, np.ndarray]:
    """Every episode of ``dataset`` (rlfleet.data.datasets.Dataset) -> transitions with the replay buffer's field
    names; the policy's observation keys ``obs_keys`` must all be in it and its actions ``action_dim`` wide."""
    parts: dict[str, list[np.ndarray]] = {}
    for i, ep in enumerate(dataset):
        missing = sorted(set(obs_keys) - set(ep.observations))
        if missing:
            raise FailedPrecondition(
                f"sft.dataset_path: {dataset.root} has no observation {missing} the policy sees "
                f"(it has {sorted(ep.observations)}; sft.dataset_keys maps them)"
            )
        if ep.actions.shape[1] != action_dim:
            raise FailedPrecondition(
                f"sft.dataset_path: {dataset.root}: episode {i}'s actions are {ep.actions.shape[1]}-D, the env's "
                f"{action_dim}-D"
            )
        n = ep.length - 1
        if n <= 0:
            continue
        for k in obs_keys:
            parts.setdefault(f"obs.{k}", []).append(ep.observations[k][:-1])
            parts.setdefault(f"next_obs.{k}", []).append(ep.observations[k][1:])
        parts.setdefault("action", []).append(np.clip(ep.actions[:-1], -1.0, 1.0))
        parts.setdefault("reward", []).append(ep.rewards[:-1])
        for flag in ("terminated", "truncated"):
            parts.setdefault(flag, []).append(np.zeros(n, bool))
        parts.setdefault("weights_version", []).append(np.full(n, -1, np.int32))
    if not parts:
        raise FailedPrecondition(f"sft.dataset_path: {dataset.root} holds no episode of two frames or more")
    return {k: np.concatenate(v) for k, v in parts.items()}


class RlpdAlgorithm(SacAlgorithm):
    name = "rlpd"

    def __init__(self, view, group):
        super().__init__(view, group)
        if not 0.0 < self.alg.demo_ratio < 1.0:
            raise FailedPrecondition(f"algorithm.demo_ratio: {self.alg.demo_ratio} is not in (0, 1)")
        self.demos: ReplayBuffer | None = None  # the demonstrations' transitions, this rank's share
        self._ds = None

    def _dataset(self):
        """The demonstrations (opened once; rlfleet.data.datasets reads and checks the files)."""
        if self._ds is None:
            from services.learner.sft import open_demonstrations

            v = self.view
            self._ds = open_demonstrations(v.dataset_path, v.dataset_keys, v.log_path, v.experiment_name)
        return self._ds

    def planned_bytes(self, obs_specs: dict, action_dim: int) -> tuple[int, str]:
        need, key = super().planned_bytes(obs_specs, action_dim)
        frames = sum(int(e["length"]) for e in self._dataset().episodes_meta)  # the metadata: nothing decoded yet
        demos = buffer_bytes(max(frames, 1), self._specs(obs_specs), action_dim, self.group.world)
        return need + demos, f"{key} and the {frames:,} frames of sft.dataset_path's demonstrations"

    def setup(self, obs_specs: dict, action_dim: int) -> None:
        super().setup(obs_specs, action_dim)
        ds = self._dataset()
        rows = demo_transitions(ds, sorted(obs_specs), action_dim)
        n = len(rows["reward"])
        self.demos = ReplayBuffer(
            max(n, self.group.world),
            self._specs(obs_specs),
            action_dim,
            seed=self.view.seed + 1,
            rank=self.group.rank,
            world_size=self.group.world,
        )
        self.demos.add(rows)
        if self.group.is_leader:
            print(
                f"learner: rlpd: {n:,} demonstration transitions from {len(ds)} episodes of {ds.root} "
                f"({self.alg.demo_ratio:.0%} of every batch)",
                flush=True,
            )

    def sample(self, n: int) -> dict[str, np.ndarray]:
        n_demo = int(round(n * self.alg.demo_ratio))
        online, demo = self.buffer.sample(n - n_demo), self.demos.sample(n_demo)
        return {k: np.concatenate([online[k], demo[k]]) for k in online}

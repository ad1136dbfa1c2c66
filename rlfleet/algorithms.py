"""RL algorithms by ``algorithm.name``: one declarative entry each (data only, torch-free: config validation and
the coordinator read it). An entry names the class implementing the learner's algorithm seam
(services/learner/algorithms/base.py), imported only by the learner that runs it, and says in one line what it is.

Adding an algorithm: its module under services/learner/algorithms/, one entry here, its ``algorithm.*`` keys in the
default config (docs/adding-an-algorithm.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.registry import lookup


@dataclass(frozen=True)
class AlgorithmEntry:
    name: str  # the value of algorithm.name
    module: str  # "package.module:Class" implementing services.learner.algorithms.base.Algorithm
    description: str  # one line: what it trains and on what data
    on_policy: bool = True  # trains on each epoch's rollouts once (else from a replay buffer)
    # the update's metrics on the console's progress line and in `coordinatorctl status`: (label, metric, format)
    progress: tuple[tuple[str, str, str], ...] = (
        ("policy_loss", "train/actor/policy_loss", "+.3f"),
        ("value_loss", "train/critic/value_loss", ".3f"),
        ("kl", "train/actor/approx_kl", ".4f"),
    )


OFF_POLICY_PROGRESS = (
    ("critic_loss", "train/critic/loss", ".3f"),
    ("q", "train/critic/q_mean", "+.2f"),
    ("alpha", "train/alpha", ".3f"),
    ("replay", "replay/size", ".0f"),
)


ALGORITHMS: dict[str, AlgorithmEntry] = {
    entry.name: entry
    for entry in (
        AlgorithmEntry(
            "ppo",
            "services.learner.algorithms.ppo:PpoAlgorithm",
            "PPO's clipped-ratio update on each epoch's rollouts, advantages by GAE (algorithm.adv_type: gae)",
        ),
        AlgorithmEntry(
            "grpo",
            "services.learner.algorithms.ppo:PpoAlgorithm",
            "PPO's update on group-relative advantages of whole episodes, no critic (algorithm.adv_type: grpo)",
        ),
        AlgorithmEntry(
            "sac",
            "services.learner.algorithms.sac:SacAlgorithm",
            "Soft Actor-Critic from a replay buffer of every rollout's transitions (actor.model.model_type: sac)",
            on_policy=False,
            progress=OFF_POLICY_PROGRESS,
        ),
        AlgorithmEntry(
            "rlpd",
            "services.learner.algorithms.rlpd:RlpdAlgorithm",
            "SAC with every batch half from demonstrations (sft.dataset_path), LayerNorm critics, a high UTD ratio",
            on_policy=False,
            progress=OFF_POLICY_PROGRESS,
        ),
    )
}


def get_algorithm(name: str) -> AlgorithmEntry:
    """The entry of ``name``, or UnknownName (a KeyError) with the did-you-mean."""
    return lookup(ALGORITHMS, name, "algorithm.name")

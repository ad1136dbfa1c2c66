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
        ),
        AlgorithmEntry(
            "rlpd",
            "services.learner.algorithms.rlpd:RlpdAlgorithm",
            "SAC with every batch half from demonstrations (sft.dataset_path), LayerNorm critics, a high UTD ratio",
            on_policy=False,
        ),
    )
}


def get_algorithm(name: str) -> AlgorithmEntry:
    """The entry of ``name``, or UnknownName (a KeyError) with the did-you-mean."""
    return lookup(ALGORITHMS, name, "algorithm.name")

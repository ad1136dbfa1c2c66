"""The algorithm seam: ``algorithm.name`` picks the module (rlfleet/algorithms.py's entry), checked when the config
loads; every entry's class implements the interface."""

from __future__ import annotations

import inspect

import pytest
import torch

from rlfleet.algorithms import ALGORITHMS
from rlfleet.config import ConfigError, load_config
from rlfleet.config.views import learner_view
from rlfleet.registry import load_object
from services.learner.algorithms.base import Algorithm
from services.learner.algorithms.factory import make_algorithm
from services.learner.group import RankGroup

torch.set_num_threads(1)


def test_an_unknown_algorithm_name_is_refused_with_the_closest_one():
    with pytest.raises(
        ConfigError, match=r"'algorithm\.name': unknown algorithm 'ppp'; did you mean 'ppo'\? \(known: "
    ):
        load_config(None, ["algorithm.name=ppp"])


def test_grpo_by_name_needs_its_advantages():
    with pytest.raises(ConfigError, match=r"'algorithm\.adv_type': 'gae' with algorithm\.name grpo"):
        load_config(None, ["algorithm.name=grpo"])


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_entry_names_a_class_that_implements_the_seam(name):
    cls = load_object(ALGORITHMS[name].module)
    assert issubclass(cls, Algorithm) and not inspect.isabstract(cls), name
    assert ALGORITHMS[name].description


def test_the_factory_builds_the_configured_algorithm():
    algorithm = make_algorithm(learner_view(load_config()), RankGroup())
    assert type(algorithm).__name__ == "PpoAlgorithm" and algorithm.name == "ppo"

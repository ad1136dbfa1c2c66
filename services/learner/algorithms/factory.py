"""``algorithm.name`` -> the learner's algorithm object: the entry in rlfleet/algorithms.py names its class."""

from __future__ import annotations

from rlfleet.algorithms import get_algorithm
from rlfleet.registry import load_object


def make_algorithm(view, group):
    """The algorithm the learner's config names, for this rank (an unknown name: UnknownName, did-you-mean)."""
    return load_object(get_algorithm(view.algorithm.name).module)(view, group)

"""Confidence intervals of success rates (rlfleet/data/intervals.py)."""

import random

import pytest

from rlfleet.data.intervals import format_rate, paired_difference, wilson


def test_wilson_matches_the_textbook_values():
    low, high = wilson(80, 100)
    assert (round(low, 4), round(high, 4)) == (0.7112, 0.8666)
    assert wilson(0, 10)[0] == 0.0 and 0.27 < wilson(0, 10)[1] < 0.28  # 0/10: [0, 27.8%]
    assert wilson(10, 10)[1] > 1 - 1e-9 and 0.72 < wilson(10, 10)[0] < 0.73
    assert wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="within 0..5"):
        wilson(6, 5)
    assert format_rate(80, 100) == "80.0% [71.1, 86.7]"


def test_wilson_covers_the_true_rate_about_95_percent_of_the_time():
    rng = random.Random(0)
    p, n, trials = 0.8, 100, 2000
    hits = 0
    for _ in range(trials):
        k = sum(rng.random() < p for _ in range(n))
        low, high = wilson(k, n)
        hits += low <= p <= high
    assert 0.93 <= hits / trials <= 0.97


def test_paired_difference():
    same = [True] * 60 + [False] * 40
    d, low, high = paired_difference(same, same)
    assert d == 0.0 and low <= 0.0 <= high and high - low < 0.1  # identical outcomes: a tight interval around 0
    d, low, high = paired_difference([True] * 50, [False] * 50)
    assert d == 1.0 and 0.85 < low < 0.95 and high == 1.0
    # the pairing helps: 10 episodes flip from fail to success, the rest agree -> the interval excludes 0
    a = [True] * 50 + [True] * 10 + [False] * 40
    b = [True] * 50 + [False] * 10 + [False] * 40
    d, low, high = paired_difference(a, b)
    assert abs(d - 0.1) < 1e-12 and low > 0.0 and high < 0.2
    with pytest.raises(ValueError, match="same episodes"):
        paired_difference([True], [True, False])

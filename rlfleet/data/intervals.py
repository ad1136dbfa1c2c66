"""Confidence intervals for success rates: how much one evaluation's number can be trusted.

A 100-episode evaluation of a policy that succeeds 80% of the time reports anything from about 71% to 87% (95%
interval), so a change of a few points between two checkpoints is usually noise. Every evaluation rlfleet prints
carries its interval, and ``coordinatorctl eval --compare`` reports the difference of two checkpoints evaluated on
the same episodes with an interval for paired outcomes.

- :func:`wilson`: the Wilson score interval of k successes in n episodes (good at 0% and 100% and small n, where
  the normal approximation is not).
- :func:`paired_difference`: the interval of p_A - p_B when A and B ran the same n episodes (Newcombe's hybrid
  score interval for paired proportions, built from the two Wilson intervals and the outcomes' correlation): the
  pairing removes the episodes' own difficulty from the comparison, so it is tighter than comparing two
  independent intervals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054  # the two-sided 95% normal quantile


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """(low, high) of the Wilson score interval for ``successes`` of ``n``; (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be within 0..{n}, got {successes}")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(a: Sequence[bool], b: Sequence[bool], z: float = Z95) -> tuple[float, float, float]:
    """(difference, low, high) of success rate A minus B over the same episodes (``a[i]``, ``b[i]``: episode i's
    outcome under A and under B)."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes need the same episodes: {len(a)} vs {len(b)}")
    n = len(a)
    if n == 0:
        return 0.0, -1.0, 1.0
    both = sum(1 for x, y in zip(a, b) if x and y)
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    neither = n - both - only_a - only_b
    p1, p2 = (both + only_a) / n, (both + only_b) / n
    l1, u1 = wilson(both + only_a, n, z)
    l2, u2 = wilson(both + only_b, n, z)
    denom = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    phi = (both * neither - only_a * only_b) / math.sqrt(denom) if denom > 0 else 0.0
    diff = p1 - p2
    low = diff - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    high = diff + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return diff, max(-1.0, low), min(1.0, high)


def format_rate(successes: int, n: int) -> str:
    """'80.0% [71.1, 86.7]' (95% Wilson interval, in percent)."""
    if n <= 0:
        return "n/a (0 episodes)"
    low, high = wilson(successes, n)
    return f"{100 * successes / n:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


def format_difference(a: Sequence[bool], b: Sequence[bool]) -> str:
    """'+5.0 points [-2.1, +12.3]' (A minus B over the same episodes, 95% paired interval, in points)."""
    diff, low, high = paired_difference(a, b)
    return f"{100 * diff:+.1f} points [{100 * low:+.1f}, {100 * high:+.1f}]"


def rate_of(rate: float, n: int) -> str:
    """:func:`format_rate` of a success rate measured over ``n`` episodes (the count recovered from the mean)."""
    return format_rate(int(round(rate * n)), int(n))

"""benchmarks/action_cost.py: the env alone with random and scripted-expert actions, taken in turns."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import action_cost  # noqa: E402


def test_both_kinds_of_steps_are_timed_and_the_expert_grasps_the_cube():
    out = action_cost.env_alone(100)
    assert set(out) == {"random", "expert"}
    for rate, contacts in out.values():
        assert rate > 0 and contacts > 0
    # the expert's steps hold the cube between the fingers: more contacts than the cube resting on the floor alone
    assert out["expert"][1] > out["random"][1]

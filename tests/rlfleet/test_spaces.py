"""rlfleet.wire.spaces: the joint spaces of env servers that host different simulators, and padding into them."""

import numpy as np
import pytest

from rlfleet.wire.spaces import TensorSpace, fit_check, joint_spaces, pad_observations

IMG = TensorSpace((16, 16, 3), np.uint8)


def libero():
    return (
        {"agentview": IMG, "wrist": IMG, "state": TensorSpace((8,), np.float32, -2, 2)},
        TensorSpace((7,), np.float32, -1, 1),
    )


def metaworld():
    return ({"pixels": IMG, "state": TensorSpace((39,), np.float32, -5, 5)}, TensorSpace((4,), np.float32, -1, 1))


def test_joint_spaces_take_every_entry_pad_1d_and_widen_actions():
    obs, action = joint_spaces({"env[0] libero": libero(), "env[1] metaworld": metaworld()})
    assert sorted(obs) == ["agentview", "pixels", "state", "wrist"]
    assert obs["state"].shape == (39,) and action.shape == (7,)
    assert obs["pixels"].shape == (16, 16, 3) and obs["pixels"].dtype == np.uint8
    # bounds: the widest of the servers that have an element, and 0 where a server pads
    assert obs["state"].low[0] == -5 and obs["state"].high[0] == 5 and obs["state"].low[20] == -5
    assert action.low.tolist() == [-1] * 7
    for own, act in (libero(), metaworld()):
        fit_check(own, act, obs, action)  # each server fits the joint spaces


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda o, a: ({**o, "pixels": TensorSpace((32, 32, 3), np.uint8)}, a),
            "observation 'pixels': env[1] has shape [32, 32, 3] but env[0] has [16, 16, 3]; only 1-D entries are padded "
            "(give both simulators the same image size",
        ),
        (
            lambda o, a: ({**o, "state": TensorSpace((8,), np.float64)}, a),
            "observation 'state': env[1] has float64 [8] but env[0] has float32 [39]",
        ),
        (lambda o, a: (o, TensorSpace((2, 4), np.float32)), "action spaces: env[1] has shape [2, 4]"),
    ],
)
def test_joint_spaces_name_what_cannot_be_joined(change, message):
    with pytest.raises(ValueError) as err:
        joint_spaces({"env[1]": change(*libero()), "env[0]": metaworld()})
    assert message in str(err.value)


def test_fit_check_refuses_what_padding_cannot_do():
    obs, action = joint_spaces({"a": libero(), "b": metaworld()})
    with pytest.raises(ValueError, match="observation 'depth' is not among the policy's entries"):
        fit_check({"depth": IMG}, action, obs, action)
    with pytest.raises(ValueError, match=r"observation 'state': float32 \[40\] does not fit"):
        fit_check({"state": TensorSpace((40,), np.float32)}, action, obs, action)
    with pytest.raises(ValueError, match=r"action: float32 \[9\] does not fit the policy's float32 \[7\]"):
        fit_check({}, TensorSpace((9,), np.float32), obs, action)


def test_pad_observations_zero_pads_and_fills_missing_entries():
    obs, _ = joint_spaces({"a": libero(), "b": metaworld()})
    rows = {
        "agentview": np.full((2, 16, 16, 3), 7, np.uint8),
        "wrist": np.ones((2, 16, 16, 3), np.uint8),
        "state": np.arange(16, dtype=np.float32).reshape(2, 8),
    }
    out = pad_observations(rows, obs, 2)
    assert out["state"].shape == (2, 39) and out["state"][:, :8].tolist() == rows["state"].tolist()
    assert not out["state"][:, 8:].any() and not out["pixels"].any() and out["pixels"].shape == (2, 16, 16, 3)
    assert out["agentview"] is rows["agentview"]  # entries already in the policy's shape are passed through
    assert pad_observations({}, obs, 0)["state"].shape == (0, 39)  # no ended rows: empty final observations

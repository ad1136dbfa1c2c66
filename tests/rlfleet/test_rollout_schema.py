"""The rollout schema's value bounds, forward-input specs and loss mask (rlfleet/wire/rollout_schema.py)."""

import re

import numpy as np
import pytest

from rlfleet.wire import rollout_schema
from rlfleet.wire.spaces import TensorSpace
from rlfleet.wire.rollout_schema import InputSpec, SchemaError

SPECS = {"state": TensorSpace((3,), "float32")}
FI = {"actions": InputSpec((2,), "float32")}


def rollout(T=4, N=3):
    tm = {"obs.state": np.zeros((T, N, 3), np.float32), "actions": np.zeros((T, N, 1, 2), np.float32),
          "fi.actions": np.zeros((T, N, 2), np.float32), "log_probs": np.zeros((T, N, 1), np.float32),
          "values": np.zeros((T, N), np.float32), "rewards": np.ones((T, N), np.float32),
          "terminated": np.zeros((T, N), bool), "truncated": np.zeros((T, N), bool),
          "bootstrap_values": np.zeros((T, N), np.float32), "loss_mask": np.ones((T, N), bool)}
    return tm, {"last_values": np.zeros(N, np.float32)}


def check(tm, pe, fi_specs=FI):
    return rollout_schema.check(tm, pe, obs_specs=SPECS, chunk=1, action_dim=2, log_prob_width=1,
                                fi_specs=fi_specs)


def test_every_bounded_field_is_documented_and_a_good_rollout_passes():
    for name, f in {**rollout_schema.TIME_MAJOR, **rollout_schema.PER_ENV}.items():
        assert f.doc, name
        if f.dtype == np.float32:
            assert f.bound is not None and 1e3 <= f.bound <= 1e9, name  # every float field is bounded
    assert check(*rollout()) == (4, 3)


@pytest.mark.parametrize("field", ["values", "actions", "rewards", "bootstrap_values", "log_probs", "fi.actions",
                                   "obs.state", "last_values"])
@pytest.mark.parametrize("value", [3e38, -3e38])
def test_finite_but_huge_values_are_refused_naming_the_field(field, value):
    tm, pe = rollout()
    target = pe if field == "last_values" else tm
    target[field] = target[field].copy()
    target[field].reshape(-1)[-1] = value
    with pytest.raises(SchemaError, match=rf"rollout\['{field}'\]: value {re.escape(f'{value:.4g}')} at index "
                                          rf"\[.*\] is beyond the schema's bound"):
        check(tm, pe)


def test_values_at_the_bound_pass():
    tm, pe = rollout()
    tm["rewards"][:] = rollout_schema.REWARD_BOUND
    tm["values"][:] = -rollout_schema.VALUE_BOUND
    assert check(tm, pe) == (4, 3)


def test_non_finite_values_name_the_place():
    tm, pe = rollout()
    tm["values"][2, 1] = np.nan
    with pytest.raises(SchemaError, match=r"rollout\['values'\]: non-finite values \(first: nan at index \[2, 1\]\)"):
        check(tm, pe)


@pytest.mark.parametrize("field", ["values", "terminated", "bootstrap_values", "loss_mask", "rewards"])
def test_an_extra_trailing_dimension_is_refused(field):
    tm, pe = rollout()
    tm[field] = tm[field][..., None]
    with pytest.raises(SchemaError, match=rf"rollout\['{field}'\]: shape \[4, 3, 1\] where \[(4, 3|T, N)\] was "
                                          rf"expected"):
        check(tm, pe)


def test_forward_inputs_must_be_the_policys():
    tm, pe = rollout()
    with pytest.raises(SchemaError, match=r"rollout\['fi.actions'\]: float32 \[4, 3, 7\] where float "
                                          r"\[4, 3, \*\[2\]\]"):
        check(dict(tm, **{"fi.actions": np.zeros((4, 3, 7), np.float32)}), pe)
    with pytest.raises(SchemaError, match=r"rollout\['fi.actions'\]: int64 \[4, 3, 2\] where float"):
        check(dict(tm, **{"fi.actions": np.zeros((4, 3, 2), np.int64)}), pe)
    assert check(dict(tm, **{"fi.actions": np.zeros((4, 3, 2), np.float64)}), pe) == (4, 3)  # its precision
    with pytest.raises(SchemaError, match=r"unknown tensors \['fi.noise'\]"):
        check(dict(tm, **{"fi.noise": np.zeros((4, 3), np.float32)}), pe)
    with pytest.raises(SchemaError, match=r"missing tensors \['fi.actions'\]"):
        check({k: v for k, v in tm.items() if k != "fi.actions"}, pe)
    # without the policy's specs (None) any forward inputs pass, as before
    assert check(dict(tm, **{"fi.actions": np.zeros((4, 3, 7), np.float32)}), pe, fi_specs=None) == (4, 3)


def test_an_all_false_loss_mask_is_refused_and_one_true_sample_is_enough():
    tm, pe = rollout()
    tm["loss_mask"][:] = False
    with pytest.raises(SchemaError, match=r"rollout\['loss_mask'\]: all 12 samples are masked out"):
        check(tm, pe)
    tm["loss_mask"][3, 2] = True
    assert check(tm, pe) == (4, 3)

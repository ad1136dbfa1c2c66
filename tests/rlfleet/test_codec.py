"""rlfleet.wire.codec: tensors to and from their messages (every received one checked), the one policy-output type,
and the rollout schema's value bounds, forward-input specs and loss mask. (Its per-row noise keys: test_noise.py.)"""

import re

import numpy as np
import pytest
import torch

from rlfleet.wire import codec
from rlfleet.wire.codec import CodecError, DType, InputSpec, PolicyOutput, SchemaError
from rlfleet.wire.spaces import TensorSpace


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool"])
def test_roundtrip(dtype):
    a = (np.arange(24).reshape(2, 3, 4) % 2).astype(dtype)
    b = codec.decode(codec.encode(a))
    assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)


def test_torch_and_maps():
    t = torch.randn(3, 2)
    m = codec.decode_map(codec.encode_map({"x": t, "img": np.zeros((3, 4, 4, 3), np.uint8)}))
    assert np.allclose(m["x"], t.numpy()) and m["img"].shape == (3, 4, 4, 3)


def test_malformed_bytes_named():
    msg = codec.encode(np.zeros((2, 3), np.float32))
    msg.data = msg.data[:-4]
    with pytest.raises(CodecError, match=r"obs\['state'\]: 20 data bytes do not match shape \[2, 3\]"):
        codec.decode(msg, "obs['state']")


def test_unknown_dtype_and_negative_dim():
    msg = codec.encode(np.zeros(3, np.float32))
    msg.dtype = 99
    with pytest.raises(CodecError, match="actions: unknown or unset dtype 99"):
        codec.decode(msg, "actions")
    msg = codec.encode(np.zeros(3, np.float32))
    msg.shape[:] = [-3]
    with pytest.raises(CodecError, match="negative dimension"):
        codec.decode(msg, "actions")


def test_expected_shape_dtype_and_finite():
    msg = codec.encode(np.zeros((2, 4), np.float32))
    with pytest.raises(CodecError, match=r"actions: shape \[2, 4\] where \['N', 3\] was expected"):
        codec.decode(msg, "actions", shape=[None, 3])
    with pytest.raises(CodecError, match="dtype FLOAT32 where INT64 was expected"):
        codec.decode(msg, "actions", dtype=DType.INT64)
    bad = np.zeros((2, 4), np.float32)
    bad[1, 2] = np.nan
    with pytest.raises(CodecError, match=r"actions: non-finite value nan at index \[1, 2\]"):
        codec.decode(codec.encode(bad), "actions", finite=True)


def test_map_key_mismatch():
    specs = {"state": codec.TensorSpec(dtype=DType.FLOAT32, shape=[3])}
    msg = codec.encode_map({"stat": np.zeros((1, 3), np.float32)})
    with pytest.raises(CodecError, match=r"missing \['state'\].*unexpected \['stat'\]"):
        codec.decode_map(msg, "observations", specs=specs, batch=1)


def test_unsupported_numpy_dtype():
    with pytest.raises(CodecError, match="unsupported dtype complex64"):
        codec.encode(np.zeros(2, np.complex64))


def test_element_count_cannot_overflow_past_the_size_check():
    """[2**32, 2**32] with 0 bytes used to pass (the int64 product wraps to 0) and fail later as INTERNAL."""
    from rlfleet.wire import codec

    msg = codec.Tensor(dtype=codec.DType.FLOAT32, shape=[2**32, 2**32], data=b"")
    with pytest.raises(codec.CodecError, match=r"has 18446744073709551616 elements, more than the limit"):
        codec.decode(msg, "obs")
    with pytest.raises(codec.CodecError, match="40 dimensions; at most 32"):
        codec.decode(codec.Tensor(dtype=codec.DType.FLOAT32, shape=[1] * 40, data=b"\0" * 4), "obs")
    with pytest.raises(codec.CodecError, match="spec: unknown or unset dtype 77"):
        codec.numpy_dtype(77, "spec")


def test_a_tiny_weights_chunk_declaring_a_huge_tensor_allocates_nothing_big():
    import tracemalloc

    from rlfleet.v1 import inference_pb2
    from rlfleet.wire import codec, weights

    chunk = inference_pb2.WeightsChunk(version=1, name="w", offset=0)
    chunk.data.dtype = codec.DType.FLOAT32
    chunk.data.shape[:] = [1 << 28]  # 1 GiB declared, 4 bytes sent
    chunk.data.data = b"\0\0\0\0"
    tracemalloc.start()
    with pytest.raises(codec.CodecError, match=r"bytes \[4, 1073741824\) were never sent"):
        weights.assemble([chunk])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_policy_output_from_torch_to_numpy_and_by_rows():
    out = PolicyOutput(torch.ones(4, 1, 2, dtype=torch.float64), torch.zeros(4, 1), None, {"tokens": torch.arange(4)})
    assert out.weights_version == -1  # straight from a policy: not stamped
    res = out.to_numpy(5, rows=3)  # the fourth row is batch padding
    assert res.actions.dtype == np.float32 and res.actions.shape == (3, 1, 2) and res.weights_version == 5
    assert res.values is None and res.forward_inputs["tokens"].tolist() == [0, 1, 2]
    part = res.rows(1, 3)
    assert part.actions.shape == (2, 1, 2) and part.forward_inputs["tokens"].tolist() == [1, 2]
    assert part.weights_version == 5


# --- the rollout schema: value bounds, forward-input specs and loss mask ----------------------------------------------
SPECS = {"state": TensorSpace((3,), "float32")}
FI = {"actions": InputSpec((2,), "float32")}


def rollout(T=4, N=3):
    tm = {
        "obs.state": np.zeros((T, N, 3), np.float32),
        "actions": np.zeros((T, N, 1, 2), np.float32),
        "fi.actions": np.zeros((T, N, 2), np.float32),
        "log_probs": np.zeros((T, N, 1), np.float32),
        "values": np.zeros((T, N), np.float32),
        "rewards": np.ones((T, N), np.float32),
        "terminated": np.zeros((T, N), bool),
        "truncated": np.zeros((T, N), bool),
        "loss_mask": np.ones((T, N), bool),
    }
    return tm, codec.make_tail({"state": np.zeros((N, 3), np.float32)})


def check(tm, pe, fi_specs=FI):
    return codec.check_rollout(tm, pe, obs_specs=SPECS, chunk=1, action_dim=2, log_prob_width=1, fi_specs=fi_specs)


def test_every_bounded_field_is_documented_and_a_good_rollout_passes():
    for name, f in codec.TIME_MAJOR.items():
        assert f.doc, name
        if f.dtype == np.float32:
            assert f.bound is not None and 1e3 <= f.bound <= 1e9, name  # every float field is bounded
    assert check(*rollout()) == (4, 3)


@pytest.mark.parametrize(
    "field", ["values", "actions", "rewards", "log_probs", "fi.actions", "obs.state", "next_obs.state"]
)
@pytest.mark.parametrize("value", [3e38, -3e38])
def test_finite_but_huge_values_are_refused_naming_the_field(field, value):
    tm, pe = rollout()
    target = pe if codec.is_tail(field) else tm
    target[field] = target[field].copy()
    target[field].reshape(-1)[-1] = value
    with pytest.raises(
        SchemaError,
        match=rf"rollout\['{field}'\]: value {re.escape(f'{value:.4g}')} at index "
        rf"\[.*\] is beyond the schema's bound",
    ):
        check(tm, pe)


def test_values_at_the_bound_pass():
    tm, pe = rollout()
    tm["rewards"][:] = codec.REWARD_BOUND
    tm["values"][:] = -codec.VALUE_BOUND
    assert check(tm, pe) == (4, 3)


def test_non_finite_values_name_the_place():
    tm, pe = rollout()
    tm["values"][2, 1] = np.nan
    with pytest.raises(SchemaError, match=r"rollout\['values'\]: non-finite values \(first: nan at index \[2, 1\]\)"):
        check(tm, pe)


@pytest.mark.parametrize("field", ["values", "terminated", "truncated", "loss_mask", "rewards"])
def test_an_extra_trailing_dimension_is_refused(field):
    tm, pe = rollout()
    tm[field] = tm[field][..., None]
    with pytest.raises(
        SchemaError,
        match=rf"rollout\['{field}'\]: shape \[4, 3, 1\] where \[(4, 3|T, N)\] was "
        rf"expected",
    ):
        check(tm, pe)


def test_the_tail_carries_next_and_final_observations():
    """Each env's observation after the last step, and a final observation at every row whose episode was
    truncated (the learner bootstraps from it); rows increase and name rows whose episode ended."""
    tm, pe = rollout()
    tm["truncated"][1, 2] = True
    with pytest.raises(SchemaError, match=r"truncated at row 5 \(t=1, env 2\) has no final observation"):
        check(tm, pe)
    ok = codec.make_tail({"state": np.zeros((3, 3), np.float32)}, [5], {"state": np.ones((1, 3), np.float32)})
    assert check(tm, ok) == (4, 3)
    tm["terminated"][2, 0] = True  # a final observation at a terminated row is allowed too
    both = codec.make_tail({"state": np.zeros((3, 3), np.float32)}, [5, 6], {"state": np.ones((2, 3), np.float32)})
    assert check(tm, both) == (4, 3)
    bad = dict(both, final_index=np.array([6, 5]))
    with pytest.raises(SchemaError, match=r"rollout\['final_index'\]: rows must increase within 0\.\.11"):
        check(tm, bad)
    bad = dict(both, final_index=np.array([5, 7]))
    with pytest.raises(SchemaError, match=r"row 7 \(t=2, env 1\) has a final observation but its episode did not"):
        check(tm, bad)
    bad = dict(both, **{"final_obs.state": np.ones((3, 3), np.float32)})
    with pytest.raises(
        SchemaError, match=r"rollout\['final_obs.state'\]: float32 \[3, 3\] where float32 \[2, \*\[3\]\]"
    ):
        check(tm, bad)
    bad = dict(both, **{"next_obs.state": np.zeros((2, 3), np.float32)})
    with pytest.raises(SchemaError, match=r"rollout\['next_obs.state'\]: float32 \[2, 3\] where float32 \[3,"):
        check(tm, bad)
    with pytest.raises(SchemaError, match=r"missing tensors \['next_obs.state'\]"):
        check(tm, {k: v for k, v in both.items() if k != "next_obs.state"})
    with pytest.raises(SchemaError, match=r"unknown tensors \['final_obs.image'\]"):
        check(tm, dict(both, **{"final_obs.image": np.zeros((2, 3), np.float32)}))


def test_forward_inputs_must_be_the_policys():
    tm, pe = rollout()
    with pytest.raises(
        SchemaError,
        match=r"rollout\['fi.actions'\]: float32 \[4, 3, 7\] where float "
        r"\[4, 3, \*\[2\]\]",
    ):
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

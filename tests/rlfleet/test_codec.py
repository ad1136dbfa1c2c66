import numpy as np
import pytest
import torch

from rlfleet.wire import codec
from rlfleet.wire.codec import CodecError, DType


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

    msg = codec.Tensor(dtype=codec.DType.FLOAT32, shape=[2 ** 32, 2 ** 32], data=b"")
    with pytest.raises(codec.CodecError, match=r"has 18446744073709551616 elements, more than the limit"):
        codec.decode(msg, "obs")
    with pytest.raises(codec.CodecError, match="40 dimensions; at most 32"):
        codec.decode(codec.Tensor(dtype=codec.DType.FLOAT32, shape=[1] * 40, data=b"\0" * 4), "obs")
    with pytest.raises(codec.CodecError, match="spec: unknown or unset dtype 77"):
        codec.numpy_dtype(77, "spec")


def test_a_tiny_weights_chunk_declaring_a_huge_tensor_allocates_nothing_big():
    import tracemalloc

    from rlfleet.wire import codec, weights
    from rlfleet.v1 import inference_pb2

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

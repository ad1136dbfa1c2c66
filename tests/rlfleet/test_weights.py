"""rlfleet.wire.weights: packed chunks (several whole tensors to a message) and their checks."""

from __future__ import annotations

import pytest
import torch

from rlfleet.policies.models.actor_critic import ActorCritic
from rlfleet.v1 import inference_pb2, tensor_pb2
from rlfleet.wire import weights
from rlfleet.wire.codec import CodecError, DType
from rlfleet.wire.spaces import TensorSpace


def _policy_state() -> tuple[ActorCritic, dict[str, torch.Tensor]]:
    m = ActorCritic({"state": TensorSpace((18,), "float32")}, 4, hidden_dims=(128, 128))
    return m, {k: v.clone() for k, v in m.state_dict().items()}


def _wire(chunks) -> list[inference_pb2.WeightsChunk]:
    """The chunks as a receiver parses them."""
    return [inference_pb2.WeightsChunk.FromString(c.SerializeToString()) for c in chunks]


def test_a_small_policy_set_packs_into_one_message_and_round_trips():
    m, state = _policy_state()
    chunks = _wire(weights.iter_chunks(state, 3, obs_specs=m.obs_specs, action_dim=4, packed=True))
    assert len(chunks) == 1 and len(state) == 16  # the default MLP's 16 tensors: one message instead of 16
    assert chunks[0].name == "" and sorted(chunks[0].tensors) == sorted(state)
    version, got, specs, adim, partial = weights.assemble(chunks)
    assert (version, specs, adim, partial) == (3, m.obs_specs, 4, False)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)
    unpacked = list(weights.iter_chunks(state, 3, obs_specs=m.obs_specs, action_dim=4))
    assert len(unpacked) == 16 and not any(c.tensors for c in unpacked)  # toward an older server


def test_packing_fills_messages_up_to_chunk_bytes_and_still_cuts_large_tensors():
    state = {
        "big": torch.arange(100, dtype=torch.float32),  # 400 bytes: cut into 100-byte chunks as before
        "a": torch.ones(10),  # 40 bytes each: two fit in one 100-byte message, the third starts the next
        "b": torch.full((10,), 2.0),
        "c": torch.full((10,), 3.0),
        "half": torch.randn(3, 3).to(torch.bfloat16),
    }
    chunks = _wire(weights.iter_chunks(state, 9, partial=True, chunk_bytes=100, packed=True))
    assert [c.name for c in chunks if c.name] == ["big"] * 4
    assert [sorted(c.tensors) for c in chunks if c.tensors] == [["a", "b"], ["c", "half"]]
    version, got, _, _, partial = weights.assemble(reversed(chunks))  # any order
    assert version == 9 and partial
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)


def test_assemble_refuses_bad_packed_chunks_naming_the_fault():
    state = {"w": torch.arange(4, dtype=torch.float32)}
    (packed,) = _wire(weights.iter_chunks(state, 1, packed=True))
    (single,) = _wire(weights.iter_chunks(state, 1))
    with pytest.raises(CodecError, match=r"weights\['w'\]: bytes \[0, 16\) were sent twice"):
        weights.assemble([packed, single])  # the same tensor packed and as a chunk of its own
    nameless = inference_pb2.WeightsChunk(version=1)
    with pytest.raises(CodecError, match="chunk 0: empty tensor name"):
        weights.assemble([nameless])
    stray = inference_pb2.WeightsChunk(version=1, offset=8)
    stray.tensors["w"].CopyFrom(packed.tensors["w"])
    with pytest.raises(CodecError, match="chunk 0: data or offset 8 without a tensor name"):
        weights.assemble([stray])
    empty_key = inference_pb2.WeightsChunk(version=1)
    empty_key.tensors[""].CopyFrom(packed.tensors["w"])
    with pytest.raises(CodecError, match="chunk 0: a packed tensor with an empty name"):
        weights.assemble([empty_key])
    short = inference_pb2.WeightsChunk(version=1)
    short.tensors["w"].CopyFrom(tensor_pb2.Tensor(dtype=DType.FLOAT32, shape=[4], data=b"\0" * 12))
    with pytest.raises(CodecError, match=r"weights\['w'\]: bytes \[12, 16\) were never sent"):
        weights.assemble([short])
    huge = inference_pb2.WeightsChunk(version=1)
    huge.tensors["w"].CopyFrom(tensor_pb2.Tensor(dtype=DType.FLOAT32, shape=[4], data=b"\0" * 20))
    with pytest.raises(CodecError, match=r"weights\['w'\]: bytes \[0, 20\) outside the tensor's 16"):
        weights.assemble([huge])
    odd = inference_pb2.WeightsChunk(version=1)
    odd.tensors["w"].CopyFrom(tensor_pb2.Tensor(dtype=99, shape=[4], data=b"\0" * 16))
    with pytest.raises(CodecError, match=r"weights\['w'\]: unknown dtype 99"):
        weights.assemble([odd])

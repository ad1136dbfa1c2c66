"""services.learner.publisher toward real servers on loopback: a small set in packed messages to servers that read
them, one tensor per message to a server from before packing, partial updates after the first full set, and a
dead server named without holding up the others."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from rlfleet.config import load_config
from rlfleet.config.views import InferenceView, build_view
from rlfleet.errors import FailedPrecondition
from rlfleet.policies.models.actor_critic import ActorCritic
from rlfleet.v1 import inference_pb2, inference_pb2_grpc
from rlfleet.wire import servers
from rlfleet.wire.spaces import TensorSpace
from services.env.server import CollocatedPolicyServicer, local_policy
from services.learner.publisher import WeightPublisher

SPECS = {"state": TensorSpace((18,), "float32")}


class RecordingServicer(CollocatedPolicyServicer):
    """An env server's policy service that records what each UpdateWeights stream carried; ``older``: it answers
    Describe as a server from before packed chunks (no reads_packed_weights) and fails a stream that packs."""

    def __init__(self, policy, older: bool):
        super().__init__(policy, shared_memory=False)
        self.older = older
        self.streams: list[list[inference_pb2.WeightsChunk]] = []
        self.describes = 0

    def Describe(self, request, context):
        self.describes += 1
        info = super().Describe(request, context)
        if self.older:
            info.ClearField("reads_packed_weights")
        return info

    def UpdateWeights(self, request_iterator, context):
        chunks = list(request_iterator)
        self.streams.append(chunks)
        if self.older and any(c.tensors for c in chunks):
            raise AssertionError("an older server was sent packed chunks it would not read")
        return super().UpdateWeights(iter(chunks), context)


@pytest.fixture
def fleet():
    torch.set_num_threads(1)
    view = build_view(InferenceView, load_config(None, []))
    started = []
    for older in (False, True):
        servicer = RecordingServicer(local_policy(view), older)
        server = servers.make_server(max_workers=4)
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
        address = servers.bind(server, "127.0.0.1:0")
        server.start()
        started.append((server, address, servicer))
    yield started
    for server, _, _ in started:
        server.stop(0)


def _publish(publisher: WeightPublisher, addresses: list[str], model: torch.nn.Module, version: int) -> int:
    state = model.state_dict()
    names = list(state)

    def gather(wanted):
        yield {n: state[n] for n in wanted}

    def set_bytes(wanted):
        return sum(state[n].numel() * state[n].element_size() for n in wanted)

    return publisher.publish(addresses, version, gather, names, names, SPECS, 4, set_bytes)


def _held(servicer: RecordingServicer) -> dict[str, torch.Tensor]:
    return servicer.policy.model.state_dict()


def test_a_small_set_goes_packed_to_new_servers_and_one_tensor_a_message_to_older_ones(fleet):
    (_, new_addr, new), (_, old_addr, old) = fleet
    publisher = WeightPublisher(timeout=30, shared_memory=False)
    model = ActorCritic(SPECS, 4, hidden_dims=(128, 128), init_log_std=-1.0)
    n = len(model.state_dict())
    for version in range(3):
        with torch.no_grad():
            model.log_std.add_(0.1)
        sent = _publish(publisher, [new_addr, old_addr], model, version)
        assert sent == sum(t.numel() * t.element_size() for t in model.state_dict().values())
        for servicer in (new, old):
            assert servicer.policy.version == version
            for k, v in model.state_dict().items():
                assert torch.equal(_held(servicer)[k], v), k
    assert [len(s) for s in new.streams] == [1, 1, 1]  # the whole 0.16 MB set in one message
    assert [len(s) for s in old.streams] == [n, n, n]
    assert new.streams[0][0].observation_space and not new.streams[1][0].observation_space  # full, then partial
    assert not new.streams[0][0].partial and new.streams[1][0].partial and old.streams[2][0].partial
    assert (new.describes, old.describes) == (1, 1)  # asked once per channel
    assert publisher.last_wire.bytes > 0 and publisher.last_wire.seconds > 0
    publisher.close()


def test_a_dead_server_is_named_and_the_others_still_get_the_set(fleet):
    (_, new_addr, new), _ = fleet
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    publisher = WeightPublisher(timeout=30, shared_memory=False)
    model = ActorCritic(SPECS, 4, hidden_dims=(128, 128))
    with pytest.raises(FailedPrecondition, match=f"weight update to inference server {dead} failed"):
        _publish(publisher, [new_addr, dead], model, 5)
    assert new.policy.version == 5 and new_addr in publisher.synced and dead not in publisher.synced
    obs = np.zeros((2, 18), np.float32)
    assert new.policy.act_now({"state": obs}, True).actions.shape == (2, 1, 4)
    publisher.close()


def test_a_receiver_that_serves_only_update_weights_gets_one_tensor_a_message():
    """A minimal receiver (no Describe: UNIMPLEMENTED, as the wire benchmark's) is taken for an older server."""
    import grpc

    from rlfleet.wire import weights

    received: list[list[inference_pb2.WeightsChunk]] = []

    def update(request_iterator, context):
        chunks = list(request_iterator)
        received.append(chunks)
        version, state, *_ = weights.assemble(iter(chunks))
        return inference_pb2.UpdateWeightsResponse(version=version, num_tensors=len(state))

    handler = grpc.method_handlers_generic_handler(
        "rlfleet.v1.InferenceService",
        {
            "UpdateWeights": grpc.stream_unary_rpc_method_handler(
                update,
                request_deserializer=inference_pb2.WeightsChunk.FromString,
                response_serializer=inference_pb2.UpdateWeightsResponse.SerializeToString,
            )
        },
    )
    server = servers.make_server(max_workers=2)
    server.add_generic_rpc_handlers((handler,))
    address = servers.bind(server, "127.0.0.1:0")
    server.start()
    try:
        publisher = WeightPublisher(timeout=30, shared_memory=False)
        model = ActorCritic(SPECS, 4, hidden_dims=(128, 128))
        _publish(publisher, [address], model, 1)
        assert len(received) == 1 and len(received[0]) == len(model.state_dict())
        assert not any(c.tensors for c in received[0])
        publisher.close()
    finally:
        server.stop(0)

"""services.inference.engine: the engine acting only through the one backend interface
(services.inference.backend), and the one factory (services.inference.factory) that picks the backend by
rollout.backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfleet.policies.backends import BACKENDS
from rlfleet.policies.models.actor_critic import ActorCritic
from rlfleet.wire.codec import PolicyOutput
from rlfleet.wire.spaces import TensorSpace
from services.inference import factory
from services.inference.backend import BackendStats, InferenceBackend
from services.inference.batcher import DynamicBatcher
from services.inference.engine import InferenceEngine
from services.inference.factory import make_inference_backend
from tests.conftest import small_config

SPECS = {"state": TensorSpace((13,), "float32")}


def test_every_registered_backend_has_one_implementation():
    assert set(factory.IMPLEMENTATIONS) == set(BACKENDS)
    hf = make_inference_backend("hf")
    assert isinstance(hf, DynamicBatcher) and isinstance(hf, InferenceBackend) and hf.name == "hf"
    with pytest.raises(
        ValueError, match=r"rollout.backend: unknown backend 'vlm'; did you mean 'vllm'\? \(known: hf, vllm\)"
    ):
        make_inference_backend("vlm")
    with pytest.raises(ValueError, match="unknown backend 'tgi'"):
        InferenceEngine(small_config().actor.model, backend="tgi")


class Recording(InferenceBackend):
    """A backend that answers every request with zeros and records what the engine asked of it."""

    name = "recording"

    def __init__(self, on_fatal=None):
        super().__init__(on_fatal)
        self.calls, self.version = [], -1

    def close(self):
        self.calls.append("close")

    def set_weights(self, policy, version):
        self.calls.append(("set_weights", version))
        self.version = version

    def submit(self, request):
        self.calls.append(("submit", request.rows, request.stream))
        request.future.set_result(
            PolicyOutput(
                np.zeros((request.rows, 1, 4), np.float32),
                np.zeros((request.rows, 1), np.float32),
                None,
                {},
                self.version,
            )
        )

    def stats(self):
        return BackendStats(sum(1 for c in self.calls if c[0] == "submit"), 3, 12)


def test_the_engine_acts_only_through_the_backend(monkeypatch):
    monkeypatch.setitem(factory.IMPLEMENTATIONS, "hf", lambda options: Recording(options.on_fatal))
    fatal = []
    engine = InferenceEngine(small_config().actor.model, on_fatal=fatal.append)
    assert isinstance(engine.backend, Recording) and engine.backend.on_fatal == fatal.append
    torch.manual_seed(0)
    engine.set_weights(2, ActorCritic(SPECS, 4, hidden_dims=[64, 64]).state_dict(), obs_specs=SPECS, action_dim=4)
    obs = {"state": np.zeros((3, 13), np.float32)}
    assert engine.act_now(obs, True).weights_version == 2
    assert engine.submit(obs, False, stream=7).result().actions.shape == (3, 1, 4)
    info = engine.info()
    assert (info.weights_version, info.requests_served, info.batches_run, info.mean_batch_rows) == (2, 2, 3, 4.0)
    assert info.num_parameters == sum(p.numel() for p in engine.model.parameters())
    engine.stop()
    assert engine.backend.calls == [("set_weights", 2), ("submit", 3, 0), ("submit", 3, 7), "close"]

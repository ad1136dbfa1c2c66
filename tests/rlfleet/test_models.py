import numpy as np
import pytest
import torch

from rlfleet.policies.models.actor_critic import ActorCritic, RunningMeanStd
from rlfleet.wire import weights
from rlfleet.wire.spaces import TensorSpace


@pytest.mark.parametrize("logprob_type, width", [("chunk_level", 1), ("action_level", 1), ("token_level", 4)])
def test_act_and_evaluate_share_log_prob(logprob_type, width):
    torch.manual_seed(0)
    m = ActorCritic({"state": TensorSpace((13,), "float32")}, 4, logprob_type=logprob_type)
    obs = {"state": torch.randn(32, 13)}
    out = m.act(obs)
    assert out.actions.shape == (32, 1, 4) and out.log_probs.shape == (32, width) == (32, m.log_prob_width)
    ev = m.evaluate(obs, out.forward_inputs)
    assert torch.allclose(out.log_probs, ev.log_probs, atol=1e-6) and torch.allclose(out.values, ev.values)
    assert torch.allclose(ev.log_probs.sum(1), m.distribution(obs)[0].log_prob(out.actions[:, 0]).sum(-1), atol=1e-5)
    det = m.act(obs, deterministic=True)
    assert torch.allclose(det.actions[:, 0], m.distribution(obs)[0].mean)


def test_running_mean_std_matches_numpy():
    rms = RunningMeanStd((3,))
    data = np.random.default_rng(0).normal(2.0, 3.0, size=(1000, 3))
    for chunk in np.split(data, 10):
        rms.update(torch.from_numpy(chunk))
    assert np.allclose(rms.mean.numpy(), data.mean(0), atol=1e-3)
    assert np.allclose(rms.var.numpy(), data.var(0), rtol=1e-3)


def test_cnn_policy_on_images():
    specs = {
        "state": TensorSpace((7,), "float32"),
        "wrist": TensorSpace((32, 32, 3), "uint8"),
        "third_person": TensorSpace((32, 32, 3), "uint8"),
    }
    m = ActorCritic(specs, 4, model_type="cnn", image_feature_dim=32)
    obs = {
        "state": torch.randn(2, 7),
        "wrist": torch.randint(0, 255, (2, 32, 32, 3), dtype=torch.uint8),
        "third_person": torch.randint(0, 255, (2, 32, 32, 3), dtype=torch.uint8),
    }
    out = m.act(obs)
    assert out.actions.shape == (2, 1, 4) and torch.isfinite(out.log_probs).all()


def test_weights_chunk_roundtrip():
    m = ActorCritic({"state": TensorSpace((5,), "float32")}, 2)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    state["extra_bf16"] = torch.randn(3, 3).to(torch.bfloat16)
    chunks = list(weights.iter_chunks(state, 7, obs_specs=m.obs_specs, action_dim=2, chunk_bytes=100))
    assert len(chunks) > len(state)
    version, got, specs, adim, partial = weights.assemble(chunks)
    assert version == 7 and specs == m.obs_specs and adim == 2 and not partial
    for k in state:
        assert got[k].dtype == state[k].dtype and torch.equal(got[k], state[k])


def test_weights_assemble_checks_coverage_not_byte_counts():
    import pytest

    from rlfleet.wire.codec import CodecError

    state = {"w": torch.arange(60, dtype=torch.float32)}  # 240 bytes -> chunks at 0, 100, 200
    chunks = list(weights.iter_chunks(state, 1, chunk_bytes=100))
    assert [c.offset for c in chunks] == [0, 100, 200]
    dup = [chunks[0], chunks[0], chunks[2]]  # chunk 0 twice, chunk 1 never: same byte count as a full set
    with pytest.raises(CodecError, match=r"weights\['w'\]: bytes \[0, 100\) were sent twice"):
        weights.assemble(dup)
    with pytest.raises(CodecError, match=r"weights\['w'\]: bytes \[100, 200\) were never sent"):
        weights.assemble([chunks[0], chunks[2]])
    with pytest.raises(CodecError, match=r"bytes \[200, 240\) were never sent"):
        weights.assemble(chunks[:2])
    _, got, *_ = weights.assemble([chunks[2], chunks[0], chunks[1]])  # any order is fine
    assert torch.equal(got["w"], state["w"])

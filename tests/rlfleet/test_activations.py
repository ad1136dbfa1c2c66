"""The policies' tanh (rlfleet.policies.models.activations): numpy's forward on CPU, torch's backward, and the
properties acting and learning rely on (a row's numbers do not depend on its batch)."""

import numpy as np
import pytest
import torch
from torch import nn

from rlfleet.policies.models.activations import ACTIVATIONS, Tanh, tanh
from rlfleet.policies.models.actor_critic import ActorCritic
from rlfleet.wire.spaces import TensorSpace


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> float:
    spacing = np.spacing(np.abs(exact.float().numpy()))
    return float((np.abs(got.double().numpy() - exact.numpy()) / spacing).max())


def test_tanh_is_within_two_ulps_of_the_exact_value():
    x = torch.cat([torch.randn(512, 128) * 3, torch.linspace(-20, 20, 4096).reshape(-1, 128)])
    y = tanh(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    exact = torch.tanh(x.double())
    assert _ulps(y, exact) <= 2.0
    assert _ulps(torch.tanh(x), exact) <= 1.0  # torch's own: correctly rounded (and 6x slower on this CPU)
    assert torch.equal(tanh(torch.tensor([0.0, -0.0, 30.0, -30.0])), torch.tensor([0.0, -0.0, 1.0, -1.0]))
    x64 = torch.randn(64, 16, dtype=torch.float64)
    assert tanh(x64).dtype == torch.float64 and torch.allclose(tanh(x64), torch.tanh(x64), rtol=1e-14, atol=0)


def test_gradient_is_torchs_tanh_backward():
    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(tanh, (x,))
    x32 = torch.randn(512, 128, requires_grad=True)
    g = torch.randn(512, 128)
    (tanh(x32) * g).sum().backward()
    assert torch.equal(x32.grad, torch.ops.aten.tanh_backward(g, tanh(x32.detach())))
    (grad,) = torch.autograd.grad(tanh(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        grad.sum().backward()  # no second derivative (no policy takes one)


def test_a_rows_value_does_not_depend_on_its_batch_or_layout():
    x = torch.randn(512, 128) * 2
    whole = tanh(x)
    for start in range(0, 512, 32):  # acting's 32-row blocks against the learner's 512-row minibatch
        assert torch.equal(tanh(x[start : start + 32]), whole[start : start + 32])
    assert torch.equal(tanh(x[:, 3:77]), whole[:, 3:77])  # a strided view
    assert torch.equal(tanh(x.t()).t(), whole)
    with torch.inference_mode():  # acting records no graph: the same numbers
        assert torch.equal(tanh(x), whole)
    leaf = x.clone().requires_grad_()
    assert torch.equal(tanh(leaf).detach(), whole)
    with torch.no_grad():  # a tensor that requires grad, in a block that records none
        assert torch.equal(tanh(leaf), whole)


def test_other_dtypes_and_devices_use_torch_tanh():
    x = torch.randn(8, 8).to(torch.bfloat16)
    assert torch.equal(tanh(x), torch.tanh(x))
    if torch.cuda.is_available():
        xc = torch.randn(8, 8, device="cuda")
        assert torch.equal(tanh(xc), torch.tanh(xc))


def test_policies_use_it_and_keep_their_state_dict():
    assert ACTIVATIONS["tanh"] is Tanh
    m = ActorCritic({"state": TensorSpace((13,), "float32")}, 4, hidden_dims=(16, 16))
    assert isinstance(m.actor_mean[1], Tanh) and isinstance(m.critic[3], Tanh)
    plain = nn.Sequential(nn.Linear(13, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    assert list(m.actor_mean.state_dict()) == list(plain.state_dict())  # checkpoints load either way


@pytest.mark.parametrize("logprob_type", ["action_level", "chunk_level", "token_level"])
def test_acting_in_blocks_gives_the_learners_log_probs_bit_for_bit(logprob_type):
    """The collocated env server acts on 32 rows; the learner evaluates minibatches of 512: the same numbers."""
    torch.manual_seed(0)
    m = ActorCritic({"state": TensorSpace((13,), "float32")}, 4, logprob_type=logprob_type, hidden_dims=(128, 128))
    m.obs_rms.update(torch.randn(1000, 13) * 2 + 1)
    obs = torch.randn(512, 13) * 2
    outs = [m.act({"state": obs[i : i + 32]}) for i in range(0, 512, 32)]
    actions = torch.cat([o.forward_inputs["actions"] for o in outs])
    ev = m.evaluate({"state": obs}, {"actions": actions})
    assert torch.equal(torch.cat([o.log_probs for o in outs]), ev.log_probs)
    assert torch.equal(torch.cat([o.values for o in outs]), ev.values)

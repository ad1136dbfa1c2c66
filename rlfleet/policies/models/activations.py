"""Hidden-layer activations of the small policies (``actor.model.activation``: tanh | relu | elu).

``tanh`` is :class:`Tanh`: on CPU tensors of float32/float64 its forward pass is numpy's vectorised ``tanh``
(about 1.4 ulp at most) instead of torch's (correctly rounded, ~0.5 ulp), which on this project's CPU takes
6x as long: a 512 x 128 float32 batch 167 us against 26 us, a fifth of the default PPO update
(docs/benchmarks.md, "The activation's cost"). Its backward pass is torch's own ``tanh_backward`` on the saved
output, as for ``torch.tanh``. Every place that runs a policy (the learner, an inference server, a collocated env
server) goes through the same function, so the log-probs the learner recomputes are the ones the actor sampled
with, bit for bit. Other devices and dtypes (CUDA, bf16 under autocast) use ``torch.tanh``.

An element's result depends only on its value, never on the batch it is in or its position (numpy's SIMD loop
and its tail take the same path): a row acts the same in a batch of 32 as in a minibatch of 512.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

_NUMPY_DTYPES = (torch.float32, torch.float64)


def _numpy_ok(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES


def _numpy_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.tanh(x.detach().contiguous().numpy()))


class _NumpyTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = _numpy_tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable  # the saved output carries no graph: a second derivative would be wrong, so it is refused
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(grad, y)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh(x): numpy's forward on CPU float32/float64 tensors (see the module docstring), else ``torch.tanh``."""
    if not _numpy_ok(x):
        return torch.tanh(x)
    if x.requires_grad and torch.is_grad_enabled():
        return _NumpyTanh.apply(x)
    return _numpy_tanh(x)  # no graph to record (acting, no_grad)


class Tanh(nn.Module):
    """``nn.Tanh`` through :func:`tanh` (no parameters: a policy's state dict is the same as with ``nn.Tanh``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tanh(x)


ACTIVATIONS = {"tanh": Tanh, "relu": nn.ReLU, "elu": nn.ELU}

"""One forward and backward of ``nvtp.jit(model, plan="replicate")`` on one process beside the
same model in eager PyTorch, from the same input: what the single-process op tests compare."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

import nvtp


@dataclass
class Pair:
    jitted: torch.nn.Module  # nvtp.jit of a copy of the model, after one backward
    y: torch.Tensor  # its output
    x_grad: torch.Tensor  # its input's gradient
    want: torch.Tensor  # the eager model's output
    want_x_grad: torch.Tensor  # the eager input's gradient


def jit_and_eager(model: torch.nn.Module, x: torch.Tensor, **options) -> Pair:
    """Both runs of ``model`` on ``x``, each ending in ``output.backward()`` (a scalar output);
    ``options`` go to ``nvtp.jit`` (``frontend="fx"``)."""
    jitted = nvtp.jit(copy.deepcopy(model), plan="replicate", **options)
    xs = x.clone().requires_grad_()
    y = jitted(xs)
    y.backward()
    want_x = x.clone().requires_grad_()
    want = model(want_x)
    want.backward()
    return Pair(jitted, y.detach(), xs.grad, want.detach(), want_x.grad)

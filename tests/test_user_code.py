"""The user's code means what it says (issue 36, item 4): what a traced program cannot repeat is
refused before or while tracing, in the user's terms (the module, the file and line, what to write
instead, never nvtp's internals), and what it can is supported.

* Python randomness in forward (``random``, ``numpy.random``, in a helper method too): refused
  at ``nvtp.jit`` and ``nvtp.plan``, before tracing;
* hooks on the model's parts: refused at ``nvtp.jit``; one registered after it, at the next call;
  a hook on the module ``nvtp.jit`` returns runs at every call;
* in-place updates of parameters and buffers (a counter, ``p.mul_()``, BatchNorm's running
  statistics in training mode): refused at the trace naming the line (BatchNorm: the part and
  its fixes); BatchNorm in eval mode runs and equals eager;
* ``torch.randn_like`` in forward: supported, a fresh standard normal draw at every call,
  governed by ``torch.manual_seed``, with eager's gradients.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import nvtp

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def no_trace(monkeypatch):
    from nvtp import driver

    def must_not_trace(*a, **k):
        raise AssertionError("traced before refusing")

    monkeypatch.setattr(driver, "trace", must_not_trace)


class RandomBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if random.random() < 0.5:  # drawn once at trace time: refused
            return self.lin(x).sum()
        return (2 * self.lin(x)).sum()


class NumpyNoise(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.scale(self.lin(x)).sum()

    def scale(self, y):
        return y * float(np.random.rand())  # in a method forward calls


class TorchRandom(nn.Module):
    """Randomness in torch ops, which the traced program draws anew at every call: accepted."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        keep = torch.rand(()) < 0.5
        return torch.where(keep, self.lin(x), 2 * self.lin(x)).sum()


@pytest.mark.parametrize("cls,call,line", [(RandomBranch, r"random.random\(\)", "if random.random() < 0.5:"),
                                           (NumpyNoise, r"numpy.random.rand\(\)", "return y * float(np.random.rand())")])
def test_python_randomness_in_forward_is_refused_before_tracing(no_trace, cls, call, line):
    import re

    message = (rf"{cls.__name__}.forward calls {call} at tests/test_user_code.py:\d+ \(`{re.escape(line)}[^`]*`\): Python's random numbers "
               r"are drawn when nvtp traces the model, once, .* Draw them with torch inside forward")
    with pytest.raises(ValueError, match=message):
        nvtp.jit(cls(), plan="replicate", mesh=1)
    with pytest.raises(ValueError, match=message):
        nvtp.plan(cls(), X, plan="replicate", devices=1)


def test_torch_randomness_in_forward_is_accepted_and_drawn_at_every_call():
    torch.manual_seed(0)
    sharded = nvtp.jit(TorchRandom(), plan="replicate", mesh=1)
    values = {round(float(sharded(X).detach()), 4) for _ in range(12)}
    assert len(values) == 2  # both branches, as eager takes them


def test_hooks_are_refused_at_jit_and_when_registered_after_it():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
    seen = []
    handle = model[0].register_forward_hook(lambda m, a, out: seen.append(out.shape))
    with pytest.raises(ValueError, match=r"a forward hook <lambda> \(tests/test_user_code.py:\d+\) on Sequential.0 cannot run at "
                                         r"each call: .* Remove the hook \(handle.remove\(\)\); to see the model's outputs register "
                                         r"it on the module nvtp.jit returned"):
        nvtp.jit(model, plan="replicate", mesh=1)
    handle.remove()
    sharded = nvtp.jit(model, plan="replicate", mesh=1)
    sharded.register_forward_hook(lambda m, a, out: seen.append("on the wrapper"))  # runs at every call, as on any module
    sharded(X)
    sharded(X)
    assert seen == ["on the wrapper"] * 2
    model[2].register_forward_pre_hook(lambda m, a: seen.append("never"))
    with pytest.raises(ValueError, match=r"a forward pre-hook <lambda> .* on Sequential.2 was registered after nvtp.jit, and would "
                                         r"never fire"):
        sharded(X)
    assert "never" not in seen


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.lin(x).sum()


class DecayInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(0.99)
        return self.lin(x).sum()


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.lin(x)).sum()


@pytest.mark.parametrize("cls,message", [
    (Counter, r"Counter.forward uses operations nvtp cannot compile.*copy_ \(writes into t_calls, an argument, parameter or buffer "
              r"of the model\) at .*test_user_code.py:\d+ `self.calls \+= 1`.*does not write the model's state back"),
    (DecayInForward, r"DecayInForward.forward uses operations nvtp cannot compile.*copy_ \(writes into t_lin_weight, an argument, "
                     r"parameter or buffer of the model\) at .*test_user_code.py:\d+ `self.lin.weight.mul_\(0.99\)`.*out of forward, "
                     r"in the training loop"),
    (Normed, r"Normed.bn \(BatchNorm1d\) is in training mode, where it updates its running statistics \(running_mean, running_var\) "
             r"in place at every call; .* Call model.bn.eval\(\) \(fixed statistics\), build it with track_running_stats=False"),
])
def test_in_place_updates_of_the_models_state_are_refused_in_its_terms(cls, message):
    from nvtp.frontend.capture import CaptureError

    with pytest.raises(CaptureError, match=message) as caught:
        nvtp.jit(cls(), plan="replicate", mesh=1)(X)
    assert "nvtp/frontend" not in str(caught.value) and "translat" not in str(caught.value) and "executor" not in str(caught.value)


def test_batchnorm_in_eval_mode_runs_as_eager():
    torch.manual_seed(0)
    model = Normed()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    model.eval()
    expected = model(X)
    assert torch.allclose(nvtp.jit(model, plan="replicate", mesh=1)(X), expected, rtol=1e-5, atol=1e-5)


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x) + torch.randn_like(x)


def test_randn_like_in_forward_draws_a_fresh_standard_normal_at_every_call():
    torch.manual_seed(0)
    model = Noisy()
    x = torch.randn(256, 64)
    sharded = nvtp.jit(model, plan="replicate", mesh=1)
    clean = model.lin(x).detach()
    first, second = (sharded(x).detach() - clean for _ in range(2))
    for noise in (first, second):
        assert abs(float(noise.mean())) < 0.02 and abs(float(noise.std()) - 1) < 0.02  # 16384 draws of N(0, 1)
    assert not torch.allclose(first, second)  # drawn anew, as eager draws
    torch.manual_seed(7)
    a = sharded(x).detach()
    torch.manual_seed(7)
    assert torch.equal(sharded(x).detach(), a)  # torch.manual_seed governs it
    sharded(x).sum().backward()  # the noise has no gradient: eager's is x summed over the batch, in every row
    grad = nvtp.full_tensor(sharded.module.lin.weight.grad)
    assert torch.allclose(grad, x.sum(0).expand(64, 64), rtol=1e-5, atol=1e-4)

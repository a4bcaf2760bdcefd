"""In-place updates on the thunder.jit route (nvtp/frontend/setitem.py), checked against eager.

LitGPT builds its sliding-window mask with a Python loop of ``mask[i, lo:i + 1] = 0.0`` and
``mask.masked_fill_(...)``; Thunder functionalizes these into ``copy_with_setitem``, ``copy_`` and
``update_aliases``, which nvtp used to leave outside its fusions (a ``CaptureError`` listing
``copy_with_setitem_impl`` once per row). Each test compares with the eager module, computed
independently; an update nvtp cannot write functionally (into an argument, a buffer, a view, or
memory read afterwards by an older name) is refused naming the op, the line and why.
"""

from __future__ import annotations

import pytest
import torch

import nvtp
from nvtp.dump import relative_error
from tests.one_process import jit_and_eager
from nvtp.frontend.capture import CaptureError


class Updates(torch.nn.Module):
    """A model whose forward runs ``body(self, x)``: a parameter ``w`` [4, 6] and a buffer ``buf``."""

    def __init__(self, body):
        super().__init__()
        self.body = body
        self.w = torch.nn.Parameter(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("buf", torch.zeros(4, 6))

    def forward(self, x):
        return self.body(self, x)


def sliding_window(m, x):  # LitGPT's masks (litgpt/model.py, CausalSelfAttention.forward), T = 4, window 2
    t = 4
    mask = torch.ones(t, t, dtype=x.dtype).triu(diagonal=1)
    mask.masked_fill_(mask.bool(), float("-inf"))
    window = torch.full((t, t), float("-inf"), dtype=x.dtype)
    for i in range(t):
        window[i, max(0, i - 1): i + 1] = 0.0
    h = x * m.w
    scores = h @ h.T
    return ((scores + mask).softmax(-1) * (scores + window).softmax(-1)).sum()


def tensor_values(m, x):  # a tensor value into strided, integer and ellipsis keys, and a gradient through it
    h = x * m.w
    z = torch.zeros(4, 6, 5)
    z[1:3, ::2, 1] = h[1:3, ::2] * 2
    z[..., -1] = h
    z[0] = 7.0
    g = h.clone()
    g[:, 1:3] = h[:, 3:5] * 3
    return (z * z).sum() + (g * h).sum()


def base_updated_after_its_view_was_read(m, x):
    h = x * m.w
    first = h.view(2, 12).sum()  # read before the update: the old value, in eager too
    h.mul_(3)
    return (h * h).sum() + first


@pytest.mark.parametrize("body", [sliding_window, tensor_values, base_updated_after_its_view_was_read])
def test_updates_of_tensors_forward_made_match_eager_values_and_gradients(body):
    model = Updates(body)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    run = jit_and_eager(model, x)
    jitted = run.jitted
    assert relative_error(run.y, run.want)[0] <= 1e-6
    assert relative_error(run.x_grad, run.want_x_grad)[0] <= 1e-6
    assert relative_error(jitted.module.w.grad, model.w.grad)[0] <= 1e-6
    kinds = {op.kind for op in jitted.last.forward.source.ops}
    assert body is base_updated_after_its_view_was_read or "where" in kinds, kinds  # a setitem is a masked select


def _arg(m, x):
    x.add_(1)
    return (x * m.w).sum()


def _buffer(m, x):
    m.buf.add_(1)
    return (x * m.w + m.buf).sum()


def _view(m, x):
    h = x * m.w
    h.view(2, 12).add_(1)  # h changes too, in eager
    return (h * h).sum()


def _stale(m, x):
    h = x * m.w
    v = h.view(2, 12)
    h.add_(1)  # v sees it, in eager
    return (v * v).sum()


@pytest.mark.parametrize("body,why", [
    (_arg, r"copy_ \(writes into x, an argument, parameter or buffer of the model\) at .*test_inplace.py:\d+ `x.add_\(1\)`"),
    (_buffer, r"copy_ \(writes into t_buf, an argument, parameter or buffer of the model\) at .*test_inplace.py:\d+ `m.buf.add_\(1\)`"),
    (_view, r"copy_ \(writes into \w+, a view \(reshape\) of another tensor\)"),
    (_stale, r"copy_ \(writes into \w+, which mul reads afterwards by a name it had before\)"),
])
def test_an_update_nvtp_cannot_write_functionally_is_refused_naming_the_line_and_why(body, why):
    with pytest.raises(CaptureError, match=why) as e:
        nvtp.jit(Updates(body), plan="replicate")(torch.randn(4, 6))
    assert "write the in-place update out of place" in str(e.value) and "translate.py" not in str(e.value)

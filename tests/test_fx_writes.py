"""Writes whose result nobody reads, on the FX route (``nvtp.frontend.fx_inplace``, ``fx_constants``).

HY-V4's attention fills its keys through views of a new tensor (``expand_kv``):

    key = kv.new_empty(..., d_nope + d_rope)
    key[..., :d_nope].copy_(k_nope)
    key[..., d_nope:].copy_(k_rot)

The copies' results are never read: their effect is the write. torch.fx's dead-code elimination
(run after constant folding) calls every ``call_method`` pure, so it dropped them and the keys
stayed unfilled (the first call's check refused the model: logits 0.019 relative off eager). The
tests here run such modules through ``nvtp.jit(..., frontend="fx")`` and compare their output and
gradients with the module run eagerly (computed by torch alone); a copy into the model's own buffer
is refused naming its line; and a trace with an in-place update keeps its arguments apart (both
routes: Thunder took every meta argument for an alias of the first).
"""

from __future__ import annotations

import copy

import pytest
import torch

import nvtp
from nvtp.dump import relative_error
from tests.one_process import jit_and_eager


class Writes(torch.nn.Module):
    """A module whose forward runs ``body(self, x)`` on ``x [2, 3, 8]``: parameters ``a``, ``b`` [8, 8]."""

    def __init__(self, body):
        super().__init__()
        self.body = body
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(8, 8, generator=g))
        self.b = torch.nn.Parameter(torch.randn(8, 8, generator=g))

    def forward(self, x):
        return self.body(self, x)


def copies_into_slices(m, x):  # HY-V4's expand_kv: a new tensor filled by copies into slices, one broadcast
    nope, rot = x @ m.a, (x @ m.b)[:, :1, :4]
    key = x.new_empty(2, 3, 12)
    key[..., :8].copy_(nope)
    key[..., 8:].copy_(rot.expand(-1, 3, -1))  # [2, 1, 4] broadcast over the 3 rows, as k_rot over heads
    return (key.softmax(-1) * key).sum()


def copy_read_again(m, x):  # the copy's result read afterwards: it is the item, filled
    key = x.new_empty(2, 3, 12)
    head = key[..., :8].copy_(x @ m.a)
    key[..., 8:].copy_(x[..., :4] * 2)
    return (head * head).sum() + key.sum()


def copy_into_a_new_tensor(m, x):  # a whole copy, its result unread
    h = x @ m.a
    z = h.new_empty(2, 3, 8)
    z.copy_(x @ m.b)
    return (h * z).sum()


@pytest.mark.parametrize("body", [copies_into_slices, copy_read_again, copy_into_a_new_tensor])
def test_writes_whose_result_is_unread_keep_their_effect(body):
    model = Writes(body)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    run = jit_and_eager(model, x, frontend="fx")
    assert run.jitted.last.traced.route == "fx"
    assert relative_error(run.y, run.want)[0] <= 1e-6
    assert relative_error(run.x_grad, run.want_x_grad)[0] <= 1e-6
    for name in ("a", "b"):
        want = getattr(model, name).grad
        if want is not None:
            assert relative_error(getattr(run.jitted.module, name).grad, want)[0] <= 1e-6, name


class _WritesItsBuffer(torch.nn.Module):
    def __init__(self, whole: bool):
        super().__init__()
        self.whole = whole
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("buf", torch.zeros(2, 8))

    def forward(self, x):
        h = self.lin(x)
        if self.whole:
            self.buf.copy_(h)
        else:
            self.buf[:, :4].copy_(h[:, :4])
        return (h * self.buf).sum()


@pytest.mark.parametrize("whole,line", [(True, r"self.buf.copy_\(h\)"), (False, r"self.buf\[:, :4\].copy_\(h\[:, :4\]\)")])
def test_a_copy_into_a_buffer_is_refused_naming_its_line_not_dropped(whole, line):
    """The model's state written in forward is refused (no fusion writes it back); the dropped copy
    was a wrong result instead (the first call's check: relative error 1)."""
    from nvtp.frontend.capture import CaptureError

    with pytest.raises(CaptureError, match=r"copy_ \(writes into \w+, an argument, parameter or buffer of the model\) at "
                                           r".*test_fx_writes.py:\d+ in forward: `" + line):
        nvtp.jit(_WritesItsBuffer(whole), plan="replicate", frontend="fx")(torch.randn(2, 8))


class _SetitemAndTargets(torch.nn.Module):
    """A forward with an in-place update (a setitem) and two arguments of one shape: ``idx`` and ``targets``."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, idx, targets):
        h = self.emb(idx)
        z = torch.zeros_like(h)
        z[..., :4] = h[..., :4] * 2
        z[..., 4:] = h[..., 4:]
        return torch.nn.functional.cross_entropy(self.head(z).view(-1, 16), targets.view(-1))


@pytest.mark.parametrize("frontend", ["fx", "thunder"])
def test_arguments_of_one_shape_stay_apart_in_a_trace_with_an_in_place_update(frontend):
    """Thunder takes tensors of one storage for aliases, and nvtp traces on meta tensors (one storage
    pointer, 0, for all): with a setitem in the trace it read ``targets`` as ``idx`` (the loss of
    ``model(idx, idx)``), and read arguments of other shapes as reshapes of the first (the
    regional FX route failed so on DeepSeek-V3's blocks once their copies were setitems)."""
    torch.manual_seed(0)
    model = _SetitemAndTargets()
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, 16, (2, 5), generator=g), torch.randint(0, 16, (2, 5), generator=g)
    got = nvtp.jit(copy.deepcopy(model), plan="replicate", frontend=frontend)(idx, targets)
    want = model(idx, targets)
    assert relative_error(got.detach(), want.detach())[0] <= 1e-6

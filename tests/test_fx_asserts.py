"""Checks on values read from the data, on the FX route (nvtp/frontend/fx_asserts.py), and two forms
XLM needed beside them (nvtp/frontend/fx_forms.py).

XLM's ``get_masks`` asserts ``lengths.max().item() <= slen``, which dynamo keeps as
``aten._assert_scalar`` on a data-dependent integer: Thunder failed on it ("aten::_assert_scalar()
Expected a value of type 'number' ... found type 'IntegerProxy'"). A check the graph proves (a sum of
T booleans is at most T) is dropped; one it cannot prove is refused, naming the line. Each model
here is compared with itself run eagerly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import nvtp
from nvtp.dump import relative_error
from nvtp.frontend.failures import CaptureError

from tests.data_checks_models import Lengths, Unproven


def test_a_check_the_graph_proves_is_dropped_and_the_model_is_eagers():
    torch.manual_seed(0)
    model = Lengths()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    ids[0, 5:] = 0  # padding: a mask that matters
    got = nvtp.jit(model, plan="replicate", mesh=1, frontend="fx")(ids)
    got.backward()
    want = ref(ids)
    want.backward()
    assert relative_error(got.detach(), want.detach())[0] <= 1e-6
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert relative_error(nvtp.full_tensor(p.grad), q.grad)[0] <= 1e-5, name


def test_a_check_on_the_data_it_cannot_prove_is_refused_naming_the_line():
    with pytest.raises(CaptureError, match=r"Unproven.forward checks a value it reads from the data at .*data_checks_models.py:\d+ "
                                           r"\(`assert \(y > 0\).sum\(\).item\(\) > 0 .*can neither prove .* nor run"):
        nvtp.jit(Unproven(), plan="replicate", mesh=1, frontend="fx")(torch.randn(2, 8))


class _Extremes(nn.Module):
    """A router's forms of ``max``/``min`` along a dim (PhiMoE's sparsemixer: ``scores.max(dim=-1)``):
    the values, the indices by attribute and by position, and a tie the first index must win."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 3)

    def forward(self, x):
        p = self.proj(x)
        s = torch.cat([p, p], -1)  # every extreme along the last dim tied: column i and i + 3
        top = torch.max(s, dim=-1)
        low = s.min(-1, keepdim=True)
        picked = torch.nn.functional.one_hot(top.indices, 6).to(s.dtype)  # which column, not only its value
        return (top.values.unsqueeze(-1) * picked).sum() + (low[0] * 2 + low[1].to(s.dtype)).sum() + s.max(1)[1].sum()


def test_max_and_min_along_a_dim_give_torchs_values_first_indices_and_gradients():
    """Thunder has no argmax: ``torch.max(x, dim)`` / ``torch.min(x, dim)`` are written with amax,
    a position and a gather (nvtp/frontend/fx_forms.py). The outputs, and the gradients that reach
    the one index torch picks among ties, equal eager's."""
    torch.manual_seed(0)
    model = _Extremes()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1)) * 3
    assert torch.max(torch.tensor([1.0, 3.0, 3.0]), 0).indices.item() == 1  # torch's own: the first of a tie
    got = nvtp.jit(model, plan="replicate", mesh=1, frontend="fx")(x)
    got.backward()
    want = ref(x)
    want.backward()
    assert got.item() == want.item()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(nvtp.full_tensor(p.grad), q.grad, msg=name)

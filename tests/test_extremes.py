"""The gradient of a max or min where elements tie is torch's on every route (nvtp/frontend/extremes.py).

Thunder's own rule gives each tied element the whole gradient; torch shares it evenly (``amax``,
``amin``, ``max()``), or gives it to the first index (``max(dim)``). A model that takes the max of
``cat([p, p])`` ties every element with its copy, so a wrong share shows as a doubled gradient of
``p``. Compared with the model run eagerly, with nvtp's defaults (the first-call check on).
"""

from __future__ import annotations

import pytest
import torch

import nvtp

FORMS = {
    "amax": lambda y: y.amax(-1),
    "amin": lambda y: y.amin(-1),
    "amax over every dim": lambda y: torch.amax(y, (0, 1)),
    "max()": lambda y: y.max(),
    "max(dim)": lambda y: torch.max(y, -1).values,
}


class _Tied(torch.nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(4, 8))
        self.form = form

    def forward(self, x):
        y = torch.cat([self.p, self.p], -1) * x  # every element ties with its copy
        return (FORMS[self.form](y) ** 2).sum()


@pytest.mark.parametrize("form,frontend", [("amax", "thunder"), ("amax", "fx"), ("amin", "thunder"),
                                           ("amax over every dim", "thunder"), ("max()", "fx"), ("max(dim)", "fx")])
def test_tied_elements_share_the_gradient_as_torch_shares_it(form, frontend):
    torch.manual_seed(0)
    eager = _Tied(form)
    x = torch.ones(4, 16)
    eager(x).backward()
    model = nvtp.jit(_Tied(form), mesh=1, frontend=frontend)
    model.module.load_state_dict(eager.state_dict())
    loss = model(x)
    loss.backward()
    assert torch.allclose(loss, eager(x))
    assert torch.allclose(model.module.p.grad, eager.p.grad, rtol=1e-6, atol=1e-6), (model.module.p.grad - eager.p.grad).abs().max()

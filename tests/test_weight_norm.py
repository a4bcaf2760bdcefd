"""Weight normalisation (``torch.nn.utils.weight_norm`` and ``parametrizations.weight_norm``).

Both forms compute a layer's weight at each call, ``g * v / ||v||``, from two parameters, with
``torch._weight_norm``. Thunder's interpreter cannot read the parametrized form (it failed with
"InterpreterError: ... object of type 'generator' has no len() while tracing M(") and took the
hook form's write of the weight for an output (the first-call check caught it: "the output: shape
[128, 32], eager []"); neither knows ``torch._weight_norm``. nvtp.jit takes such a model by the FX
route, which writes ``torch._weight_norm`` as the ops it computes (``nvtp.frontend.decompose``);
the Thunder route, asked for, and ``nvtp.ShardingTransform`` refuse it saying so.
Compared with the same model in eager PyTorch on one process.
"""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations, weight_norm

import nvtp
from nvtp.dump import relative_error
from nvtp.execute import spmd
from nvtp.execute.collectives import ThreadComm, ThreadGroup
from nvtp.frontend.user_code import UserCodeError
from nvtp.sharding.placements import DeviceMesh

FORMS = {"parametrizations.weight_norm": parametrizations.weight_norm, "weight_norm (hook)": weight_norm}


class _Normed(nn.Module):
    """An LM whose MLPs' first linear is weight-normalised (``norm``: one of ``FORMS``; dim 0 by default, -1 too)."""

    def __init__(self, norm, d=32, vocab=64, dim=0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.up = nn.ModuleList(norm(nn.Linear(d, 4 * d), dim=dim) for _ in range(2))
        self.down = nn.ModuleList(nn.Linear(4 * d, d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for up, down in zip(self.up, self.down):
            x = x + down(torch.relu(up(x)))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)


@pytest.mark.parametrize("form", FORMS)
def test_a_weight_normalised_model_trains_as_eager_on_2_ranks(form):
    """Megatron on 2 simulated ranks, the default route: the loss and every gradient (g and v of
    each normalised weight too) equal eager's."""
    def build():  # the hook form's module cannot be deep-copied (torch's limit): each copy built from one seed
        torch.manual_seed(0)
        return _Normed(FORMS[form])

    ref = build()
    idx, targets = _tokens(1)
    group = ThreadGroup(2, timeout=120)
    ranks = [nvtp.jit(build(), plan="megatron", mesh=DeviceMesh.of_size(2), comm=ThreadComm(group, r)) for r in range(2)]
    ranks[0].compile(idx, targets)
    ranks[1].share_compiled(ranks[0])
    assert ranks[0]._route == "fx"

    def step(m):
        loss = m(idx, targets)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.module.named_parameters()}

    outs = spmd.on_threads(lambda r: step(ranks[r]), group)
    want = ref(idx, targets)
    want.backward()
    assert relative_error(outs[0][0], want.detach())[0] <= 1e-6
    grads = dict(ref.named_parameters())
    assert any("original" in n or n.endswith("weight_g") for n in grads), list(grads)
    gathered = spmd.on_threads(lambda r: {n: nvtp.full_tensor(g) for n, g in outs[r][1].items()}, group)
    for name, g in gathered[0].items():
        assert relative_error(g, grads[name].grad)[0] <= 1e-5, name


def test_the_norm_over_the_whole_weight_is_eagers():
    """``dim=None`` (``torch._weight_norm``'s dim -1: one norm over the whole weight), on one device."""
    torch.manual_seed(0)
    model = _Normed(parametrizations.weight_norm, dim=None)
    ref = copy.deepcopy(model)
    idx, targets = _tokens(2)
    got = nvtp.jit(model, plan="megatron", mesh=1)(idx, targets)
    got.backward()
    want = ref(idx, targets)
    want.backward()
    assert relative_error(got.detach(), want.detach())[0] <= 1e-6
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert relative_error(nvtp.full_tensor(p.grad), q.grad)[0] <= 1e-5, name


@pytest.mark.parametrize("form, undo", [("parametrizations.weight_norm", r"torch.nn.utils.parametrize.remove_parametrizations\(model.up\[0\], 'weight'\)"),
                                        ("weight_norm (hook)", r"torch.nn.utils.remove_weight_norm\(model.up\[0\], 'weight'\)")])
def test_the_thunder_route_refuses_a_weight_normalised_model_saying_what_takes_it(form, undo):
    """Before anything is traced: the weight, the form, the route that takes it, and how to fold the norm away."""
    model = _Normed(FORMS[form])
    with pytest.raises(UserCodeError, match=r"_Normed.up.0.weight is computed at each call by weight normalisation .*\(and 1 more\).*"
                                            r"leave frontend out \(or frontend='fx'\).*" + undo):
        nvtp.jit(model, plan="megatron", mesh=1, frontend="thunder")
    with pytest.raises(UserCodeError, match=r"_Normed.up.0.weight is computed at each call .*nvtp.jit\(model, plan=..., mesh=...\) takes such a model"):
        thunder.jit(model, transforms=[nvtp.ShardingTransform(plan="megatron", mesh=1)])

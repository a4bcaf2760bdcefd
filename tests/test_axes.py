"""Meshes the axis strategies compose by themselves (``nvtp/sharding/axes/``): the driver's one loop
runs whatever axes a mesh names, in the strategies' order, whatever the mesh's own order. Before the
strategies these meshes were refused ("nvtp shards over a 1-D 'tp' or 'cp' mesh or ..."): a 1-D
data-parallel mesh (DDP, and FSDP over it), and (tp, dp) in that order. Each trains like one
process (simulated ranks; losses within 1e-5, every weight, reassembled, within 1e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch

import nvtp
from nvtp.execute import spmd
from nvtp.models import gpt
from nvtp.sharding import axes
from nvtp.sharding.placements import DeviceMesh

CFG = gpt.config("tiny")


def _loss(out):
    return out[1] if isinstance(out, tuple) else out


@pytest.mark.parametrize("names,shape,fsdp", [(("dp",), (2,), False), (("dp",), (2,), True), (("tp", "dp"), (2, 2), False)],
                         ids=["ddp", "fsdp-on-dp-alone", "tp-then-dp"])
def test_a_mesh_the_strategies_compose_trains_like_one_process(names, shape, fsdp):
    torch.manual_seed(0)
    model = gpt.GPT(CFG)
    mesh = DeviceMesh.of_shape(shape, names)
    threads = spmd.ThreadMesh(mesh, timeout=120)
    idx, tgt = gpt.example_tokens(CFG)
    data = axes.batch_axis(mesh)
    n = mesh.shape[data]

    def part(r):
        d, k = mesh.coords(r)[data], idx.shape[0] // n
        return idx[d * k:(d + 1) * k], tgt[d * k:(d + 1) * k]

    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=mesh, comm=threads.comm(r), fsdp=fsdp) for r in range(mesh.size)]
    ranks[0].compile(*part(0))
    for m in ranks[1:]:
        m.share_compiled(ranks[0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ranks]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def step(r):
        opts[r].zero_grad()
        loss = _loss(ranks[r](*part(r)))
        loss.backward()
        opts[r].step()
        return loss.item()

    for _ in range(3):
        losses = spmd.on_threads(step, threads)
        ref_opt.zero_grad()
        want = _loss(ref(idx, tgt))
        want.backward()
        ref_opt.step()
        assert all(abs(a - want.item()) <= 1e-5 * abs(want.item()) for a in losses), (losses, want.item())
    split = 0
    for name, p in ref.named_parameters():
        placement = ranks[0].placement(name)
        placement = placement if isinstance(placement, tuple) else (placement,)
        parts = [dict(m.module.named_parameters())[name].detach() for m in ranks]
        whole = spmd.assemble(parts, placement, p.shape, mesh)
        assert (whole - p.detach()).abs().max().item() <= 1e-5, name
        split += parts[0].numel() < p.numel()
    assert (split > 0) == (fsdp or "tp" in names)  # FSDP splits weights over dp alone; DDP keeps them whole
    assert ranks[0].last.as_text().splitlines()[0].startswith(("model: DDP on dp", "model: FSDP on dp", "model: plan megatron on tp, DDP on dp"))

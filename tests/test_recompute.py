"""Activation recomputation (``recompute=``, ``nvtp/frontend/recompute.py``): the backward re-runs
forward ops instead of reading what the forward saved; the program computes what eager PyTorch
computes on one process, and the forward hands the backward fewer activation bytes."""

from __future__ import annotations

import copy

import pytest
import torch

import nvtp
from nvtp.errors import InputError
from nvtp.execute import spmd
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh

CFG = gpt.config("tiny", n_layer=2)


def _saved_bytes(program) -> int:
    """Bytes of the activations the forward hands the backward (its outputs of role saved), on one rank."""
    f = program.forward.source
    return sum(v.nbytes for v in f.outputs if f.role(v.name) == "saved")


def _run(mode: str):
    torch.manual_seed(0)
    model = gpt.GPT(CFG)
    mesh = DeviceMesh.of_size(2)
    threads = spmd.ThreadMesh(mesh, timeout=120)
    idx, tgt = gpt.example_tokens(CFG)
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=mesh, comm=threads.comm(r), recompute=mode) for r in range(2)]
    ranks[0].compile(idx, tgt)
    ranks[1].share_compiled(ranks[0])

    def step(r):
        loss = ranks[r](idx, tgt)
        loss = loss[1] if isinstance(loss, tuple) else loss
        loss.backward()
        return loss.item()
    losses = spmd.on_threads(step, threads)
    grads = {n: spmd.assemble([dict(m.module.named_parameters())[n].grad for m in ranks],
                              (ranks[0].placement(n),) if not isinstance(ranks[0].placement(n), tuple) else ranks[0].placement(n),
                              p.shape, mesh) for n, p in model.named_parameters()}
    ref = copy.deepcopy(model)
    want = ref(idx, tgt)
    want = want[1] if isinstance(want, tuple) else want
    want.backward()
    return ranks[0].last, losses, grads, want.item(), {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("mode", ["block"])
def test_recomputation_computes_what_eager_computes_and_keeps_fewer_activations(mode):
    program, losses, grads, want, want_grads = _run(mode)
    assert all(abs(a - want) <= 1e-5 * abs(want) for a in losses)
    for n, g in want_grads.items():
        assert (grads[n] - g).abs().max().item() <= 1e-5, n
    plain = nvtp.jit(gpt.GPT(CFG), plan="megatron", mesh=DeviceMesh.of_size(2), comm=spmd.ThreadMesh(DeviceMesh.of_size(2)).comm(0))
    plain.compile(*gpt.example_tokens(CFG))
    assert _saved_bytes(program) < _saved_bytes(plain.last), (_saved_bytes(program), _saved_bytes(plain.last))
    assert f"recompute={mode}" in program.source.how


def test_an_unknown_mode_is_refused():
    with pytest.raises(InputError, match="recompute='all': choose one of 'none', 'selective', 'block'"):
        nvtp.jit(gpt.GPT(CFG), plan="megatron", mesh=DeviceMesh.of_size(2), comm=spmd.ThreadMesh(DeviceMesh.of_size(2)).comm(0),
                 recompute="all")

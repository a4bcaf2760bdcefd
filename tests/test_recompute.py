"""Activation recomputation (``recompute=``, ``nvtp/frontend/recompute.py``): the backward re-runs
forward ops instead of reading what the forward saved; the program computes what eager PyTorch
computes on one process, and the forward hands the backward fewer activation bytes."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nvtp
from nvtp.errors import InputError
from nvtp.execute import spmd
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh
from tests.blocks import ParallelBlock
from tests import workers

CFG = gpt.config("tiny", n_layer=2)


def _saved_bytes(program) -> int:
    """Bytes of the activations the forward hands the backward (its outputs of role saved), on one rank."""
    f = program.forward.source
    return sum(v.nbytes for v in f.outputs if f.role(v.name) == "saved")


class _WrittenOutLM(nn.Module):
    """A tiny language model whose attention is written out (``tests/blocks.py``'s ParallelBlock:
    softmax of masked scores, as nanoGPT without flash), so its backward reads the [B, h, T, T]
    probabilities selective recomputation drops; sequence 32, head size 12, hidden 48 (a hidden
    size equal to the sequence would make [B, T, C] look like attention to the shape test)."""

    def __init__(self, vocab: int = 64, dim: int = 48, heads: int = 4, seq: int = 32, layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(ParallelBlock(dim, heads, seq) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())


def _written_out():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    return _WrittenOutLM(), (torch.randint(0, 64, (4, 32), generator=g), torch.randint(0, 64, (4, 32), generator=g))


def _written_out_square():
    """The same model at sequence 48 = its hidden size: every [B, T, C] value (the LayerNorm's output, the
    MLP's input) has two last axes of the sequence too."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    return _WrittenOutLM(seq=48), (torch.randint(0, 64, (4, 48), generator=g), torch.randint(0, 64, (4, 48), generator=g))


def _gpt():
    torch.manual_seed(0)
    return gpt.GPT(CFG), gpt.example_tokens(CFG)


def _loss(out):
    return out[1] if isinstance(out, tuple) else out


def _run(mode: str, build=_gpt, size: int = 2):
    """(rank 0's program, each rank's loss, every whole gradient, eager's loss, eager's gradients):
    one step of ``build()``'s model under megatron on ``size`` simulated ranks, and in eager PyTorch."""
    model, (idx, tgt) = build()
    mesh = DeviceMesh.of_size(size)
    threads = spmd.ThreadMesh(mesh, timeout=120)
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=mesh, comm=threads.comm(r), recompute=mode) for r in range(size)]
    ranks[0].compile(idx, tgt)
    for r in ranks[1:]:
        r.share_compiled(ranks[0])

    def step(r):
        loss = _loss(ranks[r](idx, tgt))
        loss.backward()
        return loss.item()
    losses = spmd.on_threads(step, threads)
    grads = {n: spmd.assemble([dict(m.module.named_parameters())[n].grad for m in ranks],
                              (ranks[0].placement(n),) if not isinstance(ranks[0].placement(n), tuple) else ranks[0].placement(n),
                              p.shape, mesh) for n, p in model.named_parameters()}
    ref = copy.deepcopy(model)
    want = _loss(ref(idx, tgt))
    want.backward()
    return ranks[0], losses, grads, want.item(), {n: p.grad for n, p in ref.named_parameters()}


def _plain(build, size: int = 2):
    """``build()``'s model compiled without recomputation (rank 0 of ``size``)."""
    model, example = build()
    plain = nvtp.jit(model, plan="megatron", mesh=DeviceMesh.of_size(size), comm=spmd.ThreadMesh(DeviceMesh.of_size(size)).comm(0))
    plain.compile(*example)
    return plain


def _measured_peak(module, example) -> int:
    """Bytes alive at the fullest moment of one forward and backward of ``module`` on this process,
    beyond its parameters and inputs, as ``tools/auto_measure.py`` measures them (torch's profiler)."""
    spec = importlib.util.spec_from_file_location("auto_measure", Path(__file__).parent.parent / "tools" / "auto_measure.py")
    measure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measure)

    def step():
        _loss(module(*example)).backward()
    step()  # the first call checks the program against eager; then the gradients are freed
    for p in module.parameters():
        p.grad = None
    peak, held = measure.peak_live_bytes(step, [*module.parameters(), *example])
    return peak - held


@pytest.mark.parametrize("mode, build, size", [("block", _gpt, 2), ("selective", _written_out, 1), ("selective", _written_out, 2),
                                              ("selective", _written_out_square, 2)],
                         ids=["block-gpt-2ranks", "selective-1rank", "selective-2ranks", "selective-hidden-size-is-sequence-2ranks"])
def test_recomputation_computes_what_eager_computes_and_keeps_fewer_activations(mode, build, size):
    module, losses, grads, want, want_grads = _run(mode, build, size)
    program = module.last
    assert all(abs(a - want) <= 1e-5 * abs(want) for a in losses)
    for n, g in want_grads.items():
        assert (grads[n] - g).abs().max().item() <= 1e-5, n
    plain_module = _plain(build, size)
    plain = plain_module.last
    assert _saved_bytes(program) < _saved_bytes(plain), (_saved_bytes(program), _saved_bytes(plain))
    assert f"recompute={mode}" in program.source.how
    if mode == "selective" and build is _written_out:  # the attention probabilities ([B, h, T, T]) are no longer handed over; q and k are re-made
        f, before = program.forward.source, plain.forward.source   # from the saved projection, not kept besides it
        square = [v.name for v in before.outputs if before.role(v.name) == "saved" and v.ndim == 4 and v.shape[-1] == v.shape[-2] == 32]
        assert len(square) == 2 and not [v for v in f.outputs if f.role(v.name) == "saved" and v.ndim == 4 and v.shape[-1] == 32]
        dropped = _saved_bytes(plain) - _saved_bytes(program)
        assert dropped >= 0.9 * sum(before.value(n).nbytes for n in square)
    if build is _written_out_square:  # [B, T, C] values look like attention by shape: only the probabilities
        f, before = program.forward.source, plain.forward.source   # (one a block) are dropped, as at sequence 32
        saved = {v.name for v in f.outputs if f.role(v.name) == "saved"}
        dropped = [v for v in before.outputs if before.role(v.name) == "saved" and v.name not in saved]
        producers = {v.name: op.kind for op in before.ops for v in op.outputs}
        assert len(dropped) == 2 and all(producers[v.name] not in ("matmul", "permute", "reshape") for v in dropped), \
            [(v.name, producers[v.name], v.shape) for v in dropped]
    if size == 1:  # the measured peak (one process) is lower too: the backward frees each saved value after its last
        example = build()[1]  # reader (since 2026-12-02), so what the forward no longer saves weighs only as far as it is
        got, was = _measured_peak(module, example), _measured_peak(plain_module, example)  # alive at the peak: selective
        assert was - got >= 0.25 * (_saved_bytes(plain) - _saved_bytes(program)), (got, was)  # 936972 -> 875532 B, half the 122880 dropped


def _gpt32():
    torch.manual_seed(0)
    cfg = gpt.config("tiny", n_layer=2, seq_len=32)
    return gpt.GPT(cfg), gpt.example_tokens(cfg)


@pytest.mark.parametrize("build", [_gpt32, _gpt], ids=["sequence-32", "sequence-16-is-head-size"])
def test_selective_recomputation_says_when_it_has_nothing_to_recompute(build):
    """nvtp's GPT on the reference backend runs attention as one flash attention, which keeps no
    [B, h, T, T] values between two products: recompute='selective' leaves the program as it is
    and says so, at sequence 32 (head size 16) and at sequence 16 = head size, where the flash
    attention's output [B, h, T, hs] has the shape of attention probabilities (a shape test
    re-ran the flash attention there)."""
    program = _plain(build, 2).last
    model, example = build()
    sm = nvtp.jit(model, plan="megatron", mesh=DeviceMesh.of_size(2), comm=spmd.ThreadMesh(DeviceMesh.of_size(2)).comm(0),
                  recompute="selective")
    sm.compile(*example)
    assert _saved_bytes(sm.last) == _saved_bytes(program)
    assert "recompute=selective: nothing recomputed, the backward reads no [.., T, T] attention values" in sm.last.source.how


def test_an_unknown_mode_is_refused():
    with pytest.raises(InputError, match="recompute='all': choose one of 'none', 'selective', 'block'"):
        nvtp.jit(gpt.GPT(CFG), plan="megatron", mesh=DeviceMesh.of_size(2), comm=spmd.ThreadMesh(DeviceMesh.of_size(2)).comm(0),
                 recompute="all")


def _pipeline_worker(rank, world, init_method, out, mode):
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.dtensor import local
    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    model, (idx, tgt) = _written_out()
    sm = nvtp.jit(model, plan="megatron", mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("pp",)), microbatches=2,
                  recompute=mode)
    loss = sm(idx, tgt)
    loss.backward()
    grads = {n: local(p.grad).clone() for n, p in sm.module.named_parameters()  # a stage holds its own parameters (others: empty)
             if p.grad is not None and local(p.grad).numel()}
    how = [p.source.how for p in sm.program.programs]
    return workers.finish((loss.item(), grads, how), out, world)


@pytest.mark.slow
def test_selective_recomputation_on_a_pipeline_computes_what_eager_computes(tmp_path):
    """pp=2 on 2 gloo processes, 2 microbatches, recompute='selective': each stage recomputes its
    block's attention probabilities; the loss and every gradient (each from the stage that holds
    it) are eager PyTorch's on one process, within 1e-5."""
    from nvtp.execute.launch import spawn

    out = tmp_path / "out.pt"
    assert list(spawn(_pipeline_worker, 2, str(out), "selective")) == [0, 0]
    ranks = torch.load(out, weights_only=False)
    model, (idx, tgt) = _written_out()
    want = model(idx, tgt)
    want.backward()
    seen = set()
    for loss, grads, how in ranks:
        assert abs(loss - want.item()) <= 1e-5 * abs(want.item()), (loss, want.item())
        assert all("recompute=selective" in h for h in how), how
        for n, g in grads.items():
            assert (g - dict(model.named_parameters())[n].grad).abs().max().item() <= 1e-5, n
            seen.add(n)
    assert seen == {n for n, _ in model.named_parameters()}, seen

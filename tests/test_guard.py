"""The first-call check (nvtp/guard.py): a compiled program that differs from the model run eagerly
is refused, naming the first value that differs; a correct one passes; ``verify=False`` skips; and
the check leaves training bit for bit as it is without it.

The miscompiled programs are made on purpose: the splice told that the blocks of
``tests/differing.py``'s "attribute" GPT (a residual scale 1/(i+1)) are one variant, so every
copy is block 0's (the bug of issue 33); a program whose backward doubles one gradient; one whose
forward adds 1 to its output.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import nvtp
from nvtp import guard
from nvtp.errors import InputError
from nvtp.execute import spmd
from nvtp.execute.collectives import ThreadComm, ThreadGroup
from nvtp.execute.launch import spawn
from nvtp.execute.step import RankProgram
from nvtp.frontend import variants
from nvtp.sharding.placements import DeviceMesh
from tests import differing


class _MLP(torch.nn.Module):
    """No repeated blocks: traced whole in seconds."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), torch.nn.Linear(16, 4)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.head(torch.tanh(self.down(torch.nn.functional.gelu(self.up(x))))), y)


def _mlp() -> _MLP:
    torch.manual_seed(0)
    return _MLP()


def _mlp_batches(steps: int = 3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)) for _ in range(steps)]


@pytest.fixture
def one_variant(monkeypatch):
    """The splice is told every block is block 0's: a miscompiled program for blocks that differ."""
    monkeypatch.setattr(variants.Recording, "variants", lambda self: ([0] * self.count, []))


def _ranks(net, verify, group):
    return [nvtp.jit(copy.deepcopy(net), plan="megatron", mesh=DeviceMesh.of_size(2), comm=ThreadComm(group, r), verify=verify)
            for r in range(2)]


def _train(modules, batches, group):
    """SGD with momentum on each rank's module (threads): per rank its losses, parameters, momentum buffers and random state."""
    def run(r):
        m = modules[r]
        opt = torch.optim.SGD(m.module.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = m(x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
        state = [s["momentum_buffer"].clone() for s in opt.state.values()]
        return losses, {n: p.detach().clone() for n, p in m.module.named_parameters()}, state, torch.get_rng_state()
    return spmd.on_threads(run, group)


def test_a_correct_program_passes_and_training_is_bit_for_bit_as_without_the_check():
    """tp=2 (ranks as threads), megatron: every loss, weight, momentum buffer and the random state
    after 3 SGD steps are the same, bit for bit, with the check and without it; the check compared
    the output and every gradient (6 parameters, fewer than ``SAMPLE``), once."""
    net, batches = _mlp(), _mlp_batches()
    group = ThreadGroup(2, timeout=600)
    checked = _ranks(net, True, group)
    checked[0].compile(*batches[0])
    checked[1].share_compiled(checked[0])
    plain = _ranks(net, False, group)
    plain[0].share_compiled(checked[0])
    plain[1].share_compiled(checked[0])
    torch.manual_seed(7)
    with_check = _train(checked, batches, group)
    torch.manual_seed(7)
    without = _train(plain, batches, group)
    for (l1, p1, s1, rng1), (l2, p2, s2, rng2) in zip(with_check, without):
        assert all(torch.equal(a, b) for a, b in zip(l1, l2))
        assert p1.keys() == p2.keys() and all(torch.equal(p1[n], p2[n]) for n in p1)
        assert len(s1) == len(s2) == 6 and all(torch.equal(a, b) for a, b in zip(s1, s2))
        assert torch.equal(rng1, rng2)
    for m in checked:
        [outcome] = guard.outcomes(m)
        assert outcome.failures == [] and outcome.compared == 1 + 6 and not outcome.skipped
    assert all(guard.outcomes(m) == [] for m in plain)


def test_a_miscompiled_splice_is_refused_naming_the_output_and_verify_false_trains_it_silently(one_variant):
    net = differing.model("attribute")
    idx, tgt = differing.batches(1)[0]
    sm = nvtp.jit(copy.deepcopy(net), plan="megatron", mesh=1)
    with pytest.raises(guard.MiscompileError, match=r"nvtp's compiled program differs from the model run eagerly on the same "
                                                    r"inputs \(the first call's check\): the output: max abs error [0-9.e-]+, "
                                                    r"relative [0-9.e-]+ \(tolerance 0.001 relative.*verify=False skips this check"):
        sm(idx, tgt)
    assert all(p.grad is None for p in sm.module.parameters())  # refused before the step: nothing changed
    unchecked = nvtp.jit(copy.deepcopy(net), plan="megatron", mesh=1, verify=False)
    unchecked.share_compiled(sm)
    assert abs(unchecked(idx, tgt).item() - net(idx, tgt).item()) > 1e-3  # wrong, and not refused: what verify=False means


def test_a_wrong_gradient_is_refused_naming_the_parameter(monkeypatch):
    """A backward that doubles one weight's gradient (a deliberately broken program): the output
    agrees, the gradient is named, with its error (relative 1: twice the eager gradient)."""
    real = RankProgram.backward

    def doubled(self, *a, **k):
        grads = real(self, *a, **k)
        grads["down.weight"] = grads["down.weight"] * 2
        return grads

    monkeypatch.setattr(RankProgram, "backward", doubled)
    sm = nvtp.jit(_mlp(), plan="megatron", mesh=1)
    with pytest.raises(guard.MiscompileError, match=r"check\): gradient of down.weight: max abs error .*, relative 1 "):
        sm(*_mlp_batches(1)[0])
    assert guard.outcomes(sm)[0].compared == 1 + 6


def test_the_thunder_transform_refuses_a_wrong_output(monkeypatch):
    """``thunder.jit(model, transforms=[nvtp.ShardingTransform(...)])``: a program whose forward
    adds 1 to its output is refused at its first call; with ``verify=False`` it runs."""
    import thunder

    real = RankProgram.forward

    def shifted(self, *a, **k):
        outs, values = real(self, *a, **k)
        return [t + 1 for t in outs], values

    monkeypatch.setattr(RankProgram, "forward", shifted)
    jm = thunder.jit(_mlp(), transforms=[nvtp.ShardingTransform(plan="megatron", mesh=1)])
    with pytest.raises(guard.MiscompileError, match=r"check\): the output: max abs error 1, relative"):
        jm(*_mlp_batches(1)[0])
    unchecked = thunder.jit(_mlp(), transforms=[nvtp.ShardingTransform(plan="megatron", mesh=1, verify=False)])
    unchecked(*_mlp_batches(1)[0])


@pytest.mark.slow  # a splice of the attribute GPT, and Thunder's interpreter over it: 60-170 s
def test_the_thunder_transform_refuses_a_miscompiled_splice(one_variant):
    import thunder

    net = differing.model("attribute")
    jm = thunder.jit(copy.deepcopy(net), transforms=[nvtp.ShardingTransform(plan="megatron", mesh=1)])
    with pytest.raises(guard.MiscompileError, match="the output: max abs error"):
        jm(*differing.batches(1)[0])


@pytest.mark.slow  # a GPT traced for a cp axis on 2 simulated ranks: 30 s
def test_a_context_parallel_program_is_checked_with_its_ring():
    """cp = 2: the sequence split, attention by ring (its dropout_p 0: nothing drawn, so checked);
    the boundary is whole, so the outputs and gradients compare as on tp."""
    from nvtp.models import gpt

    cfg = gpt.config("tiny")
    torch.manual_seed(0)
    net = gpt.GPT(cfg)
    mesh = DeviceMesh.of_shape((2,), ("cp",))
    threads = spmd.ThreadMesh(mesh, timeout=600)
    ranks = [nvtp.jit(copy.deepcopy(net), plan="megatron", mesh=mesh, comm=threads.comm(r)) for r in range(2)]
    args = gpt.example_tokens(cfg)
    ranks[0].compile(*args)
    ranks[1].share_compiled(ranks[0])
    spmd.on_threads(lambda r: ranks[r](*args).backward(), threads)
    for m in ranks:
        [outcome] = guard.outcomes(m)
        assert not outcome.skipped and outcome.failures == [] and outcome.compared == 1 + guard.SAMPLE


def test_a_program_that_draws_random_numbers_is_not_checked_and_says_so():
    """Dropout in training mode: eager draws other masks, so nothing can be compared; a warning says so."""

    class Drop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.dropout(self.lin(x), 0.5).sum()

    sm = nvtp.jit(Drop(), plan="replicate", mesh=1)
    with pytest.warns(UserWarning, match=r"the first-call check of the compiled program was skipped: the program draws random "
                                         r"numbers \(uniform: dropout in training mode\)"):
        sm(torch.randn(2, 8))
    assert guard.outcomes(sm)[0].skipped


def test_a_bad_verify_option_is_refused_before_anything_is_traced():
    with pytest.raises(InputError, match=r"verify='yes': give True .* False .* or a relative tolerance between 0 and 1"):
        nvtp.jit(differing.model("same"), mesh=1, verify="yes")


def _first_step_on_pp2(net, batch, out, world):
    """``net``'s first step on pp=2 with 2 microbatches: "trained", or the check's refusal; rank 0 saves every rank's."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests import workers

    model = nvtp.jit(net, plan="megatron", mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)), microbatches=2)
    try:
        model(*batch)
        result = "trained"
    except guard.MiscompileError as e:
        result = str(e)
    return workers.finish(result, out, world)


def _pipeline_worker(rank, world, init_method, out):
    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    variants.Recording.variants = lambda self: ([0] * self.count, [])  # the miscompile, in this process
    return _first_step_on_pp2(differing.model("attribute"), differing.batches(1, batch=4)[0], out, world)


@pytest.mark.slow  # 2 gloo processes: 60 s
def test_a_pipeline_refuses_a_miscompiled_program_on_every_rank(tmp_path):
    out = tmp_path / "got.pt"
    assert spawn(_pipeline_worker, 2, str(out)) == [0, 0]
    got = torch.load(out, weights_only=False)
    assert got[0] == got[1] and re.search(r"the first call's check\) (\(rank \d\))?: the loss: max abs error", got[0]), got


def _tied_worker(rank, world, init_method, out):
    from nvtp.execute.launch import init_group
    from nvtp.models import gpt
    from nvtp.execute.collectives import DistComm
    from nvtp.pipeline import runtime

    class Unsummed(DistComm):
        def reduce(self, t, dst, op="sum"):  # the miscompile: the tied weight's gradients never summed across stages
            pass

    init_group(rank, world, init_method)
    runtime.DistComm = Unsummed
    torch.manual_seed(0)
    net = gpt.GPT(gpt.config("tiny", n_layer=2, batch=4))
    net.lm_head.weight = net.wte.weight  # read by stage 0 (the embedding) and stage 1 (the head)
    return _first_step_on_pp2(net, gpt.example_tokens(gpt.config("tiny", n_layer=2, batch=4), seed=0), out, world)


@pytest.mark.slow  # 2 gloo processes: 20 s
def test_a_pipeline_whose_tied_weights_gradient_is_not_summed_across_stages_is_refused(tmp_path):
    """The weight tied across stages is always among the compared gradients, on the stage that holds it."""
    out = tmp_path / "got.pt"
    assert spawn(_tied_worker, 2, str(out)) == [0, 0]
    got = torch.load(out, weights_only=False)
    assert got[0] == got[1] and re.search(r"\(rank 0\): gradient of wte\.weight: max abs error", got[0]), got

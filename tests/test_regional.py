"""Regional compilation (nvtp/frontend/regional.py): a deep model's fusions spliced from one traced
block (or, where that does not fit, from a trace of 3 blocks) compute what a trace of the whole
model computes, and nvtp.jit trains with them as eager does."""

from __future__ import annotations

import collections
import copy

import pytest
import torch

import nvtp
from nvtp.execute import reference, spmd
from nvtp.execute.collectives import ThreadComm, ThreadGroup
from nvtp.frontend import regional
from nvtp.frontend.template import Boundary
from nvtp.frontend.capture import capture, output_value, run_pair
from nvtp.models import gpt
from nvtp.driver import meta_copy as _meta_copy
from nvtp.sharding.placements import DeviceMesh

LAYERS = 4  # one more than the 3 blocks a splice traces, so one block is spliced in


def _kinds(f):
    return collections.Counter(op.kind for op in f.ops)


def _structure(f, forward_hashes=None) -> tuple[collections.Counter, dict]:
    """Every value of ``f`` as a hash of how it is computed from the labelled inputs (its kind,
    literal arguments and operands' hashes, recursively; a saved input as its forward value's
    hash): equal multisets mean the same dataflow graph, whatever the names and op order."""
    from nvtp.ir.graph import defines_input, is_value

    h: dict[str, int] = {}
    for op in f.ops:
        if defines_input(op):
            info = f.info[op.outputs[0].name]
            key = ("saved", forward_hashes[info.source]) if info.role == "saved" else (info.role, info.label, op.outputs[0].shape)
        else:
            key = (op.kind, repr(tuple((n, h[a.name] if is_value(a) else tuple(h[x.name] if is_value(x) else x for x in a)
                                        if isinstance(a, tuple) else a) for n, a in op.args)))
        for j, v in enumerate(op.outputs):
            h[v.name] = hash((key, j))
    outs = collections.Counter((h[v.name], f.role(v.name), f.label(v.name) if f.role(v.name) != "saved" else "") for v in f.outputs)
    return collections.Counter(h.values()) + outs, h


@pytest.fixture(scope="module")
def tiny():
    cfg = gpt.config("tiny", n_layer=LAYERS, dropout=0.1)  # training mode: every block draws its own dropout masks
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    idx, tgt = gpt.example_tokens(cfg)
    meta = _meta_copy(model)
    whole = capture(meta, idx.to("meta"), tgt.to("meta"))
    spliced = regional.capture_regional(meta, idx.to("meta"), tgt.to("meta"), template=False)
    return model, idx, tgt, whole, spliced


def test_spliced_fusions_equal_a_whole_trace(tiny):
    model, idx, tgt, whole, spliced = tiny
    assert spliced.regional.startswith(f"spliced: {LAYERS} blocks of h from a trace of 3"), spliced.regional
    (mine_f, my_hashes), (want_f, hashes) = _structure(spliced.forward), _structure(whole.forward)
    assert mine_f == want_f  # the same graph, value for value, outputs included
    assert _structure(spliced.backward, my_hashes)[0] == _structure(whole.backward, hashes)[0]
    for mine, want in ((spliced.forward, whole.forward), (spliced.backward, whole.backward)):
        assert _kinds(mine) == _kinds(want)
        roles = lambda f: collections.Counter((i.role, i.label, i.grad_of) for i in f.info.values())  # noqa: E731
        assert roles(mine) == roles(want)  # every parameter, gradient and saved value, by name
    for mine, want in ((spliced.forward, whole.forward), (spliced.backward, whole.backward)):
        # the same torch kernels (the spliced forward makes the targets' mask and count first, the
        # whole trace beside the loss: the cross-entropy must fuse in both orders)
        assert reference.lower_fusion(mine).fused == reference.lower_fusion(want).fused
    named = dict(model.named_parameters()) | {"idx": idx, "targets": tgt}
    run = lambda f, inputs: reference.run(f, inputs, seed=7)  # noqa: E731  (draws in the same order: the same masks)
    values, grads = run_pair(whole.forward, whole.backward, named, torch.ones(()), run)
    my_values, my_grads = run_pair(spliced.forward, spliced.backward, named, torch.ones(()), run)
    assert torch.equal(my_values[output_value(spliced.forward)], values[output_value(whole.forward)])
    assert sorted(my_grads) == sorted(grads) and len(grads) == len(named) - 2
    for label, g in grads.items():
        assert torch.equal(my_grads[label], g), label
    assert _kinds(spliced.forward)["uniform"] == 1 + 3 * LAYERS  # the embedding's dropout, and 3 per block


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])  # bf16: 25 s
def test_fusions_spliced_from_one_traced_block_compute_the_whole_trace_bit_for_bit(tiny, dtype, monkeypatch):
    """The template splice: the model without its blocks and block 0 alone are the only traces, at
    any depth; the L-layer fusions give the whole trace's loss and every gradient bit for bit, with
    each block's own dropout draws (bf16: the boundary marker is cast, multiplied, cast back)."""
    model, idx, tgt, whole, _ = tiny
    model = copy.deepcopy(model).to(dtype)
    meta = _meta_copy(model)
    if dtype != torch.float32:
        whole = capture(meta, idx.to("meta"), tgt.to("meta"))
    traced = []
    real = regional.capture
    monkeypatch.setattr(regional, "capture", lambda m, *a, **k: traced.append(m) or real(m, *a, **k))
    got = regional.capture_regional(meta, idx.to("meta"), tgt.to("meta"))
    assert got.regional.startswith(f"spliced: {LAYERS} blocks of h from one traced block"), got.regional
    assert [type(m).__name__ for m in traced] == ["GPT", "Block"] and list(traced[0].h.children())[0].__class__ is Boundary
    for f in (got.forward, got.backward):  # each op is a renamed copy: the skeleton's once, the block's once a layer
        copies = collections.Counter(id(op.template) for op in f.compute_ops() if op.template is not None)
        assert sum(copies.values()) == len(list(f.compute_ops())) and set(copies.values()) == {1, LAYERS}
    roles = lambda f: collections.Counter((i.role, i.label, i.grad_of) for i in f.info.values() if i.role != "saved")  # noqa: E731
    assert roles(got.forward) == roles(whole.forward) and roles(got.backward) == roles(whole.backward)
    assert _kinds(got.forward)["uniform"] == _kinds(whole.forward)["uniform"] > LAYERS  # fp32: 1 + 3 a block; bf16: 1 + 2
    named = dict(model.named_parameters()) | {"idx": idx, "targets": tgt}
    run = lambda f, inputs: reference.run(f, inputs, seed=7)  # noqa: E731
    values, grads = run_pair(whole.forward, whole.backward, named, torch.ones((), dtype=dtype), run)
    my_values, my_grads = run_pair(got.forward, got.backward, named, torch.ones((), dtype=dtype), run)
    assert torch.equal(my_values[output_value(got.forward)], values[output_value(whole.forward)])
    assert sorted(my_grads) == sorted(grads) and len(grads) == len(named) - 2
    for label, g in grads.items():
        assert torch.equal(my_grads[label], g), label


def test_jit_trains_a_spliced_model_as_eager_does_on_a_simulated_mesh():
    cfg = gpt.config("tiny", n_layer=LAYERS)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    idx, tgt = gpt.example_tokens(cfg)
    group = ThreadGroup(2, timeout=120)
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=DeviceMesh.of_size(2), comm=ThreadComm(group, r)) for r in range(2)]
    ranks[0].compile(idx, tgt)
    ranks[1].share_compiled(ranks[0])
    compiled = ranks[0].last  # compile() sets it: how the fusions were made is known before any step
    assert compiled is not None and compiled.traced.how.startswith("spliced"), compiled and compiled.traced.how
    assert ranks[1].last is compiled
    fwd, bwd = ([s.kind for s in f.communications].count("allreduce") for f in (compiled.forward, compiled.backward))
    assert (fwd, bwd) == (2 * LAYERS + 1 + 3, 2 * LAYERS + 2)  # 2 + 2 a layer, the embedding's 1, cross-entropy's 3 / 2
    opts = [torch.optim.SGD(m.module.parameters(), lr=0.1) for m in ranks]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        def step(r):
            opts[r].zero_grad()
            loss = ranks[r](idx, tgt)
            loss.backward()
            opts[r].step()
            return loss.detach()
        losses = spmd.on_threads(step, group)
        ref_opt.zero_grad()
        want = ref(idx, tgt)
        want.backward()
        ref_opt.step()
        for loss in losses:
            assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    for name, p in ref.named_parameters():
        parts = [dict(m.module.named_parameters())[name].detach() for m in ranks]
        got = spmd.assemble(parts, ranks[0].placement(name), p.shape)
        assert torch.allclose(got, p.detach(), rtol=1e-4, atol=1e-6), name


class _Different(torch.nn.Module):
    """Four blocks, one of them unlike the others: no repeated block to splice."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)] + [torch.nn.Linear(8, 8, bias=False)])

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.sum()


class _Skip(torch.nn.Module):
    """Five blocks alike, but each reads the embedding too, and the last one the first's output:
    not a chain the splice can repeat."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))

    def forward(self, x):
        first = None
        for i, b in enumerate(self.blocks):
            x = torch.tanh(b(x)) + (first if i == len(self.blocks) - 1 else 0)
            first = x if first is None else first
        return x.sum()


def test_models_without_a_repeated_chain_are_traced_whole_with_the_reason():
    x = torch.randn(2, 8, device="meta", requires_grad=True)
    got = regional.capture_regional(_meta_copy(_Different()), x)
    assert got.regional == "whole trace: the blocks of blocks differ (class or parameter shapes)"
    assert len(list(got.forward.compute_ops())) > 0
    got = regional.capture_regional(_meta_copy(_Skip()), x)
    assert got.regional.startswith("whole trace: the model does more between blocks 0 and 1 of blocks than call block 1 on "
                                   "block 0's output; the model cut to 3 blocks differs at its call 2: `add(t0[2, 8], t1 of the "
                                   "code before block -2[2, 8])` where the whole model has `add(t0[2, 8], t1 of the code before "
                                   "block -4[2, 8])` after the blocks"), got.regional
    whole = capture(_meta_copy(_Skip()), x)
    assert _kinds(got.forward) == _kinds(whole.forward)


def test_a_chain_of_blocks_that_only_looks_alike_is_spliced_and_computes_the_whole_trace():
    """A chain with no model-specific names: a ModuleList called ``layers`` of 6 residual MLP blocks."""

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up, self.down = torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(8, 16)
            self.layers = torch.nn.ModuleList(Layer() for _ in range(6))
            self.out = torch.nn.Linear(16, 1)

        def forward(self, x):
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x)
            return self.out(x).pow(2).mean()

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 8)
    got = regional.capture_regional(_meta_copy(net), x.to("meta"))
    assert got.regional.startswith("spliced: 6 blocks of layers"), got.regional
    named = dict(net.named_parameters()) | {"x": x}
    run = lambda f, inputs: reference.run(f, inputs)  # noqa: E731
    values, grads = run_pair(got.forward, got.backward, named, torch.ones(()), run)
    want = net(x)
    want.backward()
    assert torch.allclose(values[output_value(got.forward)], want, rtol=1e-6)
    for name, p in net.named_parameters():
        assert torch.allclose(grads[f"grad({name})"], p.grad, rtol=1e-5, atol=1e-7), name


def test_a_backward_that_recomputes_the_residual_stream_is_spliced_from_one_block_and_matches_eager():
    """x + gelu(linear(x)): Thunder's backward recomputes each block's input from the one before, a
    chain the 3-block splice cannot repeat; one traced block gives each copy its own recomputation."""

    class Res(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            return x + torch.nn.functional.gelu(self.lin(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(8, 16)
            self.blocks = torch.nn.ModuleList(Res() for _ in range(6))

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return x.pow(2).mean()

    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 8)
    got = regional.capture_regional(_meta_copy(net), x.to("meta"))
    assert got.regional.startswith("spliced: 6 blocks of blocks from one traced block"), got.regional
    three = regional.capture_regional(_meta_copy(net), x.to("meta"), template=False)
    assert three.regional.startswith("whole trace: the backward's block 0 reads"), three.regional
    values, grads = run_pair(got.forward, got.backward, dict(net.named_parameters()) | {"x": x}, torch.ones(()),
                             lambda f, inputs: reference.run(f, inputs))
    want = net(x)
    want.backward()
    assert torch.allclose(values[output_value(got.forward)], want, rtol=1e-6)
    for name, p in net.named_parameters():
        assert torch.allclose(grads[f"grad({name})"], p.grad, rtol=1e-5, atol=1e-7), name


class _PreNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class _BlocksFirst(torch.nn.Module):
    """A chain of blocks reading a floating argument straight away (no embedding), then an optional head."""

    def __init__(self, head: bool):
        super().__init__()
        self.h = torch.nn.ModuleList(_PreNorm() for _ in range(5))
        self.head = torch.nn.Linear(16, 4) if head else None

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return (self.head(x) if self.head is not None else x).pow(2).mean()


@pytest.mark.parametrize("head", [False, True])
def test_a_chain_with_nothing_before_it_needing_a_gradient_is_spliced_and_every_block_gets_its_gradients(head):
    """Only the blocks (and perhaps a head) have parameters: nothing before the chain needs a gradient,
    so the model without its blocks has no backward reaching them. Before, the template splice gave
    no backward at all, every ``.grad`` None, silently (head=False), or the model was traced whole
    (head=True). The skeleton is traced with its floating argument needing a gradient, which the
    splice then drops (eager computes none): every parameter's gradient is the whole trace's, bit
    for bit, and nvtp.jit trains it as eager does."""
    torch.manual_seed(0)
    net, x = _BlocksFirst(head), torch.randn(2, 8, 16)
    got = regional.capture_regional(_meta_copy(net), x.to("meta"))
    assert got.regional.startswith("spliced: 5 blocks of h from one traced block"), got.regional
    whole = capture(_meta_copy(net), x.to("meta"))
    assert sorted(got.backward.grad_of(v.name) for v in got.backward.outputs) == sorted(n for n, _ in net.named_parameters())
    named = dict(net.named_parameters()) | {"x": x}
    run = lambda f, inputs: reference.run(f, inputs)  # noqa: E731
    values, grads = run_pair(whole.forward, whole.backward, named, torch.ones(()), run)
    my_values, my_grads = run_pair(got.forward, got.backward, named, torch.ones(()), run)
    assert torch.equal(my_values[output_value(got.forward)], values[output_value(whole.forward)])
    assert sorted(my_grads) == sorted(grads)
    for label, g in grads.items():
        assert torch.equal(my_grads[label], g), label

    ref = copy.deepcopy(net)
    loss = nvtp.jit(net, plan="replicate", mesh=DeviceMesh.of_size(1))(x)
    loss.backward()
    want = ref(x)
    want.backward()
    assert torch.allclose(loss, want, rtol=1e-6)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("template", [True, pytest.param(False, marks=pytest.mark.slow)])  # False: traces of 3 and 4 blocks, 25 s
def test_a_llama_whose_block_0_backward_differs_is_spliced_and_matches_eager(template):
    """Thunder recomputes the embedding for block 0's backward (RMSNorm's input) and saves the
    other blocks' inputs. One traced block: every copy saves its input. Several traced blocks:
    block 0's backward is kept whole, blocks 1..L-2 spliced."""
    from tests.blocks import LlamaBlock, RMSNorm

    class Llama(torch.nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 64)
            self.layers = torch.nn.ModuleList(LlamaBlock() for _ in range(n))
            self.norm, self.head = RMSNorm(64), torch.nn.Linear(64, 256, bias=False)

        def forward(self, idx, tgt):
            x = self.emb(idx)
            for layer in self.layers:
                x = layer(x)
            return torch.nn.functional.cross_entropy(self.head(self.norm(x)).view(-1, 256), tgt.view(-1))

    torch.manual_seed(0)
    net = Llama(6)
    idx, tgt = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    got = regional.capture_regional(_meta_copy(net), idx.to("meta"), tgt.to("meta"), template=template)
    want_how = "from one traced block" if template else "from a trace of 4; block 0's backward kept whole"
    assert got.regional.startswith(f"spliced: 6 blocks of layers {want_how}"), got.regional
    named = dict(net.named_parameters()) | dict(net.named_buffers()) | {"idx": idx, "tgt": tgt}
    values, grads = run_pair(got.forward, got.backward, named, torch.ones(()), lambda f, inputs: reference.run(f, inputs))
    want = net(idx, tgt)
    want.backward()
    assert torch.allclose(values[output_value(got.forward)], want, rtol=1e-6)
    for name, p in net.named_parameters():
        assert torch.allclose(grads[f"grad({name})"], p.grad, rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("plan", ["megatron", "megatron-sp", {"h.2.mlp.c_fc": "colwise", "h.2.mlp.c_proj": "rowwise"}],
                         ids=["megatron", "megatron-sp", "block-2-only"])
def test_the_propagation_reuses_a_repeated_blocks_choices_and_shards_exactly_as_without(tiny, plan, monkeypatch):
    """Spliced blocks are renamed copies of one traced block (``Op.template``): the propagation
    chooses once per template and neighbourhood (``_Propagator.choose``) and reuses the choice in
    the other blocks. The sharded forward and backward (text, every placement, every collective)
    are those of a propagation that works out every op afresh."""
    from nvtp.sharding import propagate
    from nvtp.sharding.passes import shard, shard_backward

    spliced = tiny[4]
    mesh = DeviceMesh.of_size(2)

    def sharded():
        fwd = shard(spliced.forward, plan, mesh)
        bwd = shard_backward(spliced.backward, fwd, "nvfuser")
        return [(str(s.fusion), dict(s.shardings), [str(c) for c in s.communications]) for s in (fwd, bwd)]

    counts = collections.Counter()
    choose, candidates = propagate._Propagator.choose, propagate._Propagator.candidates
    monkeypatch.setattr(propagate._Propagator, "choose", lambda self, op, f: counts.update(["choose"]) or choose(self, op, f))
    monkeypatch.setattr(propagate._Propagator, "candidates", lambda self, op, f: counts.update(["worked out"]) or candidates(self, op, f))
    reused = sharded()
    assert counts["worked out"] < 0.75 * counts["choose"], counts  # the copies' choices were reused
    monkeypatch.setattr(propagate._Propagator, "choose", lambda self, op, f: self._chosen.clear() or choose(self, op, f))
    afresh = sharded()
    assert reused == afresh and any(c for _, _, c in afresh)

"""The op calls a fused lowered module settles for its mesh position (nvtp/execute/fastcall.py).

Each settled call is checked against ``execute_op``, the interpreter's way of running the same op:
while the programs below are lowered, every settled call is wrapped so that it also runs
``execute_op`` on the same operands and compares the two results (equal values, dtype, shape and
strides). The programs cover one rank, tensor parallelism (row-parallel partial sums: the bias on
position 0 only), sequence parallelism, dp with a mesh axis of one rank, FSDP, an ep axis (whose
expert-row ops must stay ``execute_op``'s) and a transformers Llama; each program's step is also
compared with eager PyTorch's.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch

import nvtp
from nvtp.execute import fastcall, reference, spmd
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh
from tests.test_ep import eager, moe_gpt


@pytest.fixture
def checked(monkeypatch):
    """Every settled call also runs ``execute_op`` and must agree with it; returns the count of
    checked calls per op kind, and the kinds left to ``execute_op`` in fused modules."""
    counts: collections.Counter = collections.Counter()
    left: collections.Counter = collections.Counter()
    settle = fastcall.specialised
    execute = reference.execute_op

    def specialised(ctx, op):
        fast = settle(ctx, op)
        if fast is None:
            left[op.kind] += 1
            return None
        names = reference.value_args(op)
        static = {name: a for name, a in op.args if name not in names}

        def call(ctx, *values):
            got = fast(ctx, *values)
            (want,) = execute(ctx, op, dict(static, **dict(zip(names, values))))
            assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride(), \
                f"{op}: {got.dtype}{list(got.shape)}{got.stride()} against execute_op's {want.dtype}{list(want.shape)}{want.stride()}"
            assert torch.equal(got, want), f"{op}: values differ from execute_op's"
            counts[op.kind] += 1
            return got

        return call

    monkeypatch.setattr(fastcall, "specialised", specialised)
    monkeypatch.setattr(reference, "_CACHE", {})  # every program lowered here, with the check in place
    return counts, left


def _gpt(**overrides):
    torch.manual_seed(0)
    cfg = gpt.config("tiny", vocab_size=256, dropout=0.0, **overrides)
    model = gpt.GPT(cfg)
    with torch.no_grad():  # GPT-2's initialisation zeroes the biases: a bias added twice would not show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=g)
    return model, idx, torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.seq_len), generator=g)


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _eager(model, *args):
    ref = copy.deepcopy(model)
    loss = ref(*args)
    loss.backward()
    return loss.detach(), _grads(ref)


def _on_ranks(model, mesh, calls, loss_of=lambda out: out, **options):
    threads = spmd.ThreadMesh(mesh, timeout=120)
    ranks = [nvtp.jit(copy.deepcopy(model), mesh=mesh, comm=threads.comm(r), **options) for r in range(mesh.size)]
    ranks[0].compile(*calls[0])
    for m in ranks[1:]:
        m.share_compiled(ranks[0])

    def step(r):
        loss = loss_of(ranks[r](*calls[r]))
        loss.backward()
        return loss.detach()

    return ranks, spmd.on_threads(step, threads)


def test_one_rank_of_the_gpt_settles_almost_every_op_and_each_agrees_with_execute_op(checked):
    counts, left = checked
    model, idx, tgt = _gpt()
    want_loss, want_grads = _eager(model, idx, tgt)
    sm = nvtp.jit(copy.deepcopy(model))
    loss = sm(idx, tgt)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(sm.module if hasattr(sm, "module") else sm), want_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    for kind in ("reshape", "permute", "broadcast_in_dim", "matmul", "linear", "sum", "mul", "add", "slice"):
        assert counts[kind] > 0, f"no {kind} settled: {dict(counts)}"
    assert sum(counts.values()) > 10 * sum(left.values()), f"settled {dict(counts)}, left {dict(left)}"


@pytest.mark.parametrize("plan", ["megatron", "megatron-sp"])
def test_tensor_and_sequence_parallel_ranks_settle_their_ops_with_execute_ops_values(checked, plan):
    """tp = 2: the row-parallel linears' results are partial sums (the bias only on position 0),
    the sequence-parallel values split along the sequence (their reshapes and slices settled or
    left by what each rank holds)."""
    counts, _ = checked
    model, idx, tgt = _gpt()
    want_loss, _ = _eager(model, idx, tgt)
    _, losses = _on_ranks(model, DeviceMesh.of_size(2), [(idx, tgt)] * 2, plan=plan)
    for loss in losses:
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert counts["linear"] > 0 and counts["reshape"] > 0


@pytest.mark.parametrize("mesh, options", [(DeviceMesh.of_shape((2, 1), ("dp", "tp")), {}),
                                           (DeviceMesh.of_shape((2,), ("dp",)), {"plan": "megatron", "fsdp": True})],
                         ids=["dp2xtp1", "fsdp2"])
def test_data_parallel_and_fsdp_ranks_settle_their_ops_on_their_rows(checked, mesh, options):
    counts, _ = checked
    model, idx, tgt = _gpt()
    want_loss, _ = _eager(model, idx, tgt)
    half = idx.shape[0] // 2
    calls = [(idx[:half], tgt[:half]), (idx[half:], tgt[half:])]
    _, losses = _on_ranks(model, mesh, calls, **options)
    torch.testing.assert_close(sum(losses) / 2, want_loss, rtol=1e-5, atol=1e-6)
    assert sum(counts.values()) > 100


def test_an_ep_axis_leaves_its_expert_rows_to_execute_op(checked):
    """The ops on the rows an ep axis dispatched to its experts' ranks run through ``execute_op``
    (``ep.Experts``): settled for the declared shapes, they would fail the check or the loss."""
    counts, _ = checked
    model, (idx, tgt) = moe_gpt()
    want = eager(model)(idx, tgt)[1]
    _, losses = _on_ranks(model, DeviceMesh.of_shape((2,), ("ep",)), [(idx, tgt)] * 2, lambda out: out[1], plan="megatron")
    for loss in losses:
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    assert sum(counts.values()) > 0


def test_a_transformers_llama_settles_its_ops_with_execute_ops_values(checked):
    transformers = pytest.importorskip("transformers")
    counts, _ = checked
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                   vocab_size=256, intermediate_size=128, use_cache=False, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    want = model(input_ids=ids, labels=ids).loss
    got = nvtp.jit(copy.deepcopy(model))(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert counts["mul"] > 0 and counts["reshape"] > 0


def test_pytorchs_example_llama_settles_its_rotary_ops_and_their_one_entry_sums(checked, monkeypatch):
    """PyTorch's example Llama (``tests/complex_rotary.py``): its complex rotary runs as real pairs,
    whose backward sums over axes of one entry; those sums run as an add of 0 (a contiguous operand)
    and must still equal the reduction's results."""
    import torch.nn.functional as F

    from tests.complex_rotary import example

    counts, _ = checked
    ones: list = []
    settle_sum = fastcall._sum

    def sum_(ctx, op):  # counts the sums over axes of one entry
        x = op.arg("arg")
        if op.arg("dims") and all(ctx.local_shape(x)[d] == 1 for d in op.arg("dims")):
            ones.append(op)
        return settle_sum(ctx, op)

    monkeypatch.setitem(fastcall._FORMS, "sum", sum_)
    model, idx, targets = example()
    ref = copy.deepcopy(model)
    want = F.cross_entropy(ref(idx).flatten(0, 1), targets.flatten())
    want.backward()
    sm = nvtp.jit(copy.deepcopy(model))
    loss = F.cross_entropy(sm(idx).flatten(0, 1), targets.flatten())
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for (name, got), want_p in zip(sm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want_p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert ones and counts["sum"] > len(ones), f"{len(ones)} one-entry sums, {counts['sum']} sums checked"

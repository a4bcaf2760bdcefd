"""The reference backend's lowered modules (a fusion as a torch.fx GraphModule) compute what its
op implementations compute, op by op: bit for bit, except the fused patterns, which round like
eager PyTorch's kernels; patterns fire where they should, and only where the rank holds whole
rows; no step overwrites an input; each value is dropped after its last use."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nvtp.dump import relative_error
from nvtp.execute import reference, spmd
from nvtp.frontend.capture import capture, forward_inputs, output_value, run_pair
from nvtp.ir import DType, FusionBuilder, verify
from nvtp.models import gpt
from nvtp.sharding.passes import shard_pair
from nvtp.sharding.placements import DeviceMesh, Shard
from tests.conftest import make_block
from tests.op_samples import SAMPLES


def _example(s):
    return s.inputs(torch.Generator().manual_seed(0))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.uint64:
        a, b = a.view(torch.int64), b.view(torch.int64)
    if a.is_floating_point() or a.is_complex():
        return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return a.shape == b.shape and torch.equal(a, b)


def _op_by_op(f, inputs, seed):
    """The fusion evaluated op by op with ``execute_op``, independently of the lowering."""
    ctx = reference.Context(f, seed=seed)
    env = {v.name: reference.input_value(ctx, v, x) for v, x in zip(f.inputs, inputs)}
    for op in f.ops:
        if op.kind == "define_scalar" and op.arg("value") is not None:
            env[op.outputs[0].name] = reference.constant_value(ctx, op)
        elif op.kind not in ("define_tensor", "define_scalar"):
            env.update(zip((v.name for v in op.outputs), reference.execute_op(ctx, op, {n: reference._resolve(a, env) for n, a in op.args})))
    return [env[v.name] for v in f.outputs]


@pytest.mark.parametrize("s", SAMPLES, ids=str)
def test_a_lowered_module_equals_the_op_implementations_on_every_op_sample(s):
    f = verify(s.build())
    inputs = _example(s)
    saved = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    want = _op_by_op(f, inputs, seed=3)
    got = reference.run(f, inputs, seed=3)
    for i, (a, b) in enumerate(zip(got, want)):
        assert _same(torch.as_tensor(a), torch.as_tensor(b)), f"output {i} of {s.name}"
    for x, y in zip(inputs, saved):  # inputs are never written
        assert not isinstance(x, torch.Tensor) or _same(x, y)


@pytest.fixture(scope="module", params=[0.0, 0.3], ids=["no-dropout", "dropout"])
def block(request):
    cfg = gpt.config("tiny", dropout=request.param)
    b = make_block(cfg).train()
    x = gpt.example_input(cfg)
    return cfg, b, x, capture(b, x)


def test_the_gpt_blocks_patterns_fuse(block):
    cfg, _, _, c = block
    fwd, bwd = reference.lower_fusion(c.forward), reference.lower_fusion(c.backward)
    # the causal softmax with its matmuls is one entry (attention_kernel.py); with dropout between softmax and v, the softmax alone
    attention = "softmax" if cfg.dropout else "causal_attention_probs"
    assert fwd.fused == {"layer_norm": 2, "gelu": 1, attention: 1}
    assert bwd.fused == {"layer_norm_backward": 2, "gelu": 1, "gelu_backward": 1, "softmax_backward": 1}
    assert fwd.folded >= 1 and bwd.folded >= 1  # the causal mask is built once
    code = bwd.module.code
    assert "torch_gelu_backward(" in code and "fd_ops_var_mean" not in code


def test_the_lowered_code_drops_each_value_after_its_last_use(block):
    _, _, _, c = block
    lines = reference.lower_fusion(c.forward, fuse=False).module.code.splitlines()
    calls = [line for line in lines if "fd_ops_" in line]
    assert len(calls) > 50  # one line per op
    first = next(i for i, line in enumerate(lines) if "fd_ops_var_mean" in line)
    made = lines[first].split("=")[0].strip()  # the var_mean's (var, mean) pair
    last = max(i for i, line in enumerate(lines) if made in line.split("=", 1)[-1])
    assert f"{made} = None" in lines[last] and last < len(lines) - 2  # dropped well before the end


def _eager_with_masks(b, cfg, x, g, masks, monkeypatch):
    """The block run by eager PyTorch (its own modules and autograd), with the dropout keep-masks
    nvtp drew instead of eager's RNG: ``masks`` is (attention probabilities, residual, MLP).
    Attention is written out (softmax(q kᵀ/√d + causal) · mask/(1-p) · v): eager's fused SDPA
    draws its own mask. Returns the output and the gradients by label."""
    attn_mask, resid_mask, mlp_mask = masks
    keep = 1 - cfg.dropout

    def sdpa(q, k, v, dropout_p=0.0, is_causal=False):
        T = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        return (att * attn_mask / keep) @ v

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    hooks = [b.attn.resid_dropout.register_forward_hook(lambda m, i, o: i[0] * resid_mask / keep),
             b.mlp.dropout.register_forward_hook(lambda m, i, o: i[0] * mlp_mask / keep)]
    try:
        xr = x.detach().clone().requires_grad_()
        y = b(xr)
        y.backward(g)
        grads = {"grad(x)": xr.grad} | {f"grad({n})": p.grad.clone() for n, p in b.named_parameters()}
    finally:
        for h in hooks:
            h.remove()
        b.zero_grad(set_to_none=True)
        monkeypatch.undo()
    return y.detach(), grads


def test_a_fused_block_matches_the_unfused_one_and_eager(block, monkeypatch):
    cfg, b, x, c = block
    named = {n: p.detach() for n, p in b.named_parameters()} | {"x": x.detach()}
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    inputs = forward_inputs(c.forward, named)
    saved = [t.clone() for t in inputs]
    vi, gi = run_pair(c.forward, c.backward, named, g, lambda f, i: reference.run(f, i, seed=5, compiled=False))
    vc, gc = run_pair(c.forward, c.backward, named, g, lambda f, i: reference.run(f, i, seed=5))
    for k in vi:  # same dropout masks, values within the fused kernels' rounding
        if vi[k].dtype == torch.bool:
            assert torch.equal(vi[k], vc[k]), k
        else:
            assert relative_error(vc[k], vi[k])[0] <= 1e-6, k
    assert gi.keys() == gc.keys() and len(gi) == 13  # x and the block's 12 parameters
    for k in gi:
        assert relative_error(gc[k], gi[k])[0] <= 1e-6, k
    assert all(torch.equal(a, b) for a, b in zip(inputs, saved))
    # Eager PyTorch, independent of nvtp's ops, given the same keep-masks (fp32: ~3e-7 seen).
    masks = [vc[v.name] for v in c.forward.outputs if v.dtype == DType.Bool]
    assert len(masks) == (3 if cfg.dropout else 0)
    if cfg.dropout:
        assert all(abs(m.float().mean().item() - (1 - cfg.dropout)) < 0.05 for m in masks)
    y, eager_grads = _eager_with_masks(b, cfg, x, g, masks or [torch.ones(())] * 3, monkeypatch)
    assert relative_error(vc[output_value(c.forward)], y)[0] <= 1e-5
    assert eager_grads.keys() == gc.keys()
    for k in gc:
        assert relative_error(gc[k], eager_grads[k])[0] <= 1e-5, k


@pytest.mark.parametrize("plan", ["megatron", "megatron-sp"])
def test_sharded_programs_fuse_the_same_patterns_on_every_rank(tiny_capture, plan):
    sf, sb = shard_pair(tiny_capture.forward, tiny_capture.backward, plan, DeviceMesh.of_size(2), target="reference")
    for s, kinds in ((sf, {"layer_norm", "gelu", "causal_attention_probs"}), (sb, {"layer_norm_backward", "gelu_backward", "softmax_backward"})):
        programs = [reference.lower_fusion(s.fusion, s.shardings, s.mesh, r, 2) for r in range(2)]
        assert programs[0].fused == programs[1].fused
        assert kinds <= set(programs[0].fused), (plan, programs[0].fused)


def test_a_pattern_needs_whole_rows():
    """LayerNorm over an axis the rank holds only part of is not a row-wise kernel: the ops run."""
    b = FusionBuilder()
    x = b.define_tensor([4, 8], DType.Float)
    w = b.define_tensor([8], DType.Float)
    var, mean = b.op("var_mean", x, dims=[1], correction=0)
    rstd = b.op("rsqrt", b.op("add", b.op("broadcast_in_dim", var, shape=[4, 1], broadcast_dims=[0]), 1e-5))
    mean_k = b.op("broadcast_in_dim", mean, shape=[4, 1], broadcast_dims=[0])
    xhat = b.op("mul", b.op("sub", x, b.op("broadcast_in_dim", mean_k, shape=[4, 8], broadcast_dims=[0, 1])),
                b.op("broadcast_in_dim", rstd, shape=[4, 8], broadcast_dims=[0, 1]))
    b.add_output(b.op("mul", xhat, b.op("broadcast_in_dim", w, shape=[4, 8], broadcast_dims=[1])))
    f = verify(b.build())
    assert reference.lower_fusion(f).fused == {"layer_norm": 1}
    rows = {v.name: (Shard(0),) for v in f.values.values() if v.shape and v.shape[0] == 4}
    assert reference.lower_fusion(f, rows, DeviceMesh.of_size(2), 0, 2).fused == {"layer_norm": 1}
    cols = {v.name: (Shard(v.ndim - 1),) for v in f.values.values() if v.shape and v.shape[-1] == 8}
    assert reference.lower_fusion(f, cols, DeviceMesh.of_size(2), 0, 2).fused == {}
    xs, ws = torch.randn(4, 8), torch.randn(8)
    assert relative_error(reference.run(f, [xs, ws])[0], torch.nn.functional.layer_norm(xs, [8], ws, eps=1e-5))[0] <= 1e-6


def test_dropout_masks_are_those_of_the_unfused_run_sharded_too(tiny_cfg):
    cfg = gpt.config("tiny", dropout=0.5)
    c = capture(make_block(cfg).train(), gpt.example_input(cfg), backward=False)
    sf, _ = shard_pair(c.forward, None, "megatron", DeviceMesh.of_size(2), target="reference")
    from nvtp import dump

    inputs = dump.random_inputs(c.forward, seed=0)
    single = reference.run(c.forward, inputs, seed=7, compiled=False)
    per_rank, _ = spmd.run_simulated(sf, inputs, seed=7)
    whole = spmd.assemble_outputs(sf, per_rank)
    masks = [(v, a, b) for v, a, b in zip(c.forward.outputs, whole, single) if v.dtype == DType.Bool]
    assert len(masks) == 3  # attention probabilities, attention residual, MLP
    for v, a, b in masks:
        assert torch.equal(a, b), v.name
        assert 0.4 < a.float().mean().item() < 0.6, v.name  # keep probability 1 - p: a mask, not a constant


def test_a_changed_implementation_table_is_honoured(monkeypatch):
    """A monkeypatched implementation (tests inject faults that way) is called, unfused."""
    s = next(s for s in SAMPLES if s.name == "exp")
    f = s.build()
    calls = []
    original = reference.IMPLS["exp"]
    monkeypatch.setitem(reference.IMPLS, "exp", lambda ctx, op, a: calls.append(1) or original(ctx, op, a))
    reference.run(f, _example(s))
    assert calls == [1]


def test_the_executor_has_no_import_circle():
    """reference.py imports lower.py and patterns.py; neither imports reference.py back."""
    import ast
    import pathlib

    root = pathlib.Path(reference.__file__).parent
    for name in ("lower.py", "patterns.py"):
        tree = ast.parse((root / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
                   {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "nvtp.execute" for a in n.names}
        assert "nvtp.execute.reference" not in imported and "reference" not in names, name
    assert not (root / "compiled.py").exists()

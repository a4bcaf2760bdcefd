"""Thunder front end: one forward and one backward fusion per block, traced (not written), labelled,
and numerically equal to eager PyTorch on the reference backend."""

from __future__ import annotations

import pytest
import thunder
import torch
import torch.nn as nn
import torch.nn.functional as F

from nvtp.dump import relative_error
from nvtp.execute import reference
from nvtp.frontend.capture import CaptureError, capture, fusion_callables, output_value, run_pair
from nvtp.models import gpt
from tests.conftest import make_block


def kinds(fusion):
    return [op.kind for op in fusion.compute_ops()]


def test_block_traces_to_one_forward_and_one_backward_fusion(tiny_capture):
    c = tiny_capture
    assert c.unclaimed == []
    assert len(fusion_callables(thunder.last_traces(c.jitted)[-1])) == 1
    assert len(fusion_callables(thunder.last_backward_traces(c.jitted)[-1])) == 1
    assert "linear" in kinds(c.forward) and "matmul" in kinds(c.backward)
    # fp32 attention is decomposed (flash attention is half precision only), like Thunder does
    assert "sdpfa_fwd" not in kinds(c.forward)


def test_bf16_block_uses_flash_attention_ops(tiny_bf16_capture):
    c, _ = tiny_bf16_capture
    assert kinds(c.forward).count("sdpfa_fwd") == 1
    assert kinds(c.backward).count("sdpfa_bwd") == 1
    assert len(fusion_callables(thunder.last_traces(c.jitted)[-1])) == 1


def test_fusions_follow_the_traced_code(tiny_cfg):
    """The fusion is Thunder's trace of the module: change the module and the fusion changes."""

    class ReluMLP(gpt.MLP):
        def forward(self, x):
            return self.dropout(self.c_proj(F.relu(self.c_fc(x))))

    block = make_block(tiny_cfg)
    relu_block = make_block(tiny_cfg)
    relu_block.mlp = ReluMLP(tiny_cfg)
    x = gpt.example_input(tiny_cfg)
    gelu_ops = kinds(capture(block, x, backward=False).forward)
    relu_ops = kinds(capture(relu_block, x, backward=False).forward)
    assert "tanh" in gelu_ops and "tanh" not in relu_ops


def test_unclaimable_op_is_named_with_its_source_line(tiny_cfg):
    class Sorting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.sort(self.lin(x), dim=-1)[0]  # no nvtp translation for sort

    with pytest.raises(CaptureError) as e:
        capture(Sorting(), torch.randn(2, 8, requires_grad=True))
    msg = str(e.value)
    assert "sort" in msg and "test_frontend.py:" in msg


def test_inputs_and_outputs_are_labelled(tiny_capture, tiny_block):
    f, b = tiny_capture.forward, tiny_capture.backward
    params = dict(tiny_block.named_parameters())
    fwd_labels = {f.label(v.name): f.role(v.name) for v in f.inputs}
    assert fwd_labels.pop("x") == "activation"
    assert fwd_labels == {name: "parameter" for name in params}
    fwd_values = f.values
    roles = [b.role(v.name) for v in b.inputs]
    assert roles.count("grad") == 1
    for v in b.inputs:
        info = b.info[v.name]
        if info.role == "saved":
            src = fwd_values[info.source]  # a forward value, same type
            assert (src.shape, src.dtype) == (v.shape, v.dtype)
        elif info.role == "parameter":
            assert info.label in params and params[info.label].shape == v.shape
    assert sorted(b.label(v.name) for v in b.outputs) == sorted(f"grad({n})" for n in ["x", *params])


def eager_and_fusions(block, capture_result, cfg, dtype):
    x = gpt.example_input(cfg, dtype=dtype)
    g = torch.randn(cfg.batch, cfg.seq_len, cfg.n_embd, generator=torch.Generator().manual_seed(1)).to(dtype)
    named = {n: p.detach() for n, p in block.named_parameters()} | {"x": x.detach()}
    values, grads = run_pair(capture_result.forward, capture_result.backward, named, g, lambda f, i: reference.run(f, i))
    x_ref = x.detach().clone().requires_grad_()
    block.zero_grad()
    y = block(x_ref)
    y.backward(g)
    errors = {"y": relative_error(values[output_value(capture_result.forward)], y)[0]}
    for name, p in [("x", x_ref)] + list(block.named_parameters()):
        errors[f"grad({name})"] = relative_error(grads[f"grad({name})"], p.grad)[0]
    block.zero_grad()
    return errors


def test_reference_backend_matches_eager_fp32(tiny_capture, tiny_block, tiny_cfg):
    errors = eager_and_fusions(tiny_block, tiny_capture, tiny_cfg, torch.float32)
    assert len(errors) == 14
    assert max(errors.values()) <= 1e-5, errors


def test_reference_backend_matches_eager_bf16(tiny_bf16_capture, tiny_cfg):
    c, block = tiny_bf16_capture
    errors = eager_and_fusions(block, c, tiny_cfg, torch.bfloat16)
    assert max(errors.values()) <= 2e-2, errors


def test_jitted_module_matches_eager(tiny_capture, tiny_block, tiny_cfg):
    """The path a Thunder user takes: call the jitted module, backprop, read .grad."""
    x = gpt.example_input(tiny_cfg)
    y = tiny_capture.jitted(x)
    y.sum().backward()
    jit_grads = {n: p.grad.clone() for n, p in tiny_block.named_parameters()}
    tiny_block.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    y2 = tiny_block(x2)
    y2.sum().backward()
    assert relative_error(y, y2)[0] <= 1e-5
    assert relative_error(x.grad, x2.grad)[0] <= 1e-5
    for n, p in tiny_block.named_parameters():
        assert relative_error(jit_grads[n], p.grad)[0] <= 1e-5, n
    tiny_block.zero_grad()


def test_dropout_is_reproducible_from_a_seed(tiny_cfg):
    cfg = gpt.config("tiny", dropout=0.5)
    block = make_block(cfg).train()
    c = capture(block, gpt.example_input(cfg), backward=False)
    named = {n: p.detach() for n, p in block.named_parameters()} | {"x": gpt.example_input(cfg).detach()}
    from nvtp.frontend.capture import forward_inputs

    inputs = forward_inputs(c.forward, named)
    masks = [i for i, v in enumerate(c.forward.outputs) if v.dtype.value == "Bool"]
    assert len(masks) >= 2  # attention-probability and residual dropout keep-masks are saved for backward
    a = reference.run(c.forward, inputs, seed=7)
    b = reference.run(c.forward, inputs, seed=7)
    other = reference.run(c.forward, inputs, seed=8)
    for i in masks:
        assert torch.equal(a[i], b[i])
        assert not torch.equal(a[i], other[i])
        assert abs(a[i].float().mean().item() - 0.5) < 0.05  # keep probability 1 - p
    # Through Thunder: torch.manual_seed governs nvtp's dropout like eager dropout.
    x = gpt.example_input(cfg)
    torch.manual_seed(3)
    y1 = c.jitted(x)
    torch.manual_seed(3)
    y2 = c.jitted(x)
    torch.manual_seed(4)
    y3 = c.jitted(x)
    assert torch.equal(y1, y2) and not torch.equal(y1, y3)

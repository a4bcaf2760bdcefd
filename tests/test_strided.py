"""Strided slices and their gradient (interior padding), written as stride-1 ops (nvtp/frontend/strided.py).

Interleaved rotary embeddings (GPT-J, CodeGen, Cohere) read ``x[..., ::2]`` and ``x[..., 1::2]``;
Thunder traces a slice with stride 2 and, for its gradient, a ``pad`` with interior padding, which
nvtp used to refuse ("pad with interior (dilation) padding") and nvFuser has neither of. Every test
compares with eager PyTorch on one process, computed independently; the model tests train a
transformers GPT-J on a simulated mesh of 2 (ranks as threads), the other families in the slow tier
(and on 2 gloo processes: ``tools/train_hf.py --model gptj``).
"""

from __future__ import annotations

import pytest
import torch

from nvtp.dump import relative_error
from tests.one_process import jit_and_eager


class EveryStride(torch.nn.Module):
    """Strided slices of several steps, starts and lengths (odd ones too), and an interleaved rotary."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 7, 12, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):                           # x: [4, 7, 12]
        h = x * self.w
        even, odd = h[..., ::2], h[..., 1::2]       # [4, 7, 6] each: the interleaved pairs
        rotated = torch.stack((-odd, even), dim=-1).flatten(-2)  # GPT-J's rotate_every_two
        a = h[:, 1:7:3, 2:11:4]                     # [4, 2, 3]: two strided axes, starts and ends not on the grid
        b = h[::3, ::5]                             # [2, 2, 12]: odd sizes, the last element taken
        c = h[:, 6:7:2]                             # one element taken by a stride
        return (rotated * h).sum() + a.pow(2).sum() + (b * 3).sum() + c.exp().sum()


def test_strided_slices_and_their_gradients_match_eager_with_no_strided_op_left():
    torch.manual_seed(0)
    model = EveryStride()
    x = torch.randn(4, 7, 12, generator=torch.Generator().manual_seed(1))
    run = jit_and_eager(model, x)
    jitted = run.jitted
    assert relative_error(run.y, run.want)[0] <= 1e-6
    assert relative_error(run.x_grad, run.want_x_grad)[0] <= 1e-6
    assert relative_error(jitted.module.w.grad, model.w.grad)[0] <= 1e-6
    for fusion in (jitted.last.forward.source, jitted.last.backward.source):  # nvFuser's slice takes stride 1 only
        slices = [op for op in fusion.ops if op.kind == "slice"]
        assert slices and all(set(op.arg("strides") or (1,)) == {1} for op in slices), fusion.name


def test_nvfuser_builds_the_strided_fusions_from_their_text(tmp_path):
    """Sharded for nvFuser over 2 devices (heads split by the explicit plan's batch axis), printed and
    built by nvfuser_direct from the text: no strided slice, no interior pad reaches nvFuser."""
    from nvtp import driver
    from nvtp.dump.sharded import format_sharded
    from tests.test_nvfuser_text import check_nvfuser_reads

    program = driver.compile(EveryStride(), torch.randn(4, 7, 12, requires_grad=True), plan={"x": "S(0)", "w": "S(0)"},
                             mesh=2, backend="nvfuser")
    for role, sharded in (("fwd", program.forward), ("bwd", program.backward)):
        path = tmp_path / f"strided_{role}.py"
        path.write_text(format_sharded(sharded, [f"{role} of tests/test_strided.py EveryStride, x split on axis 0"]))
        assert "ideviceIdx.x" in check_nvfuser_reads(path), role


transformers = pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")


@pytest.mark.parametrize("family,plan", [
    ("gptj", "megatron"),
    pytest.param("gptj", "megatron-sp", marks=pytest.mark.slow),
    pytest.param("codegen", "megatron", marks=pytest.mark.slow),
    pytest.param("codegen", "megatron-sp", marks=pytest.mark.slow),
    pytest.param("cohere", "megatron", marks=pytest.mark.slow),
    pytest.param("cohere", "megatron-sp", marks=pytest.mark.slow),
])
def test_interleaved_rotary_families_match_eager_on_2_ranks(family, plan):
    """A transformers model with interleaved rotary embeddings on a simulated mesh of 2: loss, logits
    and every gradient as eager's (tests/test_hf.py's check_parity), the projections split."""
    from nvtp.models.hf import build
    from tests.test_hf import Mesh, check_parity, tokens

    model = build(family)
    worst = check_parity(model, Mesh(model, 2, plan, tokens(), labels=tokens()), tokens())
    assert worst["split"] >= 2 * 4, worst
    print(family, plan, worst)

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


class InterleavedMLP(torch.nn.Module):
    """gpt-oss's gate and up interleaved in one projection's features (``h[..., ::2]``, ``h[..., 1::2]``)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = torch.nn.Linear(16, 64, bias=False)
        self.down = torch.nn.Linear(32, 16, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(torch.randn(64, 16, generator=g) / 4)
            self.down.weight.copy_(torch.randn(16, 32, generator=g) / 4)

    def forward(self, x):
        h = self.up(x)
        gate, up = h[..., ::2], h[..., 1::2]
        return (self.down(torch.nn.functional.silu(gate) * up) ** 2).sum()


def test_a_strided_slice_of_a_split_projection_keeps_it_split_as_megatron_splits_it():
    """On 2 simulated ranks, Megatron's plan splits the interleaved projection by its output features
    in contiguous halves (each holds whole gate/up pairs: the slices by 2 are taken on the rank) and
    the down projection by its input features: one all-reduce forward, none gathering the
    interleaved features; loss and gradients as eager's."""
    import copy

    import nvtp
    from nvtp.execute import spmd
    from nvtp.execute.collectives import ThreadComm, ThreadGroup
    from nvtp.sharding.placements import DeviceMesh

    model = InterleavedMLP()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    group = ThreadGroup(2)
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=DeviceMesh.of_size(2), comm=ThreadComm(group, r)) for r in range(2)]

    def run(r):
        loss = ranks[r](x)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in ranks[r].module.named_parameters()}

    got = spmd.on_threads(run, group)
    want = model(x)
    want.backward()
    program = ranks[0].last
    placements = {n: str(p) for n, p in program.parameters.items() if n != "x"}
    assert placements == {"up.weight": "S(0)", "down.weight": "S(1)"}, placements
    kinds = [s.kind for s in program.steps() if s.phase == "forward"]
    assert kinds == ["allreduce"], kinds
    for loss, grads in got:
        assert relative_error(loss, want.detach())[0] <= 1e-6
    up = torch.cat([got[r][1]["up.weight"] for r in range(2)], 0)
    down = torch.cat([got[r][1]["down.weight"] for r in range(2)], 1)
    assert relative_error(up, model.up.weight.grad)[0] <= 1e-6
    assert relative_error(down, model.down.weight.grad)[0] <= 1e-6


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

"""Complex arithmetic written as real arithmetic (nvtp/frontend/complex.py), checked against eager.

Eager PyTorch differentiates complex ops itself (a complex multiply's gradient conjugates), so
every test compares nvtp's fusions, which hold real ops only, with the eager module computed
independently: forward values and every gradient. The model tests train
``tests/complex_rotary.ComplexRotaryLM`` (rotary embeddings by ``torch.polar``,
``view_as_complex``, a complex multiply and ``view_as_real``, as Llama's reference code writes
them) on a simulated mesh of 2 (ranks as threads), and on 2 gloo processes (slow tier).
"""

from __future__ import annotations

import copy

import pytest
import torch

import nvtp
from nvtp.dump import relative_error
from nvtp.execute import spmd
from nvtp.execute.collectives import ThreadComm, ThreadGroup
from nvtp.frontend.capture import CaptureError
from nvtp.sharding.placements import DeviceMesh, axis_split
from tests.complex_rotary import ComplexRotaryLM, Config


class EveryComplexOp(torch.nn.Module):
    """One use of each complex op nvtp has a rule for, ending in a real result."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 6, generator=g))
        self.r = torch.nn.Parameter(torch.rand(8, 3, generator=g) + 0.5)
        self.theta = torch.nn.Parameter(torch.randn(8, 3, generator=g))
        self.register_buffer("table", torch.polar(torch.ones(8, 3), torch.randn(8, 3, generator=g)))

    def forward(self, x):                                           # x: [4, 8, 6]
        a = torch.view_as_complex((x * self.w).reshape(4, 8, 3, 2))  # [4, 8, 3]
        b = torch.polar(self.r, self.theta)                           # [8, 3], from parameters
        c = a * b + a                                                 # complex * complex, complex + complex
        c = torch.sub(c, b, alpha=0.5) / (b + 2.0)                    # alpha; complex / complex; complex + number
        c = c * 1j - a * self.table + c / 4.0                         # by a complex number; by a buffer; by a real number
        c = torch.exp(0.1 * c).conj() * a                             # exp, conj
        z = torch.complex(x[..., 0:3], x[..., 3:6]) * c               # real and imaginary parts given
        z = z.transpose(0, 1).permute(1, 0, 2).unsqueeze(1).expand(4, 2, 8, 3)[:, 0]
        z = torch.cat([z, a.flatten(1).view(4, 8, 3)], dim=-1)[..., 1:5]  # cat; getitem with an ellipsis
        z = torch.stack([z, z * 2], dim=1).sum(1) + z.mean(-1, keepdim=True)
        z = z.to(torch.complex128).to(torch.complex64) + x[..., 2:6].to(torch.complex64)  # complex to complex, real to complex
        z = torch.div((-z).contiguous().clone().reshape(4, 8, 1, 4).squeeze(2).type_as(z), 2.0)  # layout no-ops
        z = torch.resolve_neg(torch.resolve_conj(z.conj_physical())).expand_as(z)
        out = torch.view_as_real(z).sum(-1) + z.real * z.imag + z.abs() + z.angle() + (z - z.conj()).imag
        return out                                                    # [4, 8, 4] real


def test_every_complex_rule_matches_eager_forward_and_gradients():
    """Forward and the gradients of the input and of the parameters through polar, within 1e-6."""
    torch.manual_seed(0)
    model = EveryComplexOp()
    x = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(1))
    jitted = nvtp.jit(copy.deepcopy(model), plan="replicate")
    xs = x.clone().requires_grad_()
    y = jitted(xs)
    y.pow(2).sum().backward()
    want_x = x.clone().requires_grad_()
    want = model(want_x)
    want.pow(2).sum().backward()
    assert relative_error(y, want)[0] <= 1e-6
    assert relative_error(xs.grad, want_x.grad)[0] <= 1e-6
    for name, p in model.named_parameters():
        assert relative_error(dict(jitted.module.named_parameters())[name].grad, p.grad)[0] <= 1e-6, name
    ops = {op.kind for op in jitted.last.forward.source.ops}
    assert not any("complex" in k or "real" in k for k in ops), ops  # real arithmetic only
    assert all(not v.dtype.is_complex for v in jitted.last.forward.source.inputs)  # the complex buffer enters as its pair


def test_a_complex_op_without_a_rule_is_named_with_its_line():
    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 2))

        def forward(self, x):
            return torch.view_as_real(torch.sqrt(torch.view_as_complex(x * self.w)))

    with pytest.raises(CaptureError) as e:
        nvtp.jit(Root(), plan="replicate")(torch.randn(3, 4, 2))
    text = str(e.value)
    assert "sqrt at " in text and "test_complex.py:" in text and "real tensors" in text, text


# -- a model written with complex rotary embeddings -----------------------------------------------


def _train_on_threads(model: torch.nn.Module, plan: str, d: int, steps: int, tokens: torch.Tensor, targets: torch.Tensor):
    """Train copies of ``model`` with nvtp on a simulated mesh of ``d`` and once in eager PyTorch;
    (losses per step of rank 0, eager's losses, the ranks, the eager model)."""
    group, mesh = ThreadGroup(d, timeout=120), DeviceMesh.of_size(d)
    ranks = [nvtp.jit(copy.deepcopy(model), plan=plan, mesh=mesh, comm=ThreadComm(group, r)) for r in range(d)]
    ranks[0].compile(tokens)
    for m in ranks[1:]:
        m.share_compiled(ranks[0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in ranks]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def step(r):
        opts[r].zero_grad()
        loss = loss_of(ranks[r](tokens))
        loss.backward()
        opts[r].step()
        return loss.item()

    got, want = [], []
    for _ in range(steps):
        losses = spmd.on_threads(step, group)
        assert len(set(losses)) == 1, losses  # every rank computes the whole loss
        got.append(losses[0])
        ref_opt.zero_grad()
        loss = loss_of(ref(tokens))
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    return got, want, ranks, ref


def _check_training(got, want, ranks, ref, d):
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)
    split = []
    for name, p in ref.named_parameters():
        placement = ranks[0].placement(name)
        parts = [dict(m.module.named_parameters())[name].detach() for m in ranks]
        whole = spmd.assemble(parts, placement, p.shape)
        assert relative_error(whole, p.detach())[0] <= 1e-4, name
        if axis_split(placement) is not None:
            split.append(name)
            assert all(t.numel() * d == p.numel() for t in parts), name  # each rank holds 1/d
    return split


TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
TARGETS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def megatron_run():
    torch.manual_seed(0)
    model = ComplexRotaryLM(Config(layers=1))
    return _train_on_threads(model, "megatron", 2, 4, TOKENS, TARGETS)


def test_complex_rotary_model_trains_like_eager_with_megatron(megatron_run):
    """The rotary table is a complex buffer, reassigned in forward; heads split, the table broadcast."""
    got, want, ranks, ref = megatron_run
    split = _check_training(got, want, ranks, ref, 2)
    m = ranks[0]
    assert [str(m.placement(f"blocks.0.attn.{w}.weight")) for w in ("wq", "wk", "wv", "wo")] == ["S(0)", "S(0)", "S(0)", "S(1)"]
    assert str(m.placement("blocks.0.w2.weight")) == "S(1)" and "embed.weight" in split and "head.weight" in split
    assert str(m.placement("freqs")) == "R"


def test_complex_rotary_model_with_polar_in_forward_trains_like_eager_with_megatron_sp():
    """torch.polar inside forward (the table computed from positions), sequence parallelism."""
    torch.manual_seed(0)
    model = ComplexRotaryLM(Config(layers=1, tables_in_forward=True))
    got, want, ranks, ref = _train_on_threads(model, "megatron-sp", 2, 3, TOKENS, TARGETS)
    split = _check_training(got, want, ranks, ref, 2)
    assert {"blocks.0.attn.wq.weight", "blocks.0.attn.wo.weight", "blocks.0.w1.weight"} <= set(split)


def test_nvfuser_builds_the_complex_rotary_fusions_from_their_text(megatron_run, tmp_path):
    """The fusions the model trained with, sharded for nvFuser (``nvtp shard``'s target) with plan
    megatron over 2 devices, printed and built by nvfuser_direct from the text (the contract of
    tests/test_nvfuser_text.py): the pairs need no new op."""
    from nvtp import driver
    from nvtp.dump.sharded import format_sharded
    from tests.test_nvfuser_text import check_nvfuser_reads

    program = driver.shard(megatron_run[2][0].last.traced, "megatron", DeviceMesh.of_size(2), "nvfuser")
    for role, sharded in zip(("fwd", "bwd"), (program.forward, program.backward)):
        path = tmp_path / f"complex_rotary_{role}.py"
        path.write_text(format_sharded(sharded, [f"{role} of tests/complex_rotary.py, plan megatron over 2 devices"]))
        math = check_nvfuser_reads(path)
        assert "ideviceIdx.x" in math, role


def _gloo_worker(rank, world, init_method, plan, out):
    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    torch.manual_seed(0)
    model = nvtp.jit(ComplexRotaryLM(Config()), plan=plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        logits = model(TOKENS)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), TARGETS.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    whole = {n: nvtp.full_tensor(p) for n, p in model.module.named_parameters()}  # a collective: every rank
    local = {n: p.to_local().numel() if hasattr(p, "to_local") else p.numel() for n, p in model.module.named_parameters()}
    if rank == 0:
        torch.save({"losses": losses, "params": whole, "local": local}, out)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["megatron", "megatron-sp"])
def test_complex_rotary_model_trains_like_eager_on_two_gloo_processes(plan, tmp_path):
    """2 layers, 5 SGD steps on 2 processes: every loss within 1e-5 (relative) of eager, the final
    weights within 1e-4, each rank holding half of every split weight."""
    from nvtp.execute.launch import spawn

    out = tmp_path / "r.pt"
    assert spawn(_gloo_worker, 2, plan, str(out)) == [0, 0]
    got = torch.load(out, weights_only=False)
    torch.manual_seed(0)
    ref = ComplexRotaryLM(Config())
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(5):
        opt.zero_grad()
        logits = ref(TOKENS)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), TARGETS.reshape(-1))
        loss.backward()
        opt.step()
        assert abs(got["losses"][step] - loss.item()) <= 1e-5 * abs(loss.item()), (step, got["losses"], loss.item())
    halves = 0
    for name, p in ref.named_parameters():
        assert relative_error(got["params"][name], p.detach())[0] <= 1e-4, name
        halves += got["local"][name] * 2 == p.numel()
    assert halves == 16  # wq, wk, wv, wo, w1, w2, w3 of both layers, embed, head

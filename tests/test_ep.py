"""Expert parallelism (issue 35, item 2): the "ep" mesh axis (``nvtp/sharding/axes/ep.py``).

Every run is compared with the unsharded model in eager PyTorch on one process, its experts
computed by a plain gather of each row's expert weight (``naive_experts``), not by nvtp's
``gather_mm``: losses and logits within 1e-5 relative, every gradient (every expert's, one no
token chose included) within 1e-5, the all-to-all bytes a run sends equal to the Program's steps.

Default tier: nvtp's MoE GPT at ep=2 on simulated ranks (one trace, ~40 s on the shared 2-core
machine); the refusals (fusions built by hand: milliseconds); what the slow tier's transformers
builds carry (eager, seconds). Slow tier: gloo processes at ep=2
and (dp, ep) = (2, 2), 3 SGD steps; (ep, tp) = (2, 2) simulated; the CLI; transformers' DeepSeek-V3,
Qwen2-MoE, Qwen3-MoE, OLMoE and gpt-oss at ep=2, (ep, tp) and (dp, ep) = (2, 2) on gloo processes
(DeepSeek-V3 also at ep=4 and with FSDP), 3 AdamW steps, every step's loss and gradients compared
with eager at the same weights; ``nvtp explain`` of DeepSeek-V3 at ep=2 as typed.
"""

from __future__ import annotations

import copy
import math
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import nvtp
from nvtp import driver
from nvtp.dump import relative_error
from nvtp.execute import ep as ep_run
from nvtp.execute import spmd
from nvtp.execute.launch import spawn
from nvtp.ir.build import FusionBuilder
from nvtp.ir.dtypes import DType
from nvtp.models import moe
from nvtp.sharding.axes.ep import ExpertError
from nvtp.sharding.placements import DeviceMesh, Replicate, Shard, _StridedShard
from nvtp.steps import tensor_steps


def naive_experts(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``nvtp.models.moe.Experts.forward`` without nvtp's op: each routed row times its expert's
    weight gathered whole (``w[index]``: [rows, in, out]), by autograd's own gradients."""
    n, e = x.shape
    k = index.shape[-1]
    rows = x.unsqueeze(1).expand(n, k, e).reshape(n * k, 1, e)
    experts = index.reshape(n * k)
    h = F.gelu(torch.bmm(rows, self.w_fc[experts]), approximate="tanh")
    y = torch.bmm(h, self.w_proj[experts]).squeeze(1) * weights.reshape(n * k, 1).to(h.dtype)
    return y.reshape(n, k, e).sum(dim=1)


def capped_experts(ranks: int, factor: float, dropped: list[int]):
    """``naive_experts`` dropping what an ep axis of ``ranks`` ranks with capacity factor
    ``factor`` drops (Megatron-Core's "position" policy, written out here): each rank routes its
    1/ranks of the rows (token-major: token t's k choices are rows t*k .. t*k+k-1), and each
    expert keeps the first ceil(factor * rows / experts) of a rank's rows, in row order; a dropped
    row adds nothing. ``dropped`` receives each call's count of dropped rows."""

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, e = x.shape
        k = index.shape[-1]
        experts = self.w_fc.shape[0]
        flat = index.reshape(n * k)
        per = n * k // ranks
        cap = min(per, math.ceil(factor * per / experts))
        keep = torch.ones(n * k, dtype=torch.bool)
        for r in range(ranks):
            taken = [0] * experts
            for s in range(r * per, (r + 1) * per):
                keep[s] = taken[int(flat[s])] < cap
                taken[int(flat[s])] += 1
        dropped.append(int((~keep).sum()))
        rows = x.unsqueeze(1).expand(n, k, e).reshape(n * k, 1, e)
        h = F.gelu(torch.bmm(rows, self.w_fc[flat]), approximate="tanh")
        y = torch.bmm(h, self.w_proj[flat]).squeeze(1) * weights.reshape(n * k, 1).to(h.dtype) * keep[:, None]
        return y.reshape(n, k, e).sum(dim=1)

    return forward


def eager_capped(model: torch.nn.Module, ranks: int, factor: float) -> tuple[torch.nn.Module, list[int]]:
    ref, dropped = copy.deepcopy(model), []
    for m in ref.modules():
        if isinstance(m, moe.Experts):
            m.forward = capped_experts(ranks, factor, dropped).__get__(m)
    return ref, dropped


class WithLogits(torch.nn.Module):
    """nvtp's MoE GPT returning (logits, loss): ``MoEGPT.forward`` with its logits kept."""

    def __init__(self, gpt: moe.MoEGPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx, targets):
        g = self.gpt
        x = g.drop(g.wte(idx) + g.wpe(torch.arange(idx.shape[1], device=idx.device)))
        aux = 0.0
        for block in g.h:
            x, layer_aux = block(x)
            aux = aux + layer_aux
        logits = g.lm_head(g.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) + g.cfg.aux_loss_coef * aux
        return logits, loss


def moe_gpt(idle: bool = True, **overrides) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The tiny MoE GPT (4 experts, top-2, batch 4) with its logits; with ``idle``, layer 0 routes
    every token to the same two experts (both on one ep rank: the other receives no row)."""
    cfg = moe.config("tiny", **({"batch": 4} | overrides))
    torch.manual_seed(0)
    gpt = moe.MoEGPT(cfg)
    if idle:
        with torch.no_grad():
            gpt.h[0].ln_2.weight.fill_(1e-4)
            gpt.h[0].ln_2.bias.copy_(torch.linspace(-1, 1, cfg.n_embd))
    return WithLogits(gpt), moe.example_tokens(cfg)


def eager(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose experts run ``naive_experts``."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, moe.Experts):
            m.forward = naive_experts.__get__(m)
    return ref


def ranks_on(model, mesh: DeviceMesh, *args):
    threads = spmd.ThreadMesh(mesh, timeout=300)
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=mesh, comm=threads.comm(r)) for r in range(mesh.size)]
    ranks[0].compile(*args)
    for m in ranks[1:]:
        m.share_compiled(ranks[0])
    return ranks, threads


def check_one_step(model, batch, mesh: DeviceMesh):
    """One forward and backward on every rank of ``mesh`` (simulated) and in eager: logits, loss
    and every gradient within 1e-5; returns (ranks, the all-to-alls a second step recorded: the
    first call also runs nvtp.jit's first-call check, ``nvtp.guard``)."""
    ranks, threads = ranks_on(model, mesh, *batch)

    def step(m):
        logits, loss = m(*batch)
        loss.backward()
        return logits.detach(), loss.detach()

    outs = spmd.on_threads(lambda r: step(ranks[r]), threads)
    grads = [{n: p.grad.clone() for n, p in m.module.named_parameters()} for m in ranks]
    with ep_run.recording() as sent:
        spmd.on_threads(lambda r: step(ranks[r]), threads)
    ref = eager(model)
    logits, loss = ref(*batch)
    loss.backward()
    for got_logits, got_loss in outs:
        assert relative_error(got_loss, loss.detach())[0] <= 1e-5
        assert relative_error(got_logits, logits.detach())[0] <= 1e-5
    for name, p in ref.named_parameters():
        got = spmd.assemble([g[name] for g in grads], ranks[0].placement(name), p.shape, mesh)
        assert relative_error(got, p.grad)[0] <= 1e-5, name
    return ranks, grads, sent


@pytest.fixture(scope="module")
def ep2_step():
    """The MoE GPT's one step at ep=2 on simulated ranks (``check_one_step``), traced once for the tests below."""
    model, batch = moe_gpt()
    mesh = DeviceMesh.of_shape((2,), ("ep",))
    return model, batch, mesh, *check_one_step(model, batch, mesh)


def test_moe_gpt_at_ep2_matches_eager_and_sends_what_its_program_plans(ep2_step):
    """The MoE GPT at ep=2 (simulated ranks; each passes the whole batch): logits, loss and every
    gradient as eager; in layer 0 rank 0's two experts receive no row (zero gradients). Each expert
    weight is split along its experts, the router whole; the experts' gradients are not reduced
    over ep. The all-to-alls the run sends (every rank) are the Program's steps, byte for byte;
    ``nvtp explain`` prints the experts per rank and the dispatch and combine bytes."""
    model, batch, mesh, ranks, grads, sent = ep2_step
    m = ranks[0]
    idle = grads[0]["gpt.h.0.moe.experts.w_fc"]  # rank 0's experts 0 and 1: layer 0 routes every token to 2 and 3
    assert idle.abs().max() == 0 and all(g.abs().max() > 0 for g in grads[1]["gpt.h.0.moe.experts.w_fc"])
    assert str(m.placement("gpt.h.0.moe.experts.w_fc")) == "S(0)" and str(m.placement("gpt.h.1.moe.experts.w_proj")) == "S(0)"
    assert str(m.placement("gpt.h.0.moe.router.gate.weight")) == "R"
    program = m.last
    planned = [s for s in program.steps() if s.kind == "alltoall"]
    # Per layer the rows cross once each way per pass, kept on their experts' ranks across the MLP
    # (gather_mm, GELU, gather_mm): the forward's counts, dispatch of the token rows, combine of the
    # expert output; the backward's counts, dispatch of the output's gradient, combine of the input's,
    # and the two that Thunder's recomputation of the forward costs (the rows again, and the expert
    # output the routing weights' gradient reads). Dropless at P=2, a destination's block holds all
    # 64 rows a rank routes: [2, 64, 64] fp32, of which a rank sends one block, 16 KiB.
    block = 64 * 64 * 4
    assert sorted((s.phase, s.tensor, s.bytes) for s in planned) == sorted(
        [("forward", "counts", 16), ("forward", "dispatch", block), ("forward", "combine", block)] * 2
        + [("backward", "counts", 16)] * 2 + [("backward", "dispatch", block), ("backward", "combine", block)] * 4)
    assert sorted(sent) == sorted([(s.tensor, s.bytes) for s in planned] * mesh.size)  # (counts|dispatch|combine, bytes)
    # the analytical volume: 4 crossings per layer of the half of a rank's 64 rows that go to the other rank
    assert sum(s.bytes for s in planned) - 4 * 16 == 2 * 6 * block == 3 * (2 * 4 * 32 * 64 * 4)
    reduced = [s.tensor for s in tensor_steps("backward", program.backward) if s.kind == "allreduce"]
    assert "grad(gpt.h.0.moe.router.gate.weight)" in reduced, reduced  # dense weights: partial sums over ep
    assert not [t for t in reduced if "experts" in t], reduced  # an expert's gradient is whole on its rank: every rank's rows came to it
    text = program.as_text()
    assert "gpt.h.0.moe.experts, gpt.h.1.moe.experts: 4 experts, top-2: 2 experts per ep rank (rank r: experts 2r..2r+1)" in text
    assert "forward all-to-all bytes per rank per step: counts 32 B, dispatch 32.00 KiB, combine 32.00 KiB" in text, text
    assert "expert weights w_fc ep S(0), w_proj ep S(0)" in text, text
    # The same trace planned for (dp, ep) = (2, 2) (its batch of 4 as two dp ranks' 2): dp splits
    # each ep part of the batch again, the experts are whole over dp and only dp reduces their gradients.
    plan = driver.shard(program.source, "megatron", DeviceMesh.of_shape((2, 2), ("dp", "ep")))
    assert plan.parameters["gpt.h.0.moe.experts.w_fc"] == (Replicate(), Shard(0))
    idx = next(v.name for v in plan.forward.source.inputs if plan.forward.source.label(v.name) == "idx")
    assert plan.forward.sharding(idx) == (_StridedShard(0, split_factor=2), Shard(0))
    axes = {s.axis for s in tensor_steps("backward", plan.backward) if s.kind == "allreduce" and "experts" in s.tensor}
    assert axes == {"dp"}, axes


def routed_counts(model: WithLogits, idx: torch.Tensor) -> list[list[int]]:
    """Per layer, the rows each expert gets from the tokens of ``idx``, by the model's own routers
    in eager PyTorch (a forward hook on each ``Router``: its top-k expert index)."""
    seen = []
    hooks = [b.moe.router.register_forward_hook(lambda m, i, out: seen.append(out[1])) for b in model.gpt.h]
    try:
        with torch.no_grad():
            model(idx, idx)
    finally:
        for h in hooks:
            h.remove()
    return [torch.bincount(ix.reshape(-1), minlength=model.gpt.cfg.n_expert).tolist() for ix in seen]


def test_expert_load_of_a_batch_is_what_each_ranks_router_sends(ep2_step):
    """``nvtp.execute.expert_load.of_batch`` (what ``nvtp.plan`` / ``nvtp explain`` report) on the
    ep=2 program: each rank's tokens per expert equal the eager routers' counts on the half of the
    batch that rank holds, the whole batch's their sum, what each rank's experts receive the
    routed rows of its two experts from both ranks, the imbalance max / mean; at (dp, ep) = (2, 2),
    every dp rank passing the same 2 sequences, position (d, e) routes sequence e."""
    from nvtp.execute import expert_load

    model, (idx, targets), mesh, ranks, _, _ = ep2_step
    program = ranks[0].last
    load = expert_load.of_batch(program, model, (idx, targets), {})
    halves = [routed_counts(model, idx[2 * r:2 * r + 2]) for r in range(2)]  # [rank][layer][expert]
    assert [x.module for x in load] == ["gpt.h.0.moe.experts", "gpt.h.1.moe.experts"]
    for layer, x in enumerate(load):
        mine = [halves[r][layer] for r in range(2)]
        assert [list(c) for c in x.per_rank] == mine
        assert list(x.total) == [a + b for a, b in zip(*mine)] == routed_counts(model, idx)[layer]
        assert x.axis == "ep" and list(x.received) == [sum(x.total[0:2]), sum(x.total[2:4])]  # rank r holds experts 2r, 2r+1
        assert x.imbalance == pytest.approx(max(x.total) / (sum(x.total) / 4))
        assert sum(x.total) == idx.numel() * 2  # top-2: every token twice
    assert load[0].received[0] == 0 and load[0].received_imbalance == pytest.approx(2.0)  # layer 0's idle experts: rank 0 gets none
    text = "\n".join(line for x in load for line in x.lines())
    assert f"rank 0: routes {halves[0][1]}" in text and "on ep, each rank's experts receive rank 0 0, rank 1 128 rows (imbalance 2.00)" in text, text
    dpep = DeviceMesh.of_shape((2, 2), ("dp", "ep"))
    plan = driver.shard(program.source, "megatron", dpep)
    load = expert_load.of_batch(plan, model, (idx[:2], targets[:2]), {})  # one dp rank's batch of 2, as nvtp.jit takes it
    rows = [routed_counts(model, idx[e:e + 1]) for e in range(2)]
    for layer, x in enumerate(load):
        assert [list(c) for c in x.per_rank] == [rows[e][layer] for d in range(2) for e in range(2)]
        assert list(x.total) == [2 * (a + b) for a, b in zip(rows[0][layer], rows[1][layer])]


def test_capacity_factor_drops_the_rows_megatron_drops_and_shrinks_the_all_to_alls(ep2_step):
    """The ep=2 program planned again with capacity_factor=1.0 (no new trace): each dispatch and
    combine buffer is [P, E/P * ceil(c * rows / E), width] (half the dropless [P, rows, width]
    here), its bytes (P-1)/P of it; run (forward, simulated ranks) it equals an eager model that
    drops the same rows (``capped_experts``: layer 0 routes every token to experts 2 and 3, so
    each rank drops 16 of each one's 32 rows). Planned without the option, nothing is dropped."""
    model, batch, mesh, ranks, _, _ = ep2_step
    dropless = ranks[0].last
    factor, rows, experts, n = 1.0, 64, 4, 2  # each rank's routed rows: 2 sequences x 16 tokens x top-2
    capped = driver.shard(dropless.source, "megatron", mesh, axis_options={"capacity_factor": factor})
    assert capped.forward.options == {"capacity_factor": factor} and not dropless.forward.options
    block = experts // n * math.ceil(factor * rows / experts)
    assert block == 32
    steps = [s for s in capped.steps() if s.kind == "alltoall"]
    before = [s for s in dropless.steps() if s.kind == "alltoall"]
    assert [(s.phase, s.value, s.tensor) for s in steps] == [(s.phase, s.value, s.tensor) for s in before]
    assert len(steps) == 2 * (3 + 5)  # per layer: forward counts, dispatch, combine; backward counts, 2 dispatches, 2 combines
    for s, b in zip(steps, before):
        if s.tensor == "counts":
            assert s.shape == b.shape == (n, experts // n) and s.bytes == b.bytes == n * (experts // n) * 8 * (n - 1) // n
            continue
        assert s.shape == (n, block, b.shape[2]) and b.shape[:2] == (n, rows), (s, b)
        assert s.bytes == n * block * s.shape[2] * 4 * (n - 1) // n == b.bytes // 2
    f = capped.forward.source
    params = dict(model.named_parameters())
    inputs = [params[f.label(v.name)] if f.label(v.name) in params else dict(zip(("idx", "targets"), batch))[f.label(v.name)]
              for v in f.inputs]
    with torch.no_grad():
        outs, _ = spmd.run_simulated(capped.forward, inputs)
        ref, dropped = eager_capped(model, n, factor)
        logits, loss = ref(*batch)
    assert dropped == [2 * 32, dropped[1]] and dropped[1] > 0, dropped  # layer 0: each rank drops 32 rows (16 of each expert's 32)
    from nvtp.execute import expert_load

    load = expert_load.of_batch(capped, model, batch, {})  # the report's count of the drops: the eager reference's
    assert [sum(x.dropped) for x in load] == dropped and load[0].dropped == (32, 32) and load[0].received == (0, 64)
    user = [i for i, v in enumerate(f.outputs) if f.role(v.name) == "output"]
    for got in outs:
        got_logits, got_loss = (got[i] for i in user)
        assert relative_error(got_loss, loss)[0] <= 1e-5 and relative_error(got_logits, logits)[0] <= 1e-5
        assert relative_error(got_logits, eager(model)(*batch)[0].detach())[0] > 1e-2  # the drops show: not the dropless result


@pytest.mark.parametrize("value, words", [
    (0, "capacity_factor=0: give each expert's capacity as a multiple of an even share"),
    (-1.5, "capacity_factor=-1.5: give"),
    ("1.25", "capacity_factor='1.25': give"),
    (True, "capacity_factor=True: give"),
    (float("nan"), "capacity_factor=nan: give"),
    (float("inf"), "capacity_factor=inf: give"),
])
def test_a_bad_capacity_factor_is_refused_before_any_work(monkeypatch, value, words):
    """``nvtp.jit`` and ``nvtp.plan`` refuse a capacity factor that is not a finite number more than 0
    (``OptionError``, an ``InputError``), and one on a mesh without an ep axis, before anything is traced."""
    from nvtp.options import OptionError

    monkeypatch.setattr(driver, "trace", lambda *a, **k: pytest.fail("traced before refusing"))
    model, (idx, targets) = moe_gpt()
    mesh = DeviceMesh.of_shape((2,), ("ep",))
    for call in (lambda: nvtp.jit(model, plan="megatron", mesh=mesh, capacity_factor=value),
                 lambda: nvtp.plan(model, idx, targets, plan="megatron", mesh=mesh, capacity_factor=value)):
        with pytest.raises(OptionError) as e:
            call()
        assert words in str(e.value), str(e.value)
    with pytest.raises(OptionError) as e:
        nvtp.plan(model, idx, targets, plan="megatron", mesh=DeviceMesh.of_shape((2,), ("tp",)), capacity_factor=1.25)
    assert "capacity_factor=1.25 is an option of the 'ep' mesh axis" in str(e.value), str(e.value)


def test_the_report_says_why_the_expert_load_is_missing(ep2_step, monkeypatch):
    """``nvtp.plan``'s count of the example batch: meta arguments are not counted, and a forward that
    fails leaves the plan standing; both say why in the report (text and JSON), nothing silently missing."""
    from nvtp import explain
    from nvtp.execute import expert_load
    from nvtp.report import report_of

    model, (idx, targets), _, ranks, _, _ = ep2_step
    program = ranks[0].last
    report = report_of(program, "MoE GPT")
    explain._count_expert_load(report, program, model, (idx.to("meta"), targets.to("meta")), {})
    assert report.expert_load == [] and "not counted: the example arguments are on the meta device" in report.as_text()

    def broken(*args, **kwargs):
        raise RuntimeError("no such op")

    monkeypatch.setattr(expert_load, "of_batch", broken)
    report = report_of(program, "MoE GPT")
    explain._count_expert_load(report, program, model, (idx, targets), {})
    assert report.as_json()["expert_load_note"] == ("not counted: running the forward on the example batch failed "
                                                    "(RuntimeError: no such op)")


def _moe_fusion(experts: int, dense: bool = False):
    """A fusion of one routed matmul (rows [8, 4], ``experts`` experts [E, 4, 6]), or a dense linear."""
    b = FusionBuilder("moe" if not dense else "dense")
    x = b.define_tensor((8, 4), DType.Float)
    if dense:
        w = b.define_tensor((6, 4), DType.Float)
        b.add_output(b.op("linear", x, w))
    else:
        w = b.define_tensor((experts, 4, 6), DType.Float)
        index = b.define_tensor((8,), DType.Int)
        b.add_output(b.op("gather_mm", x, w, index))
    return driver.of_fusions(b.build())


def _gated_experts_fusion():
    """A gated expert MLP by hand (Mixtral's shape): rows [16, 4], gate|up [4 experts, 4, 2 x 6]
    sliced into its halves, silu(gate) * up, down [4, 6, 4]."""
    b = FusionBuilder("gated_experts")
    x = b.define_tensor((16, 4), DType.Float)
    w1 = b.define_tensor((4, 4, 12), DType.Float)
    w2 = b.define_tensor((4, 6, 4), DType.Float)
    index = b.define_tensor((16,), DType.Int)
    y = b.op("gather_mm", x, w1, index)
    gate = b.op("slice", y, start_indices=[0, 0], end_indices=[16, 6], strides=[1, 1])
    up = b.op("slice", y, start_indices=[0, 6], end_indices=[16, 12], strides=[1, 1])
    b.add_output(b.op("gather_mm", b.op("mul", b.op("silu", gate), up), w2, index))
    return driver.of_fusions(b.build())


@pytest.mark.parametrize("factor", [None, 1.0])
def test_a_gated_expert_mlp_keeps_its_rows_on_the_experts_ranks_between_its_matmuls(factor):
    """ep=2, simulated ranks: the rows are dispatched once before the gate|up matmul, stay on their
    experts' ranks through the slices, silu and product (run there in runs of a rank's rows) and the
    down matmul, and are combined once: counts, dispatch and combine, each [2, block, 4], the bytes
    the run sends; the result equals each row times its experts' weights in eager PyTorch (with
    capacity_factor=1.0: each expert keeps the first ceil(8 / 4) = 2 of a rank's 8 rows, the
    others give zero)."""
    traced = _gated_experts_fusion()
    mesh = DeviceMesh.of_shape((2,), ("ep",))
    plan = driver.shard(traced, "replicate", mesh, axis_options={} if factor is None else {"capacity_factor": factor})
    block = 8 if factor is None else 2 * 2  # a destination's rows: all a rank's 8, or its 2 experts' 2 slots
    planned = [(s.tensor, s.shape, s.bytes) for s in plan.steps() if s.kind == "alltoall"]
    assert planned == [("counts", (2, 2), 16), ("dispatch", (2, block, 4), block * 16), ("combine", (2, block, 4), block * 16)]
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(16, 4, generator=g), torch.randn(4, 4, 12, generator=g), torch.randn(4, 6, 4, generator=g)
    index = torch.tensor([3, 3, 2, 3, 0, 3, 2, 2, 3, 2, 3, 3, 2, 1, 3, 2])
    with ep_run.recording() as sent:
        outs, _ = spmd.run_simulated(plan.forward, [x, w1, w2, index])
    assert sorted(sent) == sorted([(t, b) for t, _, b in planned] * 2)
    y = torch.bmm(x[:, None], w1[index])[:, 0]
    want = torch.bmm((F.silu(y[:, :6]) * y[:, 6:])[:, None], w2[index])[:, 0]
    if factor is not None:  # Megatron's "position" policy, per rank: an expert's rows past its first 2 give zero
        keep = torch.tensor([list(index[r * 8:s + 1]).count(index[s]) <= 2 for r in range(2) for s in range(r * 8, r * 8 + 8)])
        assert int((~keep).sum()) == 6
        want = want * keep[:, None]
    assert relative_error(torch.cat([o[0] for o in outs]), want)[0] <= 1e-5


@pytest.mark.parametrize("experts, ep, words", [
    (3, 2, "3 experts, which the ep axis of size 2 cannot split evenly; use an ep size that divides 3"),
    (4, 8, "the ep axis has 8 ranks and the MoE layer of"),
    (4, 0, "has no MoE layer (no gather_mm"),
])
def test_an_ep_axis_nvtp_cannot_shard_is_refused_before_any_work(experts, ep, words):
    """More ep ranks than experts, experts ep does not divide, an ep axis on a dense model: one
    ``ShardingError`` (a ``ValueError``) naming what to change, raised before any pass runs."""
    traced = _moe_fusion(experts, dense=ep == 0)
    mesh = DeviceMesh.of_shape((ep or 2,), ("ep",))
    with pytest.raises(ExpertError) as e:
        driver.shard(traced, "replicate", mesh)
    assert words in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError)


# -- slow tier: gloo processes, (ep, tp), the CLI ----------------------------------------------------


def _mixtral():
    """transformers' Mixtral from a tiny config (hidden 64, 4 experts, top-2, 2 layers, vocabulary
    256; its own experts implementation, the load-balancing loss on) and a batch of 4 x 8 tokens."""
    from tests.test_moe import build

    model = build("mixtral", output_router_logits=True)
    return model, torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))


def _gloo_worker(rank, world, init_method, out, shape, names, capacity_factor=None, family="moe_gpt"):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if family == "moe_gpt":
        model, batch = moe_gpt()
    else:
        model, ids = _mixtral()
        batch = (ids,)
    if "dp" in names:  # each dp rank its half of the batch; the ranks of an ep group pass the same
        d = mesh.get_local_rank("dp")
        batch = tuple(t[2 * d:2 * d + 2] for t in batch)
    sharded = nvtp.jit(model, plan="megatron", mesh=mesh, capacity_factor=capacity_factor)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    losses = []
    with ep_run.recording() as sent:
        for step in range(3):
            if step == 1:  # the first call also runs nvtp.jit's first-call check (nvtp.guard): count the steps after it
                sent.clear()
            loss = sharded(*batch)[1] if family == "moe_gpt" else sharded(*batch, labels=batch[0]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    planned = [(s.tensor, s.bytes) for s in sharded.last.steps() if s.kind == "alltoall"] * 2
    whole = {n: p.full_tensor().detach().clone() for n, p in sharded.module.named_parameters()}
    placements = {n: [str(q) for q in p.placements] for n, p in sharded.module.named_parameters()}
    if rank == 0:
        torch.save({"losses": losses, "params": whole, "placements": placements, "sent": sent, "planned": planned}, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _trains_like_one_process(tmp_path, shape, names, factor=None, family="moe_gpt") -> dict:
    """``_gloo_worker`` on prod(shape) gloo processes, 3 SGD steps, against the model in eager
    PyTorch on the whole batch: every loss and final weight within 1e-5; the all-to-alls rank 0
    sent in steps 2 and 3 are its Program's steps, byte for byte. Returns what rank 0 saved."""
    out = tmp_path / "got.pt"
    world = math.prod(shape)
    assert spawn(_gloo_worker, world, str(out), shape, names, factor, family) == [0] * world
    got = torch.load(out)
    if family == "moe_gpt":
        model, batch = moe_gpt()
        ref = eager(model) if factor is None else eager_capped(model, world, factor)[0]  # every rank routes its own rows
        loss_of = lambda m: m(*batch)[1]  # noqa: E731
    else:
        ref, ids = _mixtral()
        loss_of = lambda m: m(ids, labels=ids).loss  # noqa: E731
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        loss = loss_of(ref)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(got["losses"][step] - loss.item()) <= 1e-5 * abs(loss.item()), (got["losses"], step, loss.item())
    for name, p in ref.named_parameters():
        assert relative_error(got["params"][name], p.detach())[0] <= 1e-5, name
    assert sorted(got["sent"]) == sorted(got["planned"]) and got["sent"]
    return got


@pytest.mark.slow
@pytest.mark.parametrize("shape, names, factor", [((2,), ("ep",), None), ((2, 2), ("dp", "ep"), None), ((2,), ("ep",), 1.0),
                                                  ((2, 2), ("dp", "ep"), 1.0), ((4,), ("ep",), None), ((2, 2), ("ep", "tp"), None)],
                         ids=["ep2", "dp2xep2", "ep2-capacity1", "dp2xep2-capacity1", "ep4", "ep2xtp2"])
def test_moe_gpt_trains_on_gloo_processes_like_one_process(tmp_path, shape, names, factor):
    """2 gloo processes at ep=2, 4 at ep=4, (dp, ep) = (2, 2) and (ep, tp) = (2, 2)
    (all_to_all_single on gloo): 3 SGD steps, every loss and final weight as eager's on the whole
    batch; the experts split over ep (whole over dp, split inside over tp); the all-to-alls rank 0
    sent in steps 2 and 3 are its Program's steps, byte for byte. With capacity_factor=1.0, as an
    eager model that drops the same rows (``capped_experts``: each of the dp x ep ranks routes one
    sequence of the batch and drops past its own capacity)."""
    got = _trains_like_one_process(tmp_path, shape, names, factor)
    want = {("ep",): ["S(0)"], ("dp", "ep"): ["R", "S(0)"], ("ep", "tp"): ["S(0)", "S(2)"]}[names]
    assert got["placements"]["gpt.h.0.moe.experts.w_fc"] == want


@pytest.mark.slow
@pytest.mark.parametrize("shape, names", [((4,), ("ep",)), ((2, 2), ("dp", "ep")), ((2, 2), ("ep", "tp"))],
                         ids=["ep4", "dp2xep2", "ep2xtp2"])
def test_mixtral_trains_on_4_gloo_processes_like_one_process(tmp_path, shape, names):
    """Issue 35, item 4: transformers' Mixtral (tiny config, its own experts implementation, the
    load-balancing loss) on 4 gloo processes at ep=4, (dp, ep) = (2, 2) and (ep, tp) = (2, 2): 3 SGD
    steps, every loss and final weight within 1e-5 of eager Mixtral on one process; the experts
    split along their expert axis over ep; the all-to-alls sent are the Program's steps."""
    pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")
    got = _trains_like_one_process(tmp_path, shape, names, family="mixtral")
    experts = [n for n in got["placements"] if "experts" in n]
    assert experts and all("S(0)" in got["placements"][n][names.index("ep")] for n in experts), got["placements"]


@pytest.mark.slow
def test_moe_gpt_at_ep2_tp2_matches_eager():
    """(ep, tp) = (2, 2), simulated: each expert split along its experts over ep and inside its ffn
    over tp (w_fc column-, w_proj row-parallel), the row-parallel partial sums reduced over tp."""
    model, batch = moe_gpt()
    ranks, _, _ = check_one_step(model, batch, DeviceMesh.of_shape((2, 2), ("ep", "tp")))
    assert ranks[0].placement("gpt.h.0.moe.experts.w_fc") == (Shard(0), Shard(2))
    assert ranks[0].placement("gpt.h.0.moe.experts.w_proj") == (Shard(0), Shard(1))


@pytest.mark.slow
def test_nvtp_explain_with_an_ep_axis_prints_experts_per_rank_and_all_to_all_bytes():
    """The CLI as typed: ``nvtp explain --module nvtp.models.moe:tiny --plan megatron --mesh ep=2``:
    the experts per rank, the all-to-all bytes, and the example batch's tokens per expert per rank
    (the counts of the model's routers in eager PyTorch on each rank's sequence); and on a dense
    model the refusal, one line and a non-zero exit."""
    run = subprocess.run([sys.executable, "-m", "nvtp", "explain", "--module", "nvtp.models.moe:tiny", "--plan", "megatron", "--mesh", "ep=2"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "h.0.moe.experts, h.1.moe.experts: 4 experts, top-2: 2 experts per ep rank (rank r: experts 2r..2r+1)" in run.stdout
    assert "forward all-to-all bytes per rank per step: counts 32 B, dispatch 16.00 KiB, combine 16.00 KiB" in run.stdout
    capped = subprocess.run([sys.executable, "-m", "nvtp", "explain", "--module", "nvtp.models.moe:tiny", "--plan", "megatron", "--mesh",
                             "ep=2", "--capacity-factor", "1"], capture_output=True, text=True, timeout=900)
    assert capped.returncode == 0, capped.stderr[-3000:]
    assert "capacity factor 1: each expert takes at most ceil(1 x a rank's routed rows / experts)" in capped.stdout, capped.stdout
    assert "forward all-to-all bytes per rank per step: counts 32 B, dispatch 8.00 KiB, combine 8.00 KiB" in capped.stdout
    assert "    dropped past the experts' capacity: rank 0 " in capped.stdout, capped.stdout
    bad = subprocess.run([sys.executable, "-m", "nvtp", "explain", "--module", "nvtp.models.moe:tiny", "--plan", "megatron", "--mesh",
                          "ep=2", "--capacity-factor", "0"], capture_output=True, text=True, timeout=900)
    assert bad.returncode == 3 and "capacity_factor=0.0: give each expert's capacity" in bad.stderr and "Traceback" not in bad.stderr
    assert "expert weights w_fc ep S(0), w_proj ep S(0)" in run.stdout, run.stdout
    gpt, (idx, _) = moe.tiny()  # the factory's model and batch: rank r routes sequence r
    ranks = [routed_counts(WithLogits(gpt), idx[r:r + 1]) for r in range(2)]
    whole = routed_counts(WithLogits(gpt), idx)
    assert "expert load of the example batch (tokens routed to each expert; imbalance = max / mean):" in run.stdout, run.stdout
    for layer in range(2):
        got = [ranks[r][layer] for r in range(2)]
        assert f"  h.{layer}.moe.experts: 4 experts, top-2: whole batch {whole[layer]} (imbalance " in run.stdout, run.stdout
        for r in range(2):
            assert f"    rank {r}: routes {got[r]} (imbalance {max(got[r]) / (sum(got[r]) / 4):.2f})" in run.stdout, run.stdout
        received = [sum(whole[layer][0:2]), sum(whole[layer][2:4])]
        assert (f"    on ep, each rank's experts receive rank 0 {received[0]}, rank 1 {received[1]} rows "
                f"(imbalance {max(received) / (sum(received) / 2):.2f})") in run.stdout, run.stdout
    dense = subprocess.run([sys.executable, "-m", "nvtp", "explain", "--module", "tests.test_explain:tiny_gpt_model", "--plan", "megatron", "--mesh", "ep=2"],
                           capture_output=True, text=True, timeout=900)
    assert dense.returncode != 0 and "has no MoE layer" in dense.stderr and "Traceback" not in dense.stderr, dense.stderr


@pytest.mark.slow
def test_nvtp_plan_reports_the_expert_load_of_each_dp_ranks_batch():
    """``nvtp.plan`` (the Python API) at (dp, ep) = (2, 2) on one dp rank's batch of 2 sequences,
    as nvtp.jit takes it: the JSON's tokens per expert per rank are the eager routers' counts of
    the sequence each rank routes (position (d, e): sequence e, every dp rank passing the batch)."""
    model, (idx, targets) = moe_gpt(batch=2)
    report = nvtp.plan(model, idx, targets, plan="megatron", mesh=DeviceMesh.of_shape((2, 2), ("dp", "ep")))
    got = report.as_json()
    assert got["expert_load_note"] == "every data-parallel rank passing the example arguments"
    seq = [routed_counts(model, idx[e:e + 1]) for e in range(2)]
    for layer, x in enumerate(got["expert_load"]):
        assert x["per_rank"] == [seq[e][layer] for d in range(2) for e in range(2)], x
        assert x["per_rank_imbalance"] == [max(c) / (sum(c) / 4) for c in x["per_rank"]]
        assert x["axis"] == "ep" and x["received"][0] == sum(x["per_rank"][0][0:2]) + sum(x["per_rank"][1][0:2])
    assert "expert load of the example batch" in report.as_text()


@pytest.mark.slow
def test_moe_gpt_with_a_capacity_factor_steps_like_an_eager_model_dropping_the_same_rows():
    """nvtp.jit(..., capacity_factor=1.0) at ep=2 on simulated ranks, one forward and backward:
    logits, loss and every gradient within 1e-5 of ``capped_experts``' eager model (layer 0 drops
    half its rows); the first-call check is skipped, saying why; the all-to-alls sent are the
    Program's (capped) steps."""
    model, batch = moe_gpt()
    mesh = DeviceMesh.of_shape((2,), ("ep",))
    threads = spmd.ThreadMesh(mesh, timeout=300)
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=mesh, comm=threads.comm(r), capacity_factor=1.0) for r in range(2)]
    ranks[0].compile(*batch)
    for m in ranks[1:]:
        m.share_compiled(ranks[0])

    def step(m):
        logits, loss = m(*batch)
        loss.backward()
        return logits.detach(), loss.detach()

    with pytest.warns(UserWarning, match="capacity_factor=1.0: the ep axis drops each expert's rows past its capacity"):
        with ep_run.recording() as sent:
            outs = spmd.on_threads(lambda r: step(ranks[r]), threads)
    ref, dropped = eager_capped(model, 2, 1.0)
    logits, loss = ref(*batch)
    loss.backward()
    assert dropped[0] == 64
    for got_logits, got_loss in outs:
        assert relative_error(got_loss, loss.detach())[0] <= 1e-5 and relative_error(got_logits, logits.detach())[0] <= 1e-5
    for name, p in ref.named_parameters():
        got = spmd.assemble([dict(m.module.named_parameters())[name].grad for m in ranks], ranks[0].placement(name), p.shape, mesh)
        assert relative_error(got, p.grad)[0] <= 1e-5, name
    planned = [(s.tensor, s.bytes) for s in ranks[0].last.steps() if s.kind == "alltoall"]
    assert sorted(sent) == sorted(planned * 2)


def _deepseek_v3(implementation: str | None = None) -> tuple[torch.nn.Module, torch.Tensor]:
    """transformers' DeepSeek-V3 from a tiny config (hidden 64, multi-head latent attention with
    q_lora_rank 32, kv_lora_rank 16; every layer MoE: 4 routed experts in 2 groups, top-2 from the
    best group, one shared expert; sigmoid scores, routed scaling 2.5), its router's
    ``e_score_correction_bias`` set to distinct values (zeros by default, which would not test it),
    fp32, and a batch of 4 x 8 tokens. ``implementation``: the experts implementation (None:
    transformers' default)."""
    t = pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")
    cfg = t.DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                             num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16,
                             q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, vocab_size=256,
                             max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = t.DeepseekV3ForCausalLM._from_config(cfg, **({"experts_implementation": implementation} if implementation else {}))
    for layer in model.model.layers:
        layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.05, -0.02, 0.03, -0.04]))
    return model, torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))


# What each family's tiny build turns on beside tests/test_moe.py's common sizes (4 experts, top-2,
# hidden 64, 2 layers): the load-balancing loss (``output_router_logits``) everywhere it exists, and
# Qwen3-MoE's renormalised top-k weights (``norm_topk_prob``, off by default, which would not test it).
HF_MOE_EXTRA = {
    "qwen2_moe": {"output_router_logits": True},  # a shared expert behind a sigmoid gate, softmax top-k unnormalised
    "qwen3_moe": {"output_router_logits": True, "norm_topk_prob": True},
    "olmoe": {"output_router_logits": True},  # no shared expert
    "gpt_oss": {"output_router_logits": True},  # expert biases, clamped interleaved gate, attention sinks
}


def _hf_moe(family: str, implementation: str | None = None) -> tuple[torch.nn.Module, torch.Tensor]:
    """transformers' ``family`` from a tiny config (``_deepseek_v3``, or ``tests/test_moe.py: build``
    with ``HF_MOE_EXTRA``), fp32, and the same batch of 4 x 8 tokens."""
    if family == "deepseek_v3":
        return _deepseek_v3(implementation)
    pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")
    from tests.test_moe import build

    model = build(family, implementation, **HF_MOE_EXTRA[family])
    return model, torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1))


def test_the_tiny_moe_builds_carry_what_the_gloo_tests_name():
    """What ``test_hf_moe_trains_with_adamw_on_gloo_processes_like_one_process`` claims to cover is in
    the models it builds (``_hf_moe``, eager, no trace: seconds): Qwen3-MoE's routing weights are
    renormalised (each token's sum 1), Qwen2-MoE's are not and its shared expert has a gate, OLMoE has
    no shared expert, DeepSeek-V3's correction bias is not zero, gpt-oss's experts have biases; all but
    DeepSeek-V3 add the load-balancing loss; a token routes to 2 of 4 experts."""
    pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")
    from nvtp.frontend.moe import is_transformers_experts

    for family in ("deepseek_v3", *HF_MOE_EXTRA):
        model, ids = _hf_moe(family, "eager")
        experts = [m for m in model.modules() if is_transformers_experts(m)]
        seen = []
        hooks = [m.register_forward_hook(lambda m, i, o: seen.append(i[1:3])) for m in experts]
        with torch.no_grad():
            out = model(ids, labels=ids)
        for h in hooks:
            h.remove()
        assert len(experts) == 2 and experts[0].num_experts == 4 and all(ix.shape == (32, 2) for ix, _ in seen), family
        sums = torch.cat([w.sum(-1) for _, w in seen])
        mlp = model.model.layers[0].mlp
        assert (out.aux_loss is not None) == (family != "deepseek_v3"), family
        if family == "qwen3_moe":
            assert torch.allclose(sums, torch.ones_like(sums)), sums
        if family == "qwen2_moe":
            assert not torch.allclose(sums, torch.ones_like(sums)) and hasattr(mlp, "shared_expert_gate")
        if family == "olmoe":
            assert not [n for n, _ in mlp.named_children() if "shared" in n]
        if family == "deepseek_v3":
            assert mlp.gate.e_score_correction_bias.abs().min() > 0 and hasattr(mlp, "shared_experts")
        if family == "gpt_oss":
            assert experts[0].gate_up_proj_bias.shape == (4, 64) and hasattr(model.model.layers[0].self_attn, "sinks")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _adamw_worker(rank, world, init_method, out, shape, names, family="deepseek_v3", fsdp=False):
    """``family`` (``_hf_moe``) through nvtp.jit on the gloo mesh ``shape``/``names`` (FSDP with
    ``fsdp``), 3 AdamW steps; rank 0 saves each step's loss and whole gradients, the final whole
    weights, the placements, and the all-to-alls it sent in steps 2 and 3 beside its Program's steps."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model, ids = _hf_moe(family)
    if "dp" in names:  # each dp rank its half of the batch; the ranks of an ep group pass the same
        d = mesh.get_local_rank("dp")
        ids = ids[2 * d:2 * d + 2]
    sharded = nvtp.jit(model, plan="megatron", mesh=mesh, fsdp=fsdp)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    losses, grads = [], []
    with ep_run.recording() as sent:
        for step in range(3):
            if step == 1:  # the first call also runs nvtp.jit's first-call check (nvtp.guard)
                sent.clear()
            loss = sharded(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            grads.append({n: _full(p.grad) for n, p in sharded.module.named_parameters()})
            opt.step()
            losses.append(loss.item())
    planned = [(s.tensor, s.bytes) for s in sharded.last.steps() if s.kind == "alltoall"] * 2
    whole = {n: _full(p) for n, p in sharded.module.named_parameters()}
    placements = {n: [str(q) for q in p.placements] for n, p in sharded.module.named_parameters()}
    if rank == 0:
        torch.save({"losses": losses, "grads": grads, "params": whole, "placements": placements, "sent": sent,
                    "planned": planned}, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# (family, mesh shape, axis names, fsdp): every family on ep=2, (ep, tp) = (2, 2) and (dp, ep) = (2, 2);
# DeepSeek-V3 also at ep=4 and with FSDP at (dp, ep) = (2, 2).
HF_MESHES = {"ep2": ((2,), ("ep",), False), "ep2xtp2": ((2, 2), ("ep", "tp"), False), "dp2xep2": ((2, 2), ("dp", "ep"), False)}
HF_RUNS = ([(f, m) for f in ("deepseek_v3", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss") for m in HF_MESHES]
           + [("deepseek_v3", "ep4"), ("deepseek_v3", "dp2xep2-fsdp")])
HF_MESHES |= {"ep4": ((4,), ("ep",), False), "dp2xep2-fsdp": ((2, 2), ("dp", "ep"), True)}


@pytest.mark.slow
@pytest.mark.parametrize("family, mesh", HF_RUNS, ids=[f"{f}-{m}" for f, m in HF_RUNS])
def test_hf_moe_trains_with_adamw_on_gloo_processes_like_one_process(tmp_path, family, mesh):
    """transformers' MoE families (``_hf_moe``) through nvtp.jit on gloo processes, 3 AdamW steps,
    against the same model in eager PyTorch on one process with transformers' "eager" experts (a
    loop over the experts). Each step, eager runs at nvtp's weights of that step (AdamW on one
    process, stepped with nvtp's gradients): the loss and every gradient within 1e-5 relative; nvtp's
    final weights are those (within 1e-6: the sharded optimizer step is AdamW's), and every loss is
    within 1e-5 of eager trained on its own. The routed experts' weights split along their expert
    axis over ep (with FSDP, along their dimension 1 over dp); the all-to-alls rank 0 sent in steps 2
    and 3 are its Program's steps, byte for byte.

    Why eager at nvtp's weights rather than eager's own weights: AdamW divides each gradient element
    by its own magnitude, so an element of ~1e-8 that rounds differently moves its weight by a
    visible part of the learning rate, and the two runs' later gradients drift apart by that, not by
    what nvtp computes. Measured (2026-11-27, Qwen2-MoE at (ep, tp) = (2, 2)): at nvtp's weights
    every gradient of every step within 1.8e-06 of eager's; against eager's own 3 steps the final
    ``k_proj.bias`` (zero at init, its gradient non-zero only through the rotary embedding, elements
    down to ~1e-8) differs by 1.0e-04 and step 3's ``experts.down_proj`` gradient by 1.02e-05, where
    transformers' own "eager" and default experts implementations leave that bias 1.4e-04 apart.

    DeepSeek-V3: sigmoid router scores plus ``e_score_correction_bias``, group-limited top-k, routed
    scaling, a shared expert, multi-head latent attention. Qwen2-MoE: a shared expert behind a
    sigmoid gate. Qwen3-MoE: ``norm_topk_prob``. OLMoE: no shared expert. gpt-oss: expert biases
    (whole over ep: an indexing op of each row's expert reads them), a clamped interleaved gate,
    attention sinks. At (dp, ep) each dp rank passes its 2 of the 4 sequences; all but DeepSeek-V3
    carry the load-balancing loss."""
    shape, names, fsdp = HF_MESHES[mesh]
    out = tmp_path / "got.pt"
    world = math.prod(shape)
    assert spawn(_adamw_worker, world, str(out), shape, names, family, fsdp) == [0] * world
    _check_adamw_run(family, torch.load(out), names, fsdp)


def _check_adamw_run(family: str, got: dict, names: tuple[str, ...], fsdp: bool) -> None:
    """The test above's checks of what ``_adamw_worker``'s rank 0 saved."""
    forced, ids = _hf_moe(family, "eager")  # at nvtp's weights: stepped with nvtp's gradients
    free, _ = _hf_moe(family, "eager")  # trained on its own
    opt_forced = torch.optim.AdamW(forced.parameters(), lr=1e-3)
    opt_free = torch.optim.AdamW(free.parameters(), lr=1e-3)
    for step in range(3):
        loss = forced(ids, labels=ids).loss
        opt_forced.zero_grad()
        loss.backward()
        assert abs(got["losses"][step] - loss.item()) <= 1e-5 * abs(loss.item()), (got["losses"], step, loss.item())
        for name, p in forced.named_parameters():
            assert relative_error(got["grads"][step][name], p.grad)[0] <= 1e-5, (step, name)
            p.grad = got["grads"][step][name].clone()
        opt_forced.step()
        own = free(ids, labels=ids).loss
        opt_free.zero_grad()
        own.backward()
        opt_free.step()
        assert abs(got["losses"][step] - own.item()) <= 1e-5 * abs(own.item()), (got["losses"], step, own.item())
    for name, p in forced.named_parameters():
        assert relative_error(got["params"][name], p.detach())[0] <= 1e-6, name
    experts = [n for n in got["placements"] if ".mlp.experts." in n and not n.endswith("_bias")]
    want = ["S(1)", "S(0)"] if fsdp else "S(0)"
    assert experts and all((got["placements"][n] if fsdp else got["placements"][n][names.index("ep")]) == want for n in experts), \
        got["placements"]
    assert sorted(got["sent"]) == sorted(got["planned"]) and got["sent"]


@pytest.mark.slow
def test_nvtp_explain_of_deepseek_v3_at_ep2_as_typed(tmp_path):
    """``nvtp explain --module mine:make --plan megatron --mesh ep=2`` typed in the directory of the
    user's factory (``_deepseek_v3`` on 2 of its sequences, with labels): exit 0; the ep axis, the
    routed experts ``S(0)`` over it, 2 experts per rank; each all-to-all in the communications and its
    bytes (a rank's 16 routed rows, [2, 16, 64] fp32 buffers of which a rank sends one block of 4 KiB;
    per layer forward one dispatch and one combine, backward two of each, one counts exchange
    [2, 2] int64 each way); the example batch's tokens per expert per rank, which are the counts
    of eager DeepSeek-V3's own router on each rank's sequence."""
    from tests.test_cli import run
    from tests.test_moe import routed

    (tmp_path / "nvtp_ds3_factory.py").write_text(
        "from tests.test_ep import _deepseek_v3\n\n\ndef make():\n    model, ids = _deepseek_v3()\n"
        "    return model, (ids[:2],), {'labels': ids[:2]}\n")
    proc = run(["nvtp", "explain", "--module", "nvtp_ds3_factory:make", "--plan", "megatron", "--mesh", "ep=2"], cwd=tmp_path, timeout=900)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("DeepseekV3ForCausalLM: experts split over ep") and "(ep 2; 2 devices)" in out.splitlines()[0], out
    for w in ("gate_up_proj", "down_proj"):
        assert re.search(rf"model\.layers\.\{{0\.\.1\}}\.mlp\.experts\.{w}\s+S\(0\)\n", out), out
    assert "expert weights gate_up_proj ep S(0), down_proj ep S(0)" in out, out
    assert "model.layers.0.mlp.experts, model.layers.1.mlp.experts: 4 experts, top-2: 2 experts per ep rank (rank r: experts 2r..2r+1)" in out
    block = 16 * 64 * 4  # a rank's 8 tokens x top-2 rows, hidden 64, fp32: the block of [2, 16, 64] a rank sends
    assert re.search(rf"forward\s+model\s+on ep\s+4 x alltoall\s+Float\[2, 16, 64\]\s+{4 * block // 1024}\.00 KiB", out), out
    assert re.search(rf"backward\s+model\s+on ep\s+8 x alltoall\s+Float\[2, 16, 64\]\s+{8 * block // 1024}\.00 KiB", out), out
    assert re.search(r"forward\s+model\s+on ep\s+2 x alltoall\s+int64\[2, 2\]\s+32 B", out), out
    assert "forward all-to-all bytes per rank per step: counts 32 B, dispatch 8.00 KiB, combine 8.00 KiB" in out, out
    assert "backward all-to-all bytes per rank per step: counts 32 B, dispatch 16.00 KiB, combine 16.00 KiB" in out, out
    model, ids = _deepseek_v3("eager")
    ranks = [[c.tolist() for c in routed(model, ids[r:r + 1], labels=ids[r:r + 1])] for r in range(2)]
    for layer in range(2):
        whole = [a + b for a, b in zip(ranks[0][layer], ranks[1][layer])]
        assert f"  model.layers.{layer}.mlp.experts: 4 experts, top-2: whole batch {whole} (imbalance {max(whole) / 8:.2f})" in out, out
        for r in range(2):
            got = ranks[r][layer]
            assert f"    rank {r}: routes {got} (imbalance {max(got) / 4:.2f})" in out, out
        received = [sum(whole[0:2]), sum(whole[2:4])]
        assert (f"    on ep, each rank's experts receive rank 0 {received[0]}, rank 1 {received[1]} rows "
                f"(imbalance {max(received) / 16:.2f})") in out, out

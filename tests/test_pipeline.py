"""Pipeline parallelism (issue 26): a (pp, dp, tp) mesh laid out as Megatron lays it out.

* ``nvtp.jit(model, mesh=init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp",
  "tp")), microbatches=M)`` trains like one process on the whole batch, computed here
  independently by eager PyTorch: every step's loss within 1e-5 relative, final weights within
  1e-4 (gloo processes; pp=2 in the default tier, the other shapes slow).
* what a run sends point-to-point equals the plan's ``p2p()``, transfer for transfer, bytes too.
* a weight tied across the first and last stage stays tied: the last stage's replica equals the
  holder's weight in every step that reads it (refreshed at the step's start), and trains as eager.
* the rank layout and groups are Megatron's (its docstring's 16-GPU example, by hand).
* bad input is refused before anything is traced, naming the numbers and the fix.
"""

from __future__ import annotations

import math


import pytest
import torch

import nvtp
from nvtp.dtensor import local
from nvtp.execute.launch import spawn
from nvtp.models import gpt
from nvtp.pipeline import schedule as sched
from nvtp.sharding.axes.pp import Layout
from tests.complex_rotary import ComplexRotaryLM, Config
from tests import workers

STEPS = 3


def _model(layers: int = 4, tied: bool = False, family: str = "gpt") -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        return _RotaryLoss(Config(layers=layers))
    model = gpt.GPT(gpt.config("tiny", n_layer=layers, batch=4))
    if tied:
        model.lm_head.weight = model.wte.weight
    return model


def _batches(global_batch: int, layers: int = 4, family: str = "gpt"):
    if family == "llama":
        g = torch.Generator().manual_seed(0)
        return [(torch.randint(0, 128, (global_batch, 16), generator=g), torch.randint(0, 128, (global_batch, 16), generator=g))
                for _ in range(STEPS)]
    cfg = gpt.config("tiny", n_layer=layers, batch=global_batch)
    return [gpt.example_tokens(cfg, seed=s) for s in range(STEPS)]


class _RotaryLoss(ComplexRotaryLM):
    """The Llama-style model (complex rotary, RMSNorm, SwiGLU, GQA) returning its loss alone, as a
    pipeline trains; a subclass, so the parameters keep the model's own names."""

    def forward(self, tokens, targets):
        logits = super().forward(tokens)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _optimizer(params):
    # SGD with momentum, not Adam: Adam's first step moves every weight by +-lr whatever its
    # gradient's size, so a gradient of 1e-9 rounding noise flips a step; SGD's error is the gradient's.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(model, batches, dp: int, dp_rank: int):
    opt = _optimizer(model.parameters())
    losses, norms = [], []
    for idx, targets in batches:
        n = idx.shape[0] // dp
        loss = model(idx[dp_rank * n:(dp_rank + 1) * n], targets[dp_rank * n:(dp_rank + 1) * n])
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        losses.append(loss.item())
    return losses, norms


def _eager(layers: int, tied: bool, global_batch: int, family: str = "gpt"):
    model = _model(layers, tied, family)
    losses, norms = _train(model, _batches(global_batch, layers, family), 1, 0)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _worker(rank, world, init_method, out, shape, microbatches, schedule, layers, tied, global_batch, plan, family,
            compile="kernels", aten=False):
    from torch.distributed.device_mesh import init_device_mesh

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    calls = _count_compiled_calls(aten) if compile == "inductor" else None
    names = tuple(n for n, k in zip(("pp", "dp", "tp"), shape) if k > 1 or n == "pp")
    sizes = tuple(k for n, k in zip(("pp", "dp", "tp"), shape) if n in names)
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    dp = shape[1]
    model = nvtp.jit(_model(layers, tied, family), plan=plan, mesh=mesh, microbatches=microbatches, schedule=schedule,
                     compile=compile)
    dp_rank = model.layout.coords(rank)[1]
    opt = _optimizer(model.module.parameters())
    losses, tie_gaps, sent, moved, norms = [], [], [], [], []
    for idx, targets in _batches(global_batch, layers, family):
        n = idx.shape[0] // dp
        loss = model(idx[dp_rank * n:(dp_rank + 1) * n], targets[dp_rank * n:(dp_rank + 1) * n])
        if tied:  # the holder's tied weight and the last stage's replica that this step read, on every rank
            whole = model.full_parameters()
            tie_gaps.append(float((whole["wte.weight"] - _tied_copy(model)).abs().max()))
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # torch's own, on the pipeline's parameters
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        losses.append(loss.item())
        sent.append(list(model.sent))
        moved.append(list(model.moved))
    whole = model.full_parameters()
    held = sum(local(p).numel() * p.element_size() for p in model.module.parameters())
    held += sum(r.numel() * r.element_size() for r in model._replicas.values())  # a weight an earlier stage holds, read here
    keys = sorted(model.state_dict()) == sorted(_model(layers, tied, family).state_dict())
    planned = [(s.kind, s.phase, s.tensor, int(s.dst.split()[1]) if s.kind in ("send", "reduce") else int(s.src.split()[1]), s.bytes)
               for s in model.program.steps(model.stage) if s.axis == "pp"]
    result = {"losses": losses, "norms": norms, "keys": keys, "params": whole, "sent": sent, "moved": moved, "planned_pp": planned, "p2p": model.program.p2p(), "stage": model.stage,
              "held": held, "planned_held": model.program.as_data()["stages"][model.stage]["parameter_bytes_per_rank"], "tie_gaps": tie_gaps, "blocks": [list(s.blocks) for s in model.program.stages]}
    if calls is not None:  # compile="inductor": this stage's pieces, what compiling them took, how often their code ran
        from nvtp.execute import reference

        result["compiled"] = {phase: reference.compiled_pieces(s.fusion) for phase, s in model.last.phases()}
        result["compile_s"], result["calls"] = model.last.seconds.get("compile"), list(calls)
    return workers.finish(result, out, world)


def _count_compiled_calls(aten: bool) -> list[int]:
    """Counts (one entry per compiled piece) the calls of the code ``inductor.compiler`` gives;
    ``aten``: the traced aten graph stands in for Inductor's C++ (as tests/test_inductor.py's tier)."""
    from nvtp.execute import inductor

    calls: list[int] = []
    make = inductor.compiler

    def compile_(graph, inputs):
        code = (lambda xs: graph(*xs)) if aten else make(graph, inputs)
        k = len(calls)
        calls.append(0)

        def run(xs):  # called as Inductor's code is: with a list of the inputs
            calls[k] += 1
            return code(xs)

        return run

    inductor.compiler = compile_
    return calls


def _tied_copy(model) -> torch.Tensor:
    """The last stage's copy of the tied weight (its replica of wte.weight, read as lm_head.weight), whole, on every rank."""
    import torch.distributed as dist

    lay = model.layout
    last = lay.pp - 1
    program = model.program.programs[last]
    whole = torch.empty(model._shapes["wte.weight"])
    if model.stage == last:
        p = model._replicas["wte.weight"]
        placement = program.parameters["lm_head.weight"]
        if lay.dp * lay.tp > 1:
            from nvtp.execute import spmd
            from nvtp.sharding.placements import local_shape

            parts = [torch.empty(local_shape(whole.shape, placement if isinstance(placement, tuple) else (placement,), program.mesh)) for _ in range(lay.dp * lay.tp)]
            dist.all_gather(parts, p.detach().contiguous(), group=model._groups["stage"])
            whole = spmd.assemble(parts, placement, whole.shape, program.mesh)
        else:
            whole = p.detach().clone()
    dist.broadcast(whole, lay.rank(last, model.dp_index, model.tp_index), group=model._groups["pipeline"])
    return whole


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _check(tmp_path, shape, microbatches=2, schedule="1f1b", layers=4, tied=False, plan="megatron", family="gpt",
           compile="kernels", aten=False):
    world = shape[0] * shape[1] * shape[2]
    global_batch = 4 * shape[1]
    out = tmp_path / "got.pt"
    assert spawn(_worker, world, str(out), shape, microbatches, schedule, layers, tied, global_batch, plan, family,
                 compile, aten) == [0] * world
    got = torch.load(out, weights_only=False)
    losses, params, norms = _eager(layers, tied, global_batch, family)
    for r, g in enumerate(got):
        for step, (a, b) in enumerate(zip(g["losses"], losses)):
            assert abs(a - b) <= 1e-5 * abs(b), (r, step, a, b)
        # torch's clip_grad_norm_ on the pipeline's parameters sees the whole model's gradients
        for step, (a, b) in enumerate(zip(g["norms"], norms)):
            assert abs(a - b) <= 1e-5 * abs(b), (r, step, a, b)
        assert g["keys"], "state_dict() has the model's own keys"
        for name, want in params.items():
            assert _close(g["params"][name], want) <= 1e-4, (r, name)
        # what each rank sent is what the plan lists for its stage, microbatch by microbatch
        planned = [(p["phase"], p["label"], p["bytes"]) for p in g["p2p"] if p["src"] == g["stage"]]
        for step in g["sent"]:
            assert sorted((s["phase"], s["label"], s["bytes"]) for s in step) == sorted(planned * microbatches)
        # and every send and recv on the pp axis, in order, is the plan's steps(stage), byte for byte
        for step in g["moved"]:
            assert [(m["kind"], m["phase"], m["label"], m["peer"], m["bytes"]) for m in step] == g["planned_pp"], (r, step, g["planned_pp"])
        assert g["planned_pp"] and all(p[4] > 0 for p in g["planned_pp"])
        assert all(gap == 0.0 for gap in g["tie_gaps"]), g["tie_gaps"]
    whole = sum(p.numel() * p.element_size() for p in _model(layers, tied, family).parameters())
    assert all(g["held"] < whole for g in got), "every rank holds only its stage's parameters"
    assert all(g["held"] == g["planned_held"] for g in got), [(g["held"], g["planned_held"]) for g in got]
    return got


def test_pp2_trains_like_one_process(tmp_path):
    got = _check(tmp_path, (2, 1, 1), microbatches=2, layers=2, tied=True)  # the head tied to the embedding: both stages read it
    assert [g["blocks"] for g in got][0] == [[0], [1]]


@pytest.mark.slow
@pytest.mark.parametrize("shape,microbatches,schedule", [((4, 1, 1), 4, "1f1b"), ((2, 1, 2), 2, "1f1b"), ((2, 2, 1), 2, "gpipe"),
                                                         ((2, 1, 1), 4, "gpipe"), ((2, 2, 2), 2, "1f1b")],
                         ids=["4x1x1-1f1b-m4", "2x1x2-1f1b", "2x2x1-gpipe", "2x1x1-gpipe-m4", "2x2x2-1f1b"])
def test_pipeline_meshes_train_like_one_process(tmp_path, shape, microbatches, schedule):
    _check(tmp_path, shape, microbatches, schedule)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 1, 2), (2, 2, 1)], ids=["2x1x2", "2x2x1"])
def test_a_llama_style_model_trains_like_one_process(tmp_path, shape):
    """tests/complex_rotary.py (complex rotary table as a buffer, RMSNorm, SwiGLU, GQA), traced
    whole (its blocks take the table too): each block's RMSNorm statistics run in the block's own
    stage, the table is read by both stages, and the cut sends the residual stream alone."""
    got = _check(tmp_path, shape, microbatches=2, family="llama")
    assert got[0]["blocks"] == [[0, 1], [2, 3]]
    assert [(p["phase"], p["shape"]) for p in got[0]["p2p"]] == [("forward", [2 * shape[1], 16, 64]), ("backward", [2 * shape[1], 16, 64])]


@pytest.mark.slow
def test_a_weight_tied_across_first_and_last_stage_stays_tied(tmp_path):
    _check(tmp_path, (2, 1, 1), microbatches=2, tied=True)


# -- dropout: fresh draws every call, stage and microbatch ---------------------------------------

def _dropout_worker(rank, world, init_method, out):

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    torch.manual_seed(0)  # every rank alike: the pipeline's seeds are drawn from torch's generator
    cfg = gpt.config("tiny", n_layer=2, batch=4, dropout=0.5)
    model = nvtp.jit(gpt.GPT(cfg), plan="megatron", mesh=_mesh_of((2, 1, 1)), microbatches=2)
    idx, targets = gpt.example_tokens(cfg, seed=0)  # batch 4; a step's two microbatches are its first 2 rows twice
    twice = torch.cat([idx[:2], idx[:2]]), torch.cat([targets[:2], targets[:2]])  # two microbatches alike
    opt = _optimizer(model.module.parameters())
    loss = model(*twice)
    opt.zero_grad()
    loss.backward()
    opt.step()
    # this stage's parameters: each a DTensor held by one stage, an empty part on the others
    grads = [float(local(p.grad).abs().sum()) for p in model.module.parameters() if p.grad is not None and local(p.grad).numel()]
    with torch.no_grad():
        calls = [model(*twice).item() for _ in range(2)]
    # a pipeline compiled by a call under no_grad is forward only: training it is refused, saying so
    late = nvtp.jit(gpt.GPT(cfg), plan="megatron", mesh=_mesh_of((2, 1, 1)), microbatches=2)
    with torch.no_grad():
        late(*twice)
    try:
        late(*twice)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return workers.finish({"calls": calls, "loss": loss.item(), "grads": grads, "seeds": model.seeds, "refused": refused}, out, world)


@pytest.mark.slow
def test_dropout_under_a_pipeline_draws_fresh_masks_every_call_stage_and_microbatch(tmp_path):
    """GPT with dropout 0.5 on pp=2: every stage's fusions run with a seed drawn each call (as
    nvtp.jit's are), distinct per stage and microbatch, so two calls on one batch differ (with one
    seed for all they were equal), and a training step runs with nonzero gradients on both stages.
    The masks are nvtp's draws, not torch's: a run with dropout matches no eager run (nor does
    nvtp.jit's without pp)."""
    assert spawn(_dropout_worker, 2, str(tmp_path / "got.pt")) == [0] * 2
    got = torch.load(tmp_path / "got.pt", weights_only=False)
    for g in got:
        a, b = g["calls"]
        assert a != b and abs(a - b) < 0.5 * a, g["calls"]  # fresh masks, the same model
        assert g["grads"] and all(x > 0 for x in g["grads"])
    assert got[0]["calls"] == got[1]["calls"]  # the last stage's loss, on every rank
    seeds = [s for g in got for s in g["seeds"]]  # (stage, microbatch) -> seed, the last call's
    assert len(set(seeds)) == len(seeds) == 4
    assert all("compiled by a call under torch.no_grad(), forward only, and cannot train" in g["refused"] for g in got)


# -- checkpoints: DCP, saved on one pipeline shape, loaded on another ----------------------------

def _mesh_of(shape):
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(n for n, k in zip(("pp", "dp", "tp"), shape) if k > 1 or n == "pp")
    return init_device_mesh("cpu", tuple(k for n, k in zip(("pp", "dp", "tp"), shape) if n in names), mesh_dim_names=names)


def _ckpt_worker(rank, world, init_method, out, ckpt, shape, train):
    """``train``: train STEPS steps on ``shape`` and save; else compile on ``shape`` and load."""

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    dp = shape[1]
    model = nvtp.jit(_model(4), plan="megatron", mesh=_mesh_of(shape), microbatches=2)
    dp_rank = model.layout.coords(rank)[1]
    batches = _batches(4 * dp)
    if train:
        _train(model, batches, dp, dp_rank)
        nvtp.save_checkpoint(ckpt, model, step=STEPS)
    else:
        idx, targets = batches[0]
        n = idx.shape[0] // dp
        model.compile(idx[dp_rank * n:(dp_rank + 1) * n], targets[dp_rank * n:(dp_rank + 1) * n])
        assert nvtp.load_checkpoint(ckpt, model) == STEPS
    whole = model.full_parameters()
    held = {k: (tuple(v.shape), tuple(v.to_local().shape), type(v).__name__) for k, v in model.checkpoint_state().items()}
    return workers.finish({"params": whole, "held": held, "stage": model.stage}, out, world)


@pytest.mark.slow
def test_a_checkpoint_saved_on_one_pipeline_shape_loads_on_another(tmp_path):
    """DCP: saved on (pp, dp, tp) = (2, 1, 2) after STEPS steps of training (each rank its stage's
    parameters, DTensors on its (dp, tp) sub-mesh), loaded on (2, 2, 1) and into a plain module in
    this process; every weight equal to the saved one, and the saved ones within 1e-4 of the same
    training in one eager process."""
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    assert spawn(_ckpt_worker, 4, str(tmp_path / "saved.pt"), str(ckpt), (2, 1, 2), True) == [0] * 4
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    # each rank saved only its stage's parameters, under the model's own names, its tp part of each
    names = {n for n, _ in _model(4).named_parameters()}
    held = [{k for k, (_, part, _) in g["held"].items() if math.prod(part)} for g in saved]  # names with a nonempty part
    assert all(set(g["held"]) == names for g in saved)  # every rank's state has every name (DTensors held by one stage)
    assert held[0] == held[1] and held[2] == held[3] and held[0] | held[2] == names and not held[0] & held[2]
    assert saved[0]["held"]["h.0.mlp.c_fc.weight"] == ((256, 64), (128, 64), "DTensor")  # split over tp=2
    assert saved[2]["held"]["lm_head.weight"][:2] == ((256, 64), (128, 64))  # the vocabulary split over tp
    _, eager, _ = _eager(4, False, 4)
    initial = dict(_model(4).named_parameters())
    want = saved[0]["params"]
    for name, w in eager.items():
        assert _close(want[name], w) <= 1e-4, name
    assert any(not torch.equal(want[n], initial[n]) for n in names)  # training moved the weights: loading is seen
    assert spawn(_ckpt_worker, 4, str(tmp_path / "loaded.pt"), str(ckpt), (2, 2, 1), False) == [0] * 4
    for g in torch.load(tmp_path / "loaded.pt", weights_only=False):
        for name in names:
            assert torch.equal(g["params"][name], want[name]), (g["stage"], name)
    plain = _model(4)  # one process, no mesh: DCP reads the whole tensors
    state = {"model": {n: p.detach().clone() for n, p in plain.named_parameters()}}
    dcp.load(state, checkpoint_id=ckpt)
    for name in names:
        assert torch.equal(state["model"][name], want[name]), name


def test_a_pipelines_optimizer_state_is_refused_by_name(tmp_path):
    """Only the parameters are saved on a pp mesh: asking for the optimizer too is refused before
    any data is written (a stand-in pipeline: the check reads no more of it)."""
    class Pipelined:
        rank = 0

        def checkpoint_state(self):
            raise AssertionError("read the state before refusing")

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"a pipeline's checkpoint holds the model's parameters only.*without it"):
        nvtp.save_checkpoint(tmp_path / "c", Pipelined(), opt)
    assert not (tmp_path / "c" / "meta.json").exists()


# -- the cut ------------------------------------------------------------------------------------

def test_the_cut_balances_blocks_by_cost_and_takes_an_explicit_one():
    from nvtp import driver
    from nvtp.pipeline.stages import StageError, cut_stages

    model = _model(4)
    idx, targets = _batches(2)[0]
    traced = driver.trace(model, (idx, targets), tie=False)
    balanced = cut_stages(traced, "h", 4, 2)
    assert [s.blocks for s in balanced.stages] == [(0, 1), (2, 3)]
    explicit = cut_stages(traced, "h", 4, 2, cut=(1,))
    assert [s.blocks for s in explicit.stages] == [(0,), (1, 2, 3)]
    assert max(s.cost.flops for s in balanced.stages) < max(s.cost.flops for s in explicit.stages)
    # the blocks' costs: four like blocks, the first with the embedding, the last with the head and loss
    c = balanced.block_costs
    assert c[1] == c[2] and c[0].flops > c[1].flops and c[3].flops > c[1].flops
    names = {n for n, _ in model.named_parameters()}
    for staged in (balanced, explicit):  # every parameter in exactly one stage; what crosses: one activation, its gradient
        held = [set(s.parameters) for s in staged.stages]
        assert held[0] | held[1] == names and not held[0] & held[1]
        assert [(t.phase, t.src, t.dst, t.shape) for t in staged.transfers] == [("forward", 0, 1, (2, 16, 64)),
                                                                               ("backward", 1, 0, (2, 16, 64))]
    for bad in ((0,), (4,), (1, 2)):
        with pytest.raises(StageError, match="cut="):
            cut_stages(traced, "h", 4, 2, cut=bad)


def test_the_balanced_cut_is_the_first_split_with_the_least_largest_stage():
    """``balance`` against every contiguous split (the search it replaced): the least largest stage
    (flops, then bytes), and of equal ones the split whose cuts come first; and 96 blocks into 64
    stages (GPT-3 on the planner's 64 devices) at once."""
    import itertools
    import random
    import time

    from nvtp.pipeline.stages import Cost, balance

    def every_split(costs, stages):
        n = len(costs)
        def worst(cuts):
            bounds = (0, *cuts, n)
            return max((sum(costs[a:b], Cost()).flops, sum(costs[a:b], Cost()).bytes) for a, b in zip(bounds, bounds[1:]))
        return min(itertools.combinations(range(1, n), stages - 1), key=lambda cuts: (worst(cuts), cuts))

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        stages = rng.randint(1, n)
        costs = [Cost(float(rng.choice([1, 2, 3])), float(rng.randint(0, 3))) for _ in range(n)]  # many ties
        assert balance(costs, stages) == every_split(costs, stages), (costs, stages)
    start = time.perf_counter()
    cuts = balance([Cost(5.0, 1.0)] + [Cost(3.0, 1.0)] * 94 + [Cost(7.0, 2.0)], 64)
    assert len(cuts) == 63 and time.perf_counter() - start < 10
    with pytest.raises(ValueError, match="4 blocks cannot be cut into 5 stages"):
        balance([Cost(1.0, 1.0)] * 4, 5)


@pytest.mark.slow  # one process, but a whole Thunder trace (13 s on 2 busy cores)
def test_the_cut_of_a_llama_style_model_puts_each_rmsnorm_in_its_block():
    """The model's blocks take (x, table), so it is traced whole, with no splice to say which block
    computes a parameter-free op: block 1's RMSNorm statistics (``rsqrt(mean(x**2) + eps)``) depend
    on block 0's output only. They run in stage 1 (the stage of the norm's weight), so only the
    residual stream crosses; left in stage 0, stage 1's backward read them and the cut was refused."""
    from nvtp import driver
    from nvtp.pipeline.stages import cut_stages

    idx, targets = _batches(2, 2, "llama")[0]
    traced = driver.trace(_model(2, family="llama"), (idx, targets), tie=False)
    staged = cut_stages(traced, "blocks", 2, 2)
    assert [(t.phase, t.src, t.dst, t.shape) for t in staged.transfers] == [("forward", 0, 1, (2, 16, 64)), ("backward", 1, 0, (2, 16, 64))]
    held = [set(s.parameters) for s in staged.stages]
    assert "freqs" in held[0] & held[1]  # the rotary table (a buffer, no gradient) is read by both stages
    assert held[0] & held[1] == {"freqs"} and "blocks.1.attn_norm.weight" in held[1]
    f1 = staged.stages[1].traced.forward
    assert any(op.kind == "rsqrt" for op in f1.ops)  # stage 1 computes its blocks' norm statistics itself


def test_the_pipeline_programs_steps_hold_its_sends_and_recvs_on_the_pp_axis():
    """``steps(stage)``: the records ``Program.steps()`` gives, with the p2p on "pp" where the
    schedule runs them; the report's per-step totals are theirs (a run's count: the slow tests)."""
    idx, targets = _batches(4, 2)[0]
    program = nvtp.plan(_model(2), idx, targets, mesh="2x1x1", microbatches=2)  # 1F1B
    first = [(s.kind, s.phase, s.bytes) for s in program.steps(0) if s.axis == "pp"]
    last = [(s.kind, s.phase, s.bytes) for s in program.steps(1) if s.axis == "pp"]
    n = 2 * 16 * 64 * 4  # one microbatch's residual stream, fp32
    loss = ("broadcast", "forward", 4)  # the step's loss, from the last stage to every stage
    assert first == [("send", "forward", n), ("send", "forward", n), ("recv", "backward", n), ("recv", "backward", n), loss]  # F0 F1 B0 B1
    assert last == [("recv", "forward", n), ("send", "backward", n), ("recv", "forward", n), ("send", "backward", n), loss]  # F0 B0 F1 B1
    assert all(s.is_communication for s in program.steps(0) if s.axis == "pp")
    assert program.as_data()["stages"][0]["step"]["pp send"] == {"count": 2, "bytes": 2 * n}
    assert f"stage 1: 1 pp broadcast (4 B), 2 pp recv ({2 * n} B), 2 pp send ({2 * n} B)" in program.as_text()
    with pytest.raises(ValueError, match=r"stage=2: this pipeline has stages 0..1"):
        program.steps(2)


# -- layout, schedules: by hand ------------------------------------------------------------

def test_layout_is_megatrons():
    """Megatron's initialize_model_parallel docstring: 16 GPUs, t=2, p=4 (so d=2)."""
    lay = Layout(pp=4, dp=2, tp=2)
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lay.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert lay.embedding_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_schedules():
    assert [str(a) for a in sched.actions("1f1b", 0, 4, 6)] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    assert [str(a) for a in sched.actions("1f1b", 3, 4, 6)] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()
    assert [sched.in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert sched.in_flight("gpipe", 0, 4, 8) == 8
    assert sched.bubble("1f1b", 4, 8) == 3 / 11


# -- bad input: refused before anything is traced ----------------------------------------------

@pytest.fixture
def no_trace(monkeypatch):
    from nvtp import driver

    def must_not_trace(*a, **k):
        raise AssertionError("traced before refusing bad input")

    monkeypatch.setattr(driver, "trace", must_not_trace)


def test_fewer_blocks_than_stages_is_refused(no_trace):
    from nvtp import driver

    idx, targets = _batches(4, 2)[0]
    with pytest.raises(ValueError, match=r"2 blocks .* pp=4 stages.*pp <= 2"):
        driver.compile_pipeline(_model(2), idx, targets, mesh="4x1x1", microbatches=2)


def test_a_batch_the_microbatches_do_not_divide_is_refused(no_trace):
    from nvtp import driver

    idx, targets = _batches(4)[0]
    with pytest.raises(ValueError, match=r"batch of 4 does not split into microbatches=3.*microbatches=2"):
        driver.compile_pipeline(_model(), idx, targets, mesh="2x1x1", microbatches=3)


def test_a_mesh_unlike_the_world_is_refused(no_trace):
    with pytest.raises(ValueError, match=r"pp=2 x dp=1 x tp=2 has 4 devices but the process group has 1"):
        nvtp.jit(_model(), mesh=_FakeMesh((2, 1, 2)), microbatches=2)


class _FakeMesh:
    """Stands in for torch's DeviceMesh without a process group (its names and shape are what nvtp reads)."""

    def __init__(self, shape):
        self.shape, self.mesh_dim_names = shape, ("pp", "dp", "tp")
        self.mesh = torch.arange(shape[0] * shape[1] * shape[2]).reshape(shape)


# -- nvFuser: each stage's files, with the stage's sub-mesh, built from their text ---------------

def test_each_stage_prints_as_nvfuser_files_that_build_from_their_text(tmp_path):
    pytest.importorskip("nvfuser_direct", reason="nvfuser_direct builds the printed files (no GPU needed)")
    from nvtp.execute.nvfuser import build_from_text, compare_definition
    from nvtp.ir.parser import parse

    idx, targets = _batches(4)[0]
    program = nvtp.plan(_model(), idx, targets, mesh="2x1x2", microbatches=2, backend="nvfuser")  # what nvtp.jit would run on GPUs
    assert [s["blocks"] for s in program.as_data()["stages"]] == [[0, 1], [2, 3]]
    paths = program.write_nvfuser(tmp_path)
    assert [p.name for p in paths] == ["stage0_fwd.py", "stage0_bwd.py", "stage1_fwd.py", "stage1_bwd.py"]
    for path in paths:
        text = path.read_text()
        stage = int(path.name[5])
        ranks = program.layout.submesh(stage).devices
        assert f"nvfuser_direct.multidevice.DeviceMesh([{', '.join(map(str, ranks))}])" in text, path.name
        fd = build_from_text(text, str(path))
        assert compare_definition(parse(text, str(path)).fusion, fd) == []
    # what crosses the cut is a point-to-point step of the plan, with its bytes: the stage's own output
    (fwd,) = [p for p in program.p2p() if p["phase"] == "forward"]
    assert fwd["bytes"] == 2 * 16 * 64 * 4 and fwd["local_shape"] == [2, 16, 64]  # whole over tp: a microbatch of 2 x s x e


# -- the command line: what a user runs, by subprocess --------------------------------------------

def _nvtp(*args: str):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))  # this checkout's nvtp, whatever is installed
    return subprocess.run([sys.executable, "-m", "nvtp", *args], capture_output=True, text=True, cwd=root, env=env, timeout=300)


@pytest.mark.slow
def test_explain_a_4x2x2_pipeline_prints_megatrons_layout_and_the_plan():
    done = _nvtp("explain", "--model", "nanogpt", "--config", "tiny", "--layers", "8", "--plan", "megatron", "--mesh", "4x2x2",
                 "--microbatches", "8", "--json")
    assert done.returncode == 0, done.stderr
    import json

    d = json.loads(done.stdout)
    lay = Layout(4, 2, 2)
    assert d["groups"] == {"tp": lay.groups("tp"), "dp": lay.groups("dp"), "pp": lay.groups("pp"), "embedding": lay.embedding_groups()}
    assert d["groups"]["pp"][:2] == [[0, 4, 8, 12], [1, 5, 9, 13]]
    assert [s["blocks"] for s in d["stages"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # 8 like blocks, head and tail light: 2 each
    assert d["bubble"] == 3 / 11
    assert [s["in_flight_microbatches"] for s in d["stages"]] == [4, 3, 2, 1]
    # each boundary sends one microbatch's activation (2 x 16 x 64 fp32), split over dp=2, whole over tp
    assert [(p["phase"], p["src"], p["dst"], p["bytes"]) for p in d["p2p"]] == [
        ("forward", 0, 1, 4096), ("forward", 1, 2, 4096), ("forward", 2, 3, 4096),
        ("backward", 1, 0, 4096), ("backward", 2, 1, 4096), ("backward", 3, 2, 4096)]
    text = _nvtp("explain", "--model", "nanogpt", "--config", "tiny", "--layers", "8", "--plan", "megatron", "--mesh", "4x2x2",
                 "--microbatches", "8")
    assert "4 pipeline-parallel groups: [g0, g4, g8, g12], [g1, g5, g9, g13]" in text.stdout
    assert "bubble (p-1)/(m+p-1) = 3/11" in text.stdout


@pytest.mark.slow
def test_explain_refuses_a_bad_pipeline_mesh():
    done = _nvtp("explain", "--model", "nanogpt", "--config", "tiny", "--plan", "megatron", "--mesh", "4x2x0")
    assert done.returncode != 0 and "PPxDPxTP" in done.stderr


def test_a_model_returning_more_than_its_loss_is_refused_before_the_stages_are_cut():
    """nanoGPT's ``(logits, loss)``: the last stage's backward starts from the loss alone, so the
    logits would get a gradient eager never gives them; refused, naming what it returns."""
    from nvtp.errors import InputError
    from tests.written import GPTConfig, TinyGPT, tokens

    cfg = GPTConfig(n_layer=4)
    idx, targets = tokens(cfg, batch=4)
    with pytest.raises(InputError, match=r"returns its loss alone.*TinyGPT.forward returns 2 tensor\(s\): y\[0\] \[2, 16, 64\], "
                                         r"y\[1\] \[\]; return only the loss"):
        nvtp.plan(TinyGPT(cfg), idx, targets, mesh="2x1x1", microbatches=2)

"""``compile="inductor"`` (nvtp/execute/inductor.py): each rank's lowered fusion cut at its
collectives and random draws, the compute between them traced to aten graphs and compiled, with
the values and gradients of eager PyTorch on one process (computed independently of nvtp).

Inductor's C++ builds take tens of seconds to minutes on this project's CPUs, so the default tier
puts the traced aten graph itself where Inductor's code would run (``inductor.compiler``): what
is checked fast is the cutting, the tracing and the graphs Inductor is given; one slow test runs
Inductor itself."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import nvtp
from nvtp.execute import inductor, reference, spmd
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh
from tests.test_kernels import _close, _gpt
from tests.test_kernels import _step as _step_once


def _step(model, loss_of, *args):
    """One step's loss and gradients, the gradients set to None after (steps do not accumulate)."""
    got = _step_once(model, loss_of, *args)
    getattr(model, "module", model).zero_grad(set_to_none=True)
    return got


@pytest.fixture
def aten(monkeypatch):
    """The traced aten graphs run as the compiled code; returns them (each with its call count)."""
    graphs: list[list] = []

    def compile_(graph, inputs):
        entry = [graph, 0]
        graphs.append(entry)

        def run(xs):  # called as Inductor's code is: with a list of the inputs
            entry[1] += 1
            return graph(*xs)

        return run

    monkeypatch.setattr(inductor, "compiler", compile_)
    for entries in reference._CACHE.values():  # a program shared between tests compiles again, here
        for e in entries:
            e.lowered.compiled = None
    return graphs


@pytest.fixture(scope="module")
def traced():
    """The tiny GPT (vocabulary 512) traced once for the tests of one rank: (model, idx, targets,
    eager's loss and gradients, a ShardedModule holding the program)."""
    model, cfg, idx, tgt = _gpt(vocab_size=512)
    want = _step(copy.deepcopy(model), _loss, idx, tgt)
    base = nvtp.jit(copy.deepcopy(model), mesh=DeviceMesh.of_size(1))
    base.compile(idx, tgt)
    return model, idx, tgt, want, base


def _one_rank(traced):
    model, idx, tgt, want, base = traced
    return nvtp.jit(copy.deepcopy(model), mesh=DeviceMesh.of_size(1), compile="inductor").share_compiled(base)


COLLECTIVES = (inductor.PER_CALL["set"], inductor.SCHEDULED)
SMALL = f"fewer than {inductor.MIN_OPS} ops"


def _pieces(sm) -> dict[str, dict]:
    return {phase: reference.compiled_pieces(sharded.fusion) for phase, sharded in sm.last.phases()}


def _aten_ops(graph) -> set[str]:
    return {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}


def _loss(out):
    return out


def test_one_rank_of_the_gpt_runs_compiled_with_eagers_loss_and_gradients(aten, traced):
    """A mesh of one: the forward and the backward are one compiled piece each, given to the
    compiler with the kernels pass's fused aten kernels in them; the second step runs them."""
    model, idx, tgt, want, base = traced
    sm = _one_rank(traced)
    first = _step(sm, _loss, idx, tgt)  # runs each fusion's Python, then traces and compiles it
    second = _step(sm, _loss, idx, tgt)
    pieces = _pieces(sm)
    for phase in ("forward", "backward"):
        assert pieces[phase]["compiled"] == 1 and pieces[phase]["python"] == {}, pieces
    assert len(aten) == 2 and all(calls >= 1 for _, calls in aten), [calls for _, calls in aten]
    assert 0 < sm.last.seconds["compile"] == pytest.approx(sum(p["seconds"] for p in pieces.values()))
    forward, backward = (_aten_ops(g) for g, _ in aten)
    assert {"aten._log_softmax.default", "aten.native_layer_norm.default",
            "aten._scaled_dot_product_flash_attention_for_cpu.default"} <= forward, sorted(forward)
    assert {"aten.embedding_dense_backward.default", "aten.native_layer_norm_backward.default",
            "aten._log_softmax_backward_data.default"} <= backward, sorted(backward)
    _close(first, want, "first step vs eager")
    _close(second, want, "compiled step vs eager")


def test_megatron_at_tp2_compiles_between_its_collectives_with_eagers_gradients(aten):
    """Simulated ranks (threads), the GPT under megatron on tp=2: each rank's fusions are cut at
    their ``set`` ops (the all-reduces), which run as Python in their place; the compute between
    them is compiled; the loss and every assembled gradient as eager's on the unsharded model."""
    model, cfg, idx, tgt = _gpt()
    want = _step(copy.deepcopy(model), _loss, idx, tgt)
    mesh = DeviceMesh.of_size(2)
    threads = spmd.ThreadMesh(mesh, timeout=120)
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=mesh, comm=threads.comm(r), compile="inductor")
             for r in range(2)]
    ranks[0].compile(idx, tgt)
    ranks[1].share_compiled(ranks[0])
    spmd.on_threads(lambda r: _step(ranks[r], _loss, idx, tgt), threads)
    got = spmd.on_threads(lambda r: _step(ranks[r], _loss, idx, tgt), threads)
    pieces = _pieces(ranks[0])
    for phase in ("forward", "backward"):
        assert pieces[phase]["compiled"] >= 2 * 2, pieces  # two ranks, each cut at least once
        collectives = {why: n for why, n in pieces[phase]["python"].items() if why in COLLECTIVES}
        assert sum(collectives.values()) >= 2 and not set(pieces[phase]["python"]) - set(COLLECTIVES) - {SMALL}, pieces
    assert sum(calls for _, calls in aten) >= 8, [calls for _, calls in aten]
    for r, (loss, grads) in enumerate(got):
        whole = {n: spmd.assemble([g[1][n] for g in got], ranks[0].placement(n), want[1][n].shape, mesh) for n in grads}
        _close((loss, whole), want, f"rank {r} vs eager")


def test_dropout_draws_stay_python_and_draw_what_the_kernels_mode_draws(aten):
    """The GPT with dropout 0.1 in training: every random draw runs as Python in its place (keyed
    by the call's seed), so the compiled program draws the masks ``compile="kernels"`` draws."""
    model, cfg, idx, tgt = _gpt(dropout=0.1)
    kernels = nvtp.jit(copy.deepcopy(model), mesh=DeviceMesh.of_size(1))
    kernels.compile(idx, tgt)
    compiled = nvtp.jit(copy.deepcopy(model), mesh=DeviceMesh.of_size(1), compile="inductor").share_compiled(kernels)
    got, want = [], []
    for step in range(2):
        torch.manual_seed(10 + step)
        want.append(_step(kernels, _loss, idx, tgt))
        torch.manual_seed(10 + step)
        got.append(_step(compiled, _loss, idx, tgt))
    pieces = _pieces(compiled)
    assert pieces["forward"]["python"].get(inductor.PER_CALL["uniform"], 0) >= 1, pieces
    assert pieces["forward"]["compiled"] >= 2, pieces
    assert want[0][0].item() != want[1][0].item()  # two seeds, two masks
    for g, w in zip(got, want):
        _close(g, w, "compiled vs kernels, same seed")


def test_a_piece_given_other_strides_runs_its_python(aten, traced, monkeypatch):
    """Inductor's code assumes the strides it was compiled for: a call with others runs the
    piece's Python instead (exact), never the compiled code on a layout it was not built for."""
    model, idx, tgt, want, base = traced
    sm = _one_rank(traced)
    seen = []
    run = reference.run
    monkeypatch.setattr(reference, "run", lambda fusion, inputs, **kw: seen.append((fusion, list(inputs))) or run(fusion, inputs, **kw))
    _step(sm, _loss, idx, tgt)
    fusion, inputs = seen[-1]  # the backward's
    lowered = next(e.lowered for e in reference._CACHE[id(fusion)] if e.lowered.compiled is not None)
    ctx = lambda: reference.Context(fusion, shapes=lowered.shapes, held=lowered.held)  # noqa: E731
    inputs = [reference.input_value(ctx(), v, x) for v, x in zip(fusion.inputs, inputs)]
    strided = [x.t().contiguous().t() if isinstance(x, torch.Tensor) and x.ndim == 2 and x.is_floating_point() else x
               for x in inputs]
    assert any(a.stride() != b.stride() for a, b in zip(inputs, strided) if isinstance(a, torch.Tensor))
    calls = [c for _, c in aten]
    got = lowered.compiled.run(ctx(), *strided)
    assert [c for _, c in aten] == calls  # the compiled code was not called
    want = lowered.module.forward(ctx(), *strided)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    lowered.compiled.run(ctx(), *inputs)
    assert sum(c for _, c in aten) == sum(calls) + 1  # inputs as compiled for: the compiled code


def test_compile_inductor_is_a_choice_and_a_bad_value_names_it():
    from nvtp.errors import InputError

    with pytest.raises(InputError, match=r"compile='inductr' is not a way nvtp runs a rank's program; choose one of .*'inductor': "):
        nvtp.jit(gpt.GPT(gpt.config("tiny")), compile="inductr")


@pytest.mark.slow
def test_inductor_itself_compiles_one_rank_of_the_gpt_with_eagers_values(traced):
    """Inductor's C++ code (tens of seconds to minutes to build here; its disk cache makes a rerun fast)."""
    model, idx, tgt, want, base = traced
    for entries in reference._CACHE.values():  # compiled by the fast tests' stand-in: compile again
        for e in entries:
            e.lowered.compiled = None
    sm = _one_rank(traced)
    _step(sm, _loss, idx, tgt)
    got = _step(sm, _loss, idx, tgt)
    pieces = _pieces(sm)
    assert pieces["forward"]["compiled"] == 1 and pieces["backward"]["compiled"] == 1, pieces
    _close(got, want, "Inductor's step vs eager")


# -- pipelines: each stage's program compiled ----------------------------------------------------


def _pipeline_pieces_used(rank: dict, steps: int, microbatches: int, allowed=COLLECTIVES + (SMALL,)) -> None:
    """A stage's fusions ran compiled: pieces in both phases, Python only where it must be, what
    compiling took reported (``model.last.seconds``), and every compiled piece's code called on
    every microbatch after the first call (which runs the Python, then compiles)."""
    pieces, calls = rank["compiled"], rank["calls"]
    for phase in ("forward", "backward"):
        assert pieces[phase]["compiled"] >= 1, pieces
        assert not set(pieces[phase]["python"]) - set(allowed), pieces
    assert len(calls) == sum(p["compiled"] for p in pieces.values()), (calls, pieces)
    assert all(c >= steps * microbatches - 1 for c in calls), calls
    assert 0 < rank["compile_s"] == pytest.approx(sum(p["seconds"] for p in pieces.values())), rank["compile_s"]


def test_a_pipeline_of_one_stage_runs_compiled_pieces_on_every_microbatch(aten):
    """``nvtp.jit(model, mesh="1x1x1", microbatches=2, compile="inductor")`` in this process: the
    pipeline's runtime (its schedule of microbatches, gradients summed over them) runs its stage's
    compiled forward and backward, and trains three SGD steps as eager PyTorch does on the whole
    batch (the gloo stages: the slow tests below)."""
    from tests import test_pipeline as tp

    model = nvtp.jit(tp._model(layers=2), plan="megatron", mesh="1x1x1", microbatches=2, compile="inductor")
    losses, _ = tp._train(model, tp._batches(4, layers=2), dp=1, dp_rank=0)
    want_losses, want_params, _ = tp._eager(2, False, 4)
    for a, b in zip(losses, want_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, want_losses)
    got = model.full_parameters()
    for name, want in want_params.items():
        assert tp._close(got[name].detach(), want) <= 1e-4, name
    rank = {"compiled": _pieces_of(model.last), "calls": [calls for _, calls in aten], "compile_s": model.last.seconds.get("compile")}
    _pipeline_pieces_used(rank, tp.STEPS, 2, allowed=())  # a stage of one rank: one piece a phase, nothing left Python
    assert rank["compiled"]["forward"]["compiled"] == rank["compiled"]["backward"]["compiled"] == 1, rank


def _pieces_of(program) -> dict[str, dict]:
    return {phase: reference.compiled_pieces(sharded.fusion) for phase, sharded in program.phases()}


@pytest.mark.slow
def test_a_pp2_pipeline_compiled_by_inductor_trains_like_one_process(tmp_path):
    """Two gloo processes, one stage each, Inductor's own C++ code (its disk cache makes a rerun
    fast): the stages train as eager PyTorch on the whole batch (tests/test_pipeline.py's checks:
    losses, gradient norms, weights, what each stage sends), each stage's forward and backward one
    compiled piece, called on every microbatch."""
    from tests import test_pipeline as tp

    got = tp._check(tmp_path, (2, 1, 1), microbatches=2, layers=2, tied=True, compile="inductor")
    for rank in got:
        _pipeline_pieces_used(rank, tp.STEPS, 2, allowed=())


@pytest.mark.slow
def test_a_pp_tp_pipeline_compiles_each_stage_between_its_collectives(tmp_path):
    """(pp, tp) = (2, 2) on four gloo processes, the traced aten graphs standing in for Inductor's
    code: each stage's megatron program cut at its tp collectives, the pieces between compiled and
    called on every microbatch; trains as eager PyTorch."""
    from tests import test_pipeline as tp

    got = tp._check(tmp_path, (2, 1, 2), microbatches=2, layers=2, compile="inductor", aten=True)
    for rank in got:
        _pipeline_pieces_used(rank, tp.STEPS, 2)
        assert all(sum(n for why, n in p["python"].items() if why in COLLECTIVES) >= 2 for p in rank["compiled"].values()), rank


# -- an ep axis: compiled around its expert rows -------------------------------------------------


def test_an_ep_axis_compiles_everything_but_its_expert_rows_with_eagers_values(aten):
    """nvtp's MoE GPT at ep=2 (simulated ranks), a batch after which an expert is idle: the ops
    ``ep.Experts`` runs on dispatched rows (each ``gather_mm``, ``gather_mm_wgrad`` and the
    row-wise ops between them) stay Python in their place; the rest of each rank's fusions (the
    kernels pass's fused groups among it) is compiled and runs on every step. Logits, loss and
    every gradient as eager's; the all-to-alls each rank sends are the Program's, byte for byte."""
    from nvtp.execute import ep as ep_run
    from tests import test_ep

    model, batch = test_ep.moe_gpt()
    mesh = DeviceMesh.of_shape((2,), ("ep",))
    threads = spmd.ThreadMesh(mesh, timeout=300)
    ranks = [nvtp.jit(copy.deepcopy(model), plan="megatron", mesh=mesh, comm=threads.comm(r), compile="inductor") for r in range(2)]
    ranks[0].compile(*batch)
    ranks[1].share_compiled(ranks[0])

    def step(m):
        logits, loss = m(*batch)
        loss.backward()
        return logits.detach(), loss.detach()

    spmd.on_threads(lambda r: step(ranks[r]), threads)  # the first call: Python, then each piece compiled
    for m in ranks:
        m.module.zero_grad(set_to_none=True)
    calls = [c for _, c in aten]
    with ep_run.recording() as sent:
        outs = spmd.on_threads(lambda r: step(ranks[r]), threads)
    assert all(c == before + 1 for (_, c), before in zip(aten, calls)), (calls, [c for _, c in aten])  # every piece's code ran
    pieces = _pieces(ranks[0])
    for phase in ("forward", "backward"):
        assert pieces[phase]["compiled"] >= 2 * 2, pieces
        assert pieces[phase]["python"].get(inductor.EXPERT_ROWS, 0) >= 2 * 2, pieces  # two layers' experts, two ranks
        assert not set(pieces[phase]["python"]) - set(COLLECTIVES) - {SMALL, inductor.EXPERT_ROWS}, pieces
    assert reference.fused_patterns(ranks[0].last.forward.fusion), "the kernels pass runs on an ep program too"
    planned = [(s.tensor, s.bytes) for s in ranks[0].last.steps() if s.kind == "alltoall"]
    assert sorted(sent) == sorted(planned * mesh.size)
    ref = test_ep.eager(model)
    logits, loss = ref(*batch)
    loss.backward()
    for got_logits, got_loss in outs:
        assert test_ep.relative_error(got_loss, loss.detach())[0] <= 1e-5
        assert test_ep.relative_error(got_logits, logits.detach())[0] <= 1e-5
    for name, p in ref.named_parameters():
        got = spmd.assemble([m.module.get_parameter(name).grad for m in ranks], ranks[0].placement(name), p.shape, mesh)
        assert test_ep.relative_error(got, p.grad)[0] <= 1e-5, name


# -- what stays op by op is said ---------------------------------------------------------------


def _pointwise_chain():
    from nvtp.ir import DType, FusionBuilder, verify

    b = FusionBuilder()
    x = b.define_tensor([4, 8], DType.Float)
    y = x
    for kind in ("exp", "neg", "tanh", "abs", "sin"):
        y = b.op(kind, y)
    b.add_output(y)
    return verify(b.build())


@pytest.mark.parametrize("options,why", [({"strict": True}, "strict"), ({"values": {}}, "values="),
                                         ({"compute_dtype": torch.float64}, "compute_dtype"),
                                         ({"compiled": False}, "compile='none'"),
                                         ({"shape": (2, 8)}, "inputs of other shapes or dtypes than declared")],
                         ids=["strict", "values", "compute_dtype", "unfused", "undeclared-shape"])
def test_a_run_asked_to_compile_that_runs_op_by_op_says_so(aten, options, why):
    """The debugging runs (``strict``, ``values``, ``compute_dtype``), an unfused run and inputs of
    other shapes than declared run every op by its implementation: with ``inductor`` asked for,
    a warning names the fusion and why, once, and ``compiled_pieces`` counts the runs."""
    f = _pointwise_chain()
    x = torch.randn(options.pop("shape", (4, 8)), generator=torch.Generator().manual_seed(0))
    want = torch.sin(torch.tanh(-torch.exp(x)).abs())
    with pytest.warns(UserWarning, match=rf"compile='inductor': .* runs op by op, not compiled: {why}"):
        got = reference.run(f, [x], inductor=True, **options)
    torch.testing.assert_close(got[0].to(want.dtype), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per fusion and reason
        reference.run(f, [x], inductor=True, **options)
    assert reference.compiled_pieces(f) == {"compiled": 0, "python": {f"op by op: {why}": 2}, "seconds": 0.0}
    assert not aten


def test_the_same_chain_run_as_declared_compiles_without_a_word(aten):
    f = _pointwise_chain()
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reference.run(f, [x], inductor=True)
        reference.run(f, [x], inductor=True)
    assert reference.compiled_pieces(f)["compiled"] == 1 and len(aten) == 1 and aten[0][1] == 1

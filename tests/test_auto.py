"""``plan="auto"`` (``nvtp/auto``): the fastest candidate that fits is chosen from what the axis
strategies allow, bad input is refused before any search, the chosen plan trains like one process
(simulated ranks here; 4 gloo processes in the slow test), and ``nvtp explain --plan auto`` prints
the choice and the ranked table as typed."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import subprocess
import sys
import time
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import nvtp
from nvtp.auto import AutoError, Candidate, search
from nvtp.auto.runtime import simulated
from nvtp.auto.search import size_text
from nvtp.errors import EXIT_BAD_INPUT, EXIT_USAGE, InputError
from nvtp.execute import spmd
from nvtp.pipeline.schedule import flights
from nvtp.auto.memory import live_peak
from nvtp.execute import reference
from nvtp.ir.parser import parse
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh, local_shape
from tests import workers

ROOT = Path(__file__).parent.parent
CFG = replace(gpt.config("tiny", n_layer=4), batch=8)  # hidden 64, 4 heads, sequence 16, vocabulary 256; 4 blocks, batch 8


def _loss(out):
    return out[1] if isinstance(out, tuple) else out


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(CFG)


@pytest.fixture(scope="module")
def choice():
    return search(_model(), gpt.example_tokens(CFG), devices=4)


def test_the_choice_is_the_fastest_candidate_that_fits(choice):
    """Every candidate uses the 4 devices; tp, dp (with and without FSDP) and pp all compete;
    the ranked list is sorted by predicted step time and the choice is its head; a candidate's
    terms sum to its time; FSDP's weights per rank are a quarter of DDP's."""
    ranked = choice.ranked
    assert choice.best is ranked[0] and len(ranked) >= 10
    assert [c.seconds for c in ranked] == sorted(c.seconds for c in ranked)
    assert all(c.candidate.devices == 4 and c.total_memory <= choice.facts.memory for c in ranked)
    used = {s.name for c in ranked for s, _ in c.candidate.used()}
    assert {"tp", "dp", "pp"} <= used, used
    for c in ranked:
        assert abs(sum(c.terms.values()) - c.seconds) <= 1e-12
        assert {"parameters", "gradients", "optimizer", "activations"} <= set(c.memory)
    by_text = {c.candidate.text(): c for c in ranked}
    ddp, fsdp = by_text["dp4"], by_text["dp4 fsdp"]
    assert fsdp.memory["parameters"] == pytest.approx(ddp.memory["parameters"] / 4)
    pipelines = [c for c in ranked if c.candidate.pipelined]
    assert pipelines and all(c.terms.get("pp bubble", 0.0) > 0 for c in pipelines)
    text = choice.as_text()
    assert f"chosen: {choice.best.candidate.text()}:" in text and "why not chosen" in text and "slower: " in text


def test_a_pipeline_cut_sends_the_residual_stream_of_a_microbatch(choice):
    """What a pipeline junction sends per microbatch is the one activation that crosses blocks (the
    residual stream [rows, T, C] of its microbatch, fp32), not the next block's weights (counted
    before: 79040 B where 8192 cross at pp2 dp2 with 2 microbatches); without tp, nothing is gathered."""
    for text, rows in (("pp2 dp2 microbatches=2 schedule=1f1b", 8 // 2 // 2), ("pp4 microbatches=4 schedule=1f1b", 8 // 4)):
        c = next(c for c in choice.ranked if c.candidate.text() == text)
        assert c.junction_bytes == rows * CFG.seq_len * CFG.n_embd * 4, (text, c.junction_bytes)
        assert c.tp_gather == 0.0


def test_memory_terms_are_what_the_runtime_allocates(choice):
    """Each candidate's memory names what its axes hold at the fullest moment, sized as the
    reference runtime allocates it (``nvtp.auto.memory``), against W, the model's weight bytes
    counted from torch: DDP's all-reduce copies the gradients of its bucket into one buffer kept
    between steps, reduced in place, the gradients views of it (``nvtp.execute.buckets``): no
    bytes besides the gradients (W) but the members that are not gradients (it made a flat copy
    of about W, and a reduced clone, until 2026-12-02); FSDP's reduce-scatter copies
    a block's whole gradients into per-rank chunks (B, the block's weight bytes) and gloo copies
    the other ranks' chunks again ((dp - 1) B / dp), one block under way at a time (the schedule's
    ``Issue.done``; until 2026-12-02 one bucket of the whole model's, 1.75 W: seen in torch's
    profiler on 4 gloo processes, 0.89 + 0.67 MiB). Without these terms the model missed 0.8 and
    1.6 MiB of the measured peaks (docs/auto.md)."""
    weights = sum(p.numel() * p.element_size() for p in _model().parameters())
    block = sum(p.numel() * p.element_size() for n, p in _model().named_parameters() if n.startswith("h.0."))
    by_text = {c.candidate.text(): c for c in choice.ranked}
    ddp, fsdp = by_text["dp4"].memory, by_text["dp4 fsdp"].memory
    bucket = ddp.get("dp: gradient bucket (DDP all-reduce)", 0.0)
    assert bucket <= 0.15 * weights and ddp["gradients"] == pytest.approx(weights, rel=0.01), (bucket, ddp["gradients"], weights)
    chunks = fsdp.get("dp: gradient bucket, per-rank chunks (FSDP reduce-scatter)", 0.0)
    assert 0.85 * 1.75 * block <= chunks <= 1.75 * block, (chunks, block, weights)
    for c in (ddp, fsdp):
        assert c["total"] == pytest.approx(sum(v for k, v in c.items() if k not in ("total", "gradients")))


def test_the_backward_frees_each_saved_activation_after_its_last_reader(choice):
    """The reference runtime hands a backward its saved activations in a list it empties
    (``nvtp.parallel._Run``, ``lower.taking_list``), so each is freed after its last reader: at
    dp4's fullest moment (the model's) at most a quarter of what the forward saved is alive, where
    the model held all of them to the backward's end and, once the runtime freed them,
    over-predicted the measured peaks by up to 22 % (docs/auto.md; the peaks themselves:
    ``test_predicted_memory_is_within_15_percent_of_the_measured_peaks``). What the forward saves
    is counted from the whole 4-block program run on one rank (not the planner's 3-block sample)."""
    dp4 = next(c for c in choice.ranked if c.candidate.text() == "dp4")
    ranks, _ = simulated(_model(), dp4.candidate, *gpt.example_tokens(CFG))
    f = ranks[0].inner.last.forward
    saved = sum(math.prod(local_shape(v.shape, f.shardings[v.name], f.mesh)) * v.dtype.itemsize
                for v in f.source.outputs if f.source.role(v.name) == "saved" and f.source.role(v.name) != "parameter")
    assert saved > 0 and dp4.memory.get("activations", 0.0) <= saved / 4, (dp4.memory.get("activations"), saved)


def _measure_tool():
    """tools/auto_measure.py, whose ``peak_live_bytes`` measures the peaks docs/auto.md reports."""
    spec = importlib.util.spec_from_file_location("auto_measure", ROOT / "tools" / "auto_measure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_FUSION = """\
import torch
from nvfuser_direct import FusionDefinition, DataType

def nvfuser_fusion_id0(fd : FusionDefinition) -> None :
    T0 = fd.define_tensor(shape=[64, 256], contiguity=[True, True], dtype=DataType.Float, is_cpu=False, stride_order=[1, 0])
    T1 = fd.ops.exp(T0)
    T2 = fd.ops.permute(T1, dims=[1, 0])
{body}

with FusionDefinition() as fd:
    nvfuser_fusion_id0(fd)
"""
VIEWS = {  # (the ops after T2, the 64 KiB values alive at the fullest moment)
    # T2 and T3 are views of T1: T1 and T4 alive, not T3 as well
    "a view holds no bytes": ("T3 = fd.ops.permute(T2, dims=[1, 0])\nT4 = fd.ops.add(T1, T3)\nfd.add_output(T4)", 2),
    # the reshape of the permuted view T2 copies (T3: T1, T3 and T5 alive); the reshape of T1 is a view
    "a reshape of a permuted view copies": ("T3 = fd.ops.reshape(T2, new_shape=[16384])\nT4 = fd.ops.reshape(T1, new_shape=[16384])\n"
                                            "T5 = fd.ops.add(T3, T4)\nfd.add_output(T5)", 3),
}


@pytest.mark.parametrize("case", list(VIEWS))
def test_the_models_peak_is_what_the_runtime_allocates_around_views(case):
    """The reference backend runs reshape and permute as torch views: a view holds no bytes of
    its own and keeps its operand alive, and a reshape of a permuted view copies. The model's
    fullest moment of each fusion equals the bytes torch's profiler sees alive while the
    reference backend runs it (``tools/auto_measure.py``'s measure). Counting every view as bytes
    of its own over-predicted tp4 megatron's peak by 23 % (docs/auto.md)."""
    body, alive = VIEWS[case]
    f = parse(_FUSION.format(body="\n".join("    " + line for line in body.split("\n")))).fusion
    model = live_peak(types.SimpleNamespace(fusion=f, source=f, mesh=DeviceMesh.of_size(1), shardings={}, set_steps={}), None, None)
    x = torch.randn(64, 256)
    reference.run(f, [x])  # lowered once, before the measured run
    peak, held = _measure_tool().peak_live_bytes(lambda: reference.run(f, [x]), [x])
    assert model.bytes == peak - held == alive * 64 * 256 * 4, (model.bytes, peak - held)


def test_a_pipeline_stage_holds_its_gradient_sum_only_from_its_first_backward():
    """A stage's moments as the pipeline runtime runs them: 1F1B's first stage of two with 2
    microbatches holds both microbatches' activations at its first backward, and the sum of the
    gradients (beside the new ones) only from its second, when one microbatch is left: the model
    counted both at one moment and over-predicted the Llama's pp2 tp2 megatron by 27 %."""
    assert flights("1f1b", 0, 2, 2) == [("F", 1, 0), ("F", 2, 0), ("B", 2, 0), ("B", 1, 1)]
    assert flights("1f1b", 1, 2, 2) == [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)]
    assert flights("gpipe", 1, 2, 3) == [("F", 1, 0), ("F", 2, 0), ("F", 3, 0), ("B", 3, 0), ("B", 2, 1), ("B", 1, 2)]


# The tiny GPT's (this file's CFG) peaks per rank measured on 4 gloo processes, AdamW (docs/auto.md,
# "The backward frees its saved values": tools/auto_measure.py, 2026-12-02 04:40-04:44 UTC: saved
# values freed after their last reader, DDP's gradient buckets kept between steps and counted as
# held, FSDP's gathers and reduce-scatters by block), MiB
MEASURED_PEAKS = {"dp4": 4.48, "dp4 fsdp": 2.05, "tp4 megatron": 1.77, "dp2 tp2 megatron": 2.53,
                  "pp2 dp2 microbatches=2 schedule=1f1b": 3.26, "tp4 megatron-sp": 1.71, "dp2 tp2 megatron fsdp": 1.71}


def test_predicted_memory_is_within_15_percent_of_the_measured_peaks(choice):
    """The planner's memory per rank against the peaks measured for the same candidates (the
    issue asks 15 %; 0.87-1.12 now: pp2 dp2 is under-predicted since the gradient buckets are
    kept, dp2 tp2 megatron fsdp over-predicted since FSDP gathers by block, neither's fullest
    moment examined, docs/auto.md). Counting views as bytes of their own
    gave tp4 megatron 1.23; freeing saved activations in the backward gave dp2 tp2 megatron fsdp
    0.87; holding the backward's saved activations to its end, once the runtime frees each after
    its last reader, gave 1.05-1.22 (tp4 megatron 1.22, dp2 tp2 megatron 1.20)."""
    by_text = {c.candidate.text(): c for c in choice.ranked}
    ratios = {t: by_text[t].total_memory / (m * 2**20) for t, m in MEASURED_PEAKS.items()}
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios


def test_a_budget_below_the_measured_peak_refuses_it(choice):
    """dp4's peak measured 4.48 MiB a rank on 4 gloo processes (docs/auto.md, AdamW; the model
    4.53): under a 4.4 MiB budget dp4 is over it and the choice is one that fits (dp4 fsdp:
    2.05 MiB measured). Without the runtime's buffers the model had missed dp4's peak by 15 %
    and chosen it under a budget it did not fit (docs/auto.md, 2026-11-27)."""
    tight = choice.within(4.4 * 2**20)
    assert choice.best.candidate.text() == "dp4" and tight.best.candidate.text() != "dp4"
    assert tight.best.total_memory <= 4.4 * 2**20
    assert any(r.candidate.text() == "dp4" and "over by" in r.why for r in tight.over_budget)


def test_a_budget_rules_out_what_does_not_fit(choice):
    """A budget just under the unconstrained choice's memory: another candidate is chosen, it fits,
    and the old choice is listed as over the budget, by how much."""
    was = choice.best
    budget = was.total_memory * 0.99
    tight = choice.within(budget)  # what search(..., memory=budget) ranks, from the candidates already costed
    assert tight.best.total_memory <= budget and tight.best.candidate != was.candidate
    over = {r.candidate: r.why for r in tight.over_budget}
    assert was.candidate in over and "over by" in over[was.candidate]
    assert "over the memory budget" in tight.as_text()
    with pytest.raises(AutoError, match="no plan fits 1.00 KB a device: the smallest needs"):
        choice.within("1KB")


def test_bad_input_is_refused_before_any_tracing(monkeypatch):
    """Unknown machines, budgets that are not sizes, a budget nothing fits (the smallest plan's
    need named: its weights, gradients and Adam state over the 4 devices), a device count no layout
    takes (each axis's reason named), and a mesh instead of a count: refused before anything is traced."""
    from nvtp.auto import sample

    def no_tracing(*a, **k):
        raise AssertionError("traced before refusing")

    monkeypatch.setattr(sample, "take", no_tracing)
    model, args = _model(), gpt.example_tokens(CFG)
    with pytest.raises(AutoError, match="unknown machine 'a100'.*'h100-nvlink'"):
        search(model, args, devices=4, machine="a100")
    with pytest.raises(AutoError, match="'80GB'"):
        search(model, args, devices=4, memory="lots")
    elements = sum(p.numel() for p in model.parameters())
    least = elements * (4 + 4 + 8) / 4  # fp32 weights, gradients, Adam's two moments, split 4 ways
    with pytest.raises(AutoError, match=f"no plan fits 1.00 KB a device: even the most split plan holds {size_text(least)}"):
        search(model, args, devices=4, memory="1KB")
    with pytest.raises(AutoError, match="no layout of 5 devices") as e:
        search(model, args, devices=5)
    for reason in ("the batch of 8 rows does not split over dp=5", "pp=5 stages, but the model has 4 block",
                   "tp=5 divides no dimension", "does not split into the balanced layout"):
        assert reason in str(e.value), (reason, str(e.value))
    with pytest.raises(AutoError, match="pass mesh=N"):
        nvtp.plan(model, *args, plan="auto", mesh=(2, 2))
    with pytest.raises(AutoError, match="leave out fsdp=True"):
        nvtp.plan(model, *args, plan="auto", mesh=4, fsdp=True)
    with pytest.raises(InputError, match="leave out fsdp=True"):
        nvtp.jit(model, plan="auto", fsdp=True)
    with pytest.raises(InputError, match="memory= are what plan='auto' plans for"):
        nvtp.jit(model, plan="megatron", memory="80GB")


@pytest.mark.parametrize("fails", ["budget", "bug"])
def test_rank_0s_planning_failure_is_raised_on_every_rank(monkeypatch, fails):
    """On a world of 2 (the exchange simulated: rank 0 runs first, what it sends is what rank 1
    receives), rank 0's search fails; every rank raises the same error (class and message): the
    budget nothing fits as rank 0's AutoError, a failure of nvtp's own as a RankFailure naming it.
    Rank 1 never searches, and receives no choice to wait for."""
    from nvtp.auto import runtime
    from nvtp.errors import RankFailure

    sent, searched = [], []
    real = runtime.search  # the planner, as AutoModule calls it

    def search_on(rank):
        def run(*a, **k):
            searched.append(rank)
            if fails == "bug":
                raise RuntimeError("boom")
            return real(*a, **k)
        return run

    def broadcast(payload):
        if not sent:
            sent.append(list(payload))
        return list(sent[0])

    monkeypatch.setattr(runtime, "_broadcast", broadcast)
    errors = []
    for rank in (0, 1):
        m = nvtp.jit(_model(), plan="auto", memory="1KB")
        m.world, m.rank, m.devices = 2, rank, 2  # as torch.distributed's world of 2 would set them
        monkeypatch.setattr(runtime, "search", search_on(rank))
        with pytest.raises(Exception) as e:
            m(*gpt.example_tokens(CFG))
        errors.append(e.value)
    assert searched == [0]
    want = (AutoError, "no plan fits 1.00 KB a device") if fails == "budget" else (RankFailure, "rank 0 failed while planning plan='auto': RuntimeError: boom")
    for e in errors:
        assert type(e) is want[0] and str(e).startswith(want[1]), (type(e), str(e))
    assert str(errors[0]) == str(errors[1])
    assert "every rank raises this error" in "".join(getattr(errors[1], "__notes__", []))


def _train(ranks, threads, whole, steps=3):
    """3 SGD steps on every simulated rank (each passing the whole batch) and on one eager copy."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ranks]

    def step(r):
        opts[r].zero_grad()
        loss = _loss(ranks[r](*whole))
        loss.backward()
        opts[r].step()
        return loss.item()
    return [spmd.on_threads(step, threads) for _ in range(steps)]


@pytest.mark.parametrize("which", ["chosen", pytest.param("dp2-tp2-megatron-fsdp", marks=pytest.mark.slow)])
def test_the_choice_trains_like_one_process_on_simulated_ranks(choice, which):
    """Every rank passes the same whole batch; nvtp takes each data-parallel rank's rows; after 3
    SGD steps the losses and every weight (reassembled) are eager PyTorch's on one process."""
    c = choice.candidate if which == "chosen" else Candidate.of({"dp": 2, "tp": 2}, {"plan": "megatron", "fsdp": True,
                                                                                       "collective_matmul": False})
    assert not c.pipelined  # a pipeline runs on processes (the slow test below)
    model, whole = _model(), gpt.example_tokens(CFG)
    ref = copy.deepcopy(model)
    ranks, threads = simulated(model, c, *whole)
    losses = _train(ranks, threads, whole)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for got in losses:
        ref_opt.zero_grad()
        want = _loss(ref(*whole))
        want.backward()
        ref_opt.step()
        assert all(abs(a - want.item()) <= 1e-5 * abs(want.item()) for a in got), (got, want.item())
    mesh = c.mesh()
    for name, p in ref.named_parameters():
        placement = ranks[0].inner.placement(name)
        placement = placement if isinstance(placement, tuple) else (placement,)
        parts = [dict(m.inner.module.named_parameters())[name].detach() for m in ranks]
        whole_p = spmd.assemble(parts, placement, p.shape, mesh)
        assert (whole_p - p.detach()).abs().max().item() <= 1e-5, name


def _cli(*argv, timeout=600):
    return subprocess.run([sys.executable, "-m", "nvtp", "explain", *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


MODEL = ["--model", "nanogpt", "--config", "tiny", "--layers", "4", "--batch", "8", "--machine", "cpu-gloo"]


@pytest.mark.slow
def test_cli_explains_plan_auto_as_typed():
    """``nvtp explain --plan auto --devices 4 --model nanogpt ...`` prints the choice and the ranked
    table, and with --json the same as one object."""
    r = _cli("--plan", "auto", "--devices", "4", *MODEL)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("plan auto for GPT tiny (4 layers") and "\nchosen: " in r.stdout and "why not chosen" in r.stdout
    r = _cli("--plan", "auto", "--devices", "4", *MODEL, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["facts"]["devices"] == 4 and got["facts"]["machine"] == "cpu-gloo" and got["facts"]["batch"] == 8
    assert got["ranked"][0]["text"] == got["chosen"]["text"]
    assert [c["seconds"] for c in got["ranked"]] == sorted(c["seconds"] for c in got["ranked"])


def test_cli_refuses_bad_input_for_plan_auto_before_tracing():
    """Bad input to ``nvtp explain --plan auto`` exits with a one-line reason, no traceback."""
    model = MODEL
    r = _cli("--plan", "auto", "--devices", "4", *model, "--memory", "1KB")
    assert r.returncode == EXIT_BAD_INPUT and "no plan fits 1.00 KB a device" in r.stderr and "Traceback" not in r.stderr
    r = _cli("--plan", "auto", "--mesh", "2x2", *model)
    assert r.returncode == EXIT_USAGE and "leave out --mesh" in r.stderr
    r = _cli("--plan", "megatron", "--devices", "2", *model, "--memory", "80GB")
    assert r.returncode == EXIT_USAGE and "--memory 80GB is the budget --plan auto plans for" in r.stderr


def _gloo_worker(rank, world, init_method, out):
    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    model = _model()
    sm = nvtp.jit(model, plan="auto", mesh=world)  # the user's loop: the same whole batch on every rank
    opt = torch.optim.SGD(sm.parameters(), lr=0.1)
    whole = gpt.example_tokens(CFG)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = _loss(sm(*whole))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {n: nvtp.full_tensor(p).detach() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"losses": losses, "params": params, "chosen": sm.candidate.text(), "table": sm.choice.as_text()}, out)


@pytest.mark.slow
def test_plan_auto_trains_like_one_process_on_4_gloo_processes(tmp_path):
    """``nvtp.jit(model, plan="auto", mesh=4)`` on 4 gloo processes: losses and weights after 3 SGD
    steps are eager PyTorch's on one process with the whole batch."""
    from nvtp.execute.launch import spawn

    out = tmp_path / "auto.pt"
    assert spawn(_gloo_worker, 4, str(out)) == [0, 0, 0, 0]
    got = torch.load(out, weights_only=False)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    whole = gpt.example_tokens(CFG)
    for loss in got["losses"]:
        opt.zero_grad()
        want = _loss(ref(*whole))
        want.backward()
        opt.step()
        assert abs(loss - want.item()) <= 1e-5 * abs(want.item()), (loss, want.item(), got["chosen"])
    for name, p in ref.named_parameters():
        assert (got["params"][name] - p.detach()).abs().max().item() <= 1e-5, (name, got["chosen"])


def _failing_worker(rank, world, init_method, out):
    from nvtp.auto import runtime
    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    runtime.PLAN_TIMEOUT_S = 120.0  # a rank left waiting for a plan fails in 2 minutes here, not an hour
    sm = nvtp.jit(_model(), plan="auto", mesh=world, memory="1KB")  # rank 0's search finds nothing fits
    start = time.monotonic()
    try:
        sm(*gpt.example_tokens(CFG))
        got = ("no error", "")
    except Exception as e:
        got = (type(e).__name__, str(e))
    torch.save({"error": got, "seconds": time.monotonic() - start}, f"{out}.{rank}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rank_0s_planning_failure_reaches_every_gloo_process(tmp_path):
    """``nvtp.jit(model, plan="auto", mesh=4, memory="1KB")`` on 4 gloo processes: rank 0's search
    refuses the budget, and every rank raises the same AutoError at once (none waits for a plan)."""
    from nvtp.execute.launch import spawn

    out = tmp_path / "failed"
    assert spawn(_failing_worker, 4, str(out)) == [0, 0, 0, 0]
    got = [torch.load(f"{out}.{r}") for r in range(4)]
    assert all(g["error"] == got[0]["error"] for g in got), [g["error"] for g in got]
    assert got[0]["error"][0] == "AutoError" and got[0]["error"][1].startswith("no plan fits 1.00 KB a device"), got[0]["error"]
    assert max(g["seconds"] for g in got) < 100, [g["seconds"] for g in got]  # under the wait's 120 s: nobody timed out


LLAMA_DP = ["dp4", "dp4 fsdp", "dp2 tp2 megatron fsdp", "dp2 tp2 megatron-sp fsdp", "dp2 cp2 fsdp"]


def _llama_worker(rank, world, init_method, out, candidates):

    from nvtp.auto.runtime import AutoModule
    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    tool = _measure_tool()
    cfg = tool._cfg(argparse.Namespace(family="llama", layers=4, hidden=None, batch=8, config="tiny"))
    whole, kw = tool._call(cfg)
    got = {}
    for text, extents, options in candidates:
        sm = AutoModule(tool._model(cfg), world, candidate=Candidate(tuple(extents), tuple(options)), timeout=300.0)
        opt = torch.optim.SGD(sm.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = sm(*whole, **kw).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        got[text] = losses
    return workers.finish(got, out, world)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_planners_data_parallel_candidates_for_a_llama_train_like_one_process(tmp_path):
    """A transformers Llama (tiny config, 4 layers, batch 8): the data-parallel layouts the planner
    offers on 4 devices, one per layout (DDP, FSDP, with Megatron, Megatron-SP or cp), each run
    as ``nvtp.jit(plan="auto")`` runs its choice on 4 gloo processes: every rank's losses over 3
    SGD steps are eager PyTorch's on one process (each step's loss reads the weights the earlier
    gradients made). These candidates failed at run time before 345125c (the unused logits' zero
    gradient made for the whole batch)."""
    from nvtp.execute.launch import spawn

    tool = _measure_tool()
    cfg = tool._cfg(argparse.Namespace(family="llama", layers=4, hidden=None, batch=8, config="tiny"))
    whole, kw = tool._call(cfg)
    choice = search(tool._model(cfg), whole, kw, devices=4)
    offered = {c.candidate.text(): c.candidate for c in choice.ranked}
    assert set(LLAMA_DP) <= set(offered), sorted(offered)
    out = tmp_path / "llama.pt"
    candidates = [(t, list(offered[t].extents), list(offered[t].options)) for t in LLAMA_DP]
    assert list(spawn(_llama_worker, 4, str(out), candidates)) == [0, 0, 0, 0]
    ranks = torch.load(out, weights_only=False)
    ref = tool._model(cfg)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = ref(*whole, **kw).loss
        loss.backward()
        opt.step()
        want.append(loss.item())
    for got in ranks:
        for text in LLAMA_DP:
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got[text], want)), (text, got[text], want)

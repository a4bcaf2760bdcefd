"""One compiler: every entry point goes through the compile driver, and what is planned is what runs.

* No module but the driver (``nvtp/driver.py``) calls the tracers or the sharding passes: the
  entry points (nvtp.jit, nvtp.plan / explain, shard, replay, dump, demo), the benchmarks and the
  tools ask the driver (checked on the source, so a new entry point that traces or shards on its
  own fails here).
* The collectives one ``nvtp.jit`` training step issues, counted at run time on each rank (kind,
  mesh axis, bytes each rank sends), equal ``nvtp.plan``'s for the same model, mesh and backend,
  in order; so do the parameter bytes each rank holds: nvtp's GPT, a transformers GPT-2 and a
  transformers Llama on 1-D meshes and on a (2, 2) mesh with FSDP (simulated ranks, threads of
  this process), and nvtp's GPT on real gloo processes counted with torch's ``CommDebugMode``
  (slow tier).
"""

from __future__ import annotations

import ast
import copy
import sys
from pathlib import Path

import pytest
import torch

import nvtp
from nvtp.execute import spmd
from nvtp.execute.collectives import on_axis
from nvtp.models import gpt
from nvtp.sharding.placements import DeviceMesh

ROOT = Path(__file__).resolve().parents[1]

# The tracers and the sharding passes: only the driver may call them (the modules that define
# them, and the passes calling each other, are their own business).
TRACERS_AND_PASSES = {
    "nvtp.frontend.capture": {"capture"},
    "nvtp.frontend.regional": {"capture_regional", "capture_template"},
    "nvtp.frontend.splice": {"splice"},
    "nvtp.frontend.fx": {"trace", "export_program", "export_graph"},
    "nvtp.frontend.fx_regional": {"trace"},
    "nvtp.sharding.passes": {"shard", "shard_pair", "shard_backward"},
}
OWNERS = {"nvtp/driver.py", "nvtp/frontend/capture.py", "nvtp/frontend/regional.py", "nvtp/frontend/fx.py", "nvtp/frontend/fx_regional.py",
          "nvtp/sharding/passes.py", "nvtp/sharding/axes/tp.py", "nvtp/sharding/axes/dp.py", "nvtp/sharding/axes/cp.py",
          "nvtp/sharding/axes/ep.py",  # the axis strategies: their passes run in the driver's loop
          # measures the one-block splice against the three-block one by patching the tracer the driver calls
          "tools/jit_depth.py"}


def _calls_of_tracers(path: Path) -> list[str]:
    """``module.name`` of every tracer or pass ``path`` imports (``from m import n``, or ``m.n`` after ``import m``)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in TRACERS_AND_PASSES:
            found += [f"{node.module}.{a.name}" for a in node.names if a.name in TRACERS_AND_PASSES[node.module]]
        if isinstance(node, ast.ImportFrom) and node.module and f"{node.module}." in {f"{m.rsplit('.', 1)[0]}." for m in TRACERS_AND_PASSES}:
            for a in node.names:  # from nvtp.frontend import fx; then fx.trace(...)
                full = f"{node.module}.{a.name}"
                if full in TRACERS_AND_PASSES:
                    alias = a.asname or a.name
                    found += [f"{full}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                              and isinstance(n.value, ast.Name) and n.value.id == alias and n.attr in TRACERS_AND_PASSES[full]]
    return found


def test_only_the_driver_traces_or_shards():
    offenders = {}
    for folder in ("nvtp", "benchmarks", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in OWNERS:
                continue
            calls = _calls_of_tracers(path)
            if calls:
                offenders[rel] = calls
    assert not offenders, f"trace or shard only through nvtp.driver (trace / shard / compile); these call the passes directly: {offenders}"


def test_the_static_check_sees_a_direct_call(tmp_path):
    """The check above would catch an entry point sharding on its own (both import spellings)."""
    bad = tmp_path / "entry.py"
    bad.write_text("from nvtp.sharding.passes import shard_pair\nfrom nvtp.frontend import fx\nx = fx.trace\n")
    assert _calls_of_tracers(bad) == ["nvtp.sharding.passes.shard_pair", "nvtp.frontend.fx.trace"]


def _tracers_and_passes() -> dict:
    """The code object of each tracer and pass -> its name: what a call is recognised by, whatever
    name or alias the caller holds it under."""
    import importlib

    out = {}
    for module, names in TRACERS_AND_PASSES.items():
        m = importlib.import_module(module)
        for name in names:
            fn = getattr(m, name, None)
            if fn is not None:
                out[fn.__code__] = f"{module}.{name}"
    return out


class _Callers:
    """Records every call of a tracer or pass whose Python stack holds no frame of nvtp/driver.py
    (``sys.monitoring``'s PY_START on those functions' code only, on every thread: the rest of the
    program runs unobserved, at full speed)."""

    def __init__(self):
        self.codes = _tracers_and_passes()
        self.outside: list[str] = []
        self.seen: set[str] = set()

    def __call__(self, code, offset):
        name = self.codes[code]
        self.seen.add(name)
        frame = sys._getframe(1)  # the frame of the function starting
        f = frame.f_back
        while f is not None and not f.f_code.co_filename.replace("\\", "/").endswith("nvtp/driver.py"):
            f = f.f_back
        if f is None:
            caller = frame.f_back.f_code
            self.outside.append(f"{name} called from {caller.co_filename}:{caller.co_name}")

    def __enter__(self):
        mon = sys.monitoring
        self.tool = next(t for t in range(6) if mon.get_tool(t) is None)
        mon.use_tool_id(self.tool, "nvtp-driver-calls")
        mon.register_callback(self.tool, mon.events.PY_START, self)
        for code in self.codes:
            mon.set_local_events(self.tool, code, mon.events.PY_START)
        return self

    def __exit__(self, *exc):
        mon = sys.monitoring
        for code in self.codes:
            mon.set_local_events(self.tool, code, 0)
        mon.register_callback(self.tool, mon.events.PY_START, None)
        mon.free_tool_id(self.tool)


def test_every_trace_and_pass_runs_under_the_driver_whatever_name_calls_it():
    """Structural, on calls: each entry point a user has (nvtp.jit, nvtp.plan, the Thunder transform,
    the CLI on a dump) traces and shards only through nvtp/driver.py's frames."""
    import thunder

    from nvtp.cli import main

    torch.manual_seed(0)
    block, x = gpt.Block(gpt.config("tiny")), gpt.example_input(gpt.config("tiny"))
    with _Callers() as callers:
        nvtp.jit(copy.deepcopy(block), mesh=1)(x).sum().backward()
        nvtp.plan(copy.deepcopy(block), x, devices=2)
        thunder.jit(copy.deepcopy(block), transforms=[nvtp.ShardingTransform("megatron", mesh=1)])(x)
        assert main(["explain", str(ROOT / "fusions" / "nanogpt_gpt2_bf16_fwd.py"), "--plan", "megatron", "--devices", "2"]) == 0
    assert not callers.outside, callers.outside
    assert {"nvtp.frontend.capture.capture", "nvtp.sharding.passes.shard"} <= callers.seen, callers.seen  # the check saw them run


def test_the_call_check_catches_a_pass_called_by_an_alias_outside_the_driver():
    from nvtp.sharding import passes as p

    shard_it = p.shard  # an alias the source check could not follow
    from nvtp.ir.parser import load

    fusion = load(ROOT / "fusions" / "nanogpt_gpt2_bf16_fwd.py").fusion
    with _Callers() as callers:
        shard_it(fusion, "megatron", DeviceMesh.of_size(2))
    assert callers.outside and callers.outside[0].startswith("nvtp.sharding.passes.shard called from"), callers.outside


# -- what is planned is what runs ------------------------------------------------------------------


class Counting:
    """A rank's collectives on one mesh axis, recorded as (kind, axis, bytes this rank sends with ring algorithms)."""

    def __init__(self, inner, axis: str, log: list):
        self.inner, self.axis, self.log = inner, axis, log
        self.rank, self.size = inner.rank, inner.size

    def all_reduce(self, t, op):
        self.log.append(("allreduce", self.axis, round(2 * (self.size - 1) / self.size * t.nbytes)))
        return self.inner.all_reduce(t, op)

    def all_gather(self, t):
        self.log.append(("allgather", self.axis, (self.size - 1) * t.nbytes))
        return self.inner.all_gather(t)

    def reduce_scatter(self, chunks, op):
        self.log.append(("reduce_scatter", self.axis, round((self.size - 1) / self.size * sum(c.nbytes for c in chunks))))
        return self.inner.reduce_scatter(chunks, op)


def _counting(comm, mesh: DeviceMesh, log: list):
    if mesh.ndim == 1:
        return Counting(comm, mesh.names[0], log)
    from nvtp.execute.collectives import MeshComm

    return MeshComm(comm.rank, comm.size, [Counting(on_axis(comm, a), mesh.names[a], log) for a in range(mesh.ndim)])


def _local_bytes(module: torch.nn.Module) -> int:
    from nvtp.dtensor import local

    seen, n = set(), 0
    for p in module.parameters():  # each tied parameter once
        if id(p) not in seen:
            seen.add(id(p))
            n += local(p).nbytes
    return n


def run_and_count(model: torch.nn.Module, mesh: DeviceMesh, plan: str, args: tuple, kwargs: dict, fsdp: bool = False,
                  loss_of=lambda out: out):
    """One training step (forward, backward) of ``nvtp.jit(model)`` on every rank of a simulated
    mesh; returns rank 0's collectives, rank 0's parameter bytes and the program it ran."""
    threads = spmd.ThreadMesh(mesh, timeout=120)
    logs = [[] for _ in range(mesh.size)]
    # verify=False: the first call's check (nvtp/guard.py) gathers weights and outcomes beside the
    # program; what is counted here is the program's own step
    ranks = [nvtp.jit(copy.deepcopy(model), plan=plan, mesh=mesh, comm=_counting(threads.comm(r), mesh, logs[r]), fsdp=fsdp,
                      verify=False) for r in range(mesh.size)]
    ranks[0].compile(*args, **kwargs)
    for m in ranks[1:]:
        m.share_compiled(ranks[0])

    def step(r):
        loss_of(ranks[r](*args, **kwargs)).backward()

    spmd.on_threads(step, threads)
    assert all(log == logs[0] for log in logs[1:]) or mesh.ndim > 1  # 1-D: every rank runs the same collectives
    return logs[0], _local_bytes(ranks[0].module), ranks[0].last


def assert_plan_is_run(report, ran, held, program):
    """The collectives the step ran, in order, are the plan's as issued (one per bucket of the
    schedule), and their tensors are the plan's communications, byte for byte."""
    planned = [(c["kind"], c["axis"], c["bytes"]) for c in report.collectives()]
    assert ran == planned, f"planned {len(planned)} collectives, ran {len(ran)}:\nplanned {planned}\nran     {ran}"
    assert [(c["kind"], c["axis"], c["bytes"]) for c in program.collectives()] == planned
    per_tensor = sorted((s.kind, s.axis) for s in program.communications())
    assert sorted((c["kind"], c["axis"]) for c in program.collectives() for _ in c["tensors"]) == per_tensor
    assert sum(b for _, _, b in ran) == sum(c["bytes"] for c in report.communications())
    assert report.memory_per_rank()["parameters"] == held
    assert len(ran) > 0


GPT_CFG = gpt.config("tiny")


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(GPT_CFG)


@pytest.mark.parametrize("plan", [pytest.param("megatron", marks=pytest.mark.slow), "megatron-sp"])
def test_gpt_plan_equals_the_run_on_4_ranks(plan):
    model = _gpt()
    idx, tgt = gpt.example_tokens(GPT_CFG)
    report = nvtp.plan(model, idx, tgt, plan=plan, devices=4)
    ran, held, program = run_and_count(model, DeviceMesh.of_size(4), plan, (idx, tgt), {})
    assert report.backend == program.backend == "reference"
    assert_plan_is_run(report, ran, held, program)


def test_gpt_plan_equals_the_run_on_a_2x2_fsdp_mesh():
    model = _gpt()
    idx, tgt = gpt.example_tokens(GPT_CFG)
    idx, tgt = idx[:1], tgt[:1]  # one rank's batch
    report = nvtp.plan(model, idx, tgt, plan="megatron", mesh=(2, 2), fsdp=True)
    ran, held, program = run_and_count(model, DeviceMesh.of_shape((2, 2), ("dp", "tp")), "megatron", (idx, tgt), {}, fsdp=True)
    assert {c["axis"] for c in report.communications()} == {"dp", "tp"}
    assert_plan_is_run(report, ran, held, program)


def test_the_planned_backend_changes_the_program_and_is_printed():
    """nvFuser's target keeps embedding tables whole (no vocabulary-parallel lookup), the
    reference backend's splits them: plan for the backend that runs."""
    model = _gpt()
    idx, tgt = gpt.example_tokens(GPT_CFG)
    ref = nvtp.plan(model, idx, tgt, plan="megatron", devices=4)
    nvf = nvtp.plan(model, idx, tgt, plan="megatron", devices=4, backend="nvfuser")
    shard = {r.backend: r.as_json()["regions"][0]["shardings"]["wte.weight"] for r in (ref, nvf)}
    assert shard == {"reference": "S(0)", "nvfuser": "replicated"}
    assert "for the reference backend" in ref.as_text().splitlines()[0]
    assert nvf.as_json()["backend"] == "nvfuser"


@pytest.mark.parametrize("family", [pytest.param("gpt2", marks=pytest.mark.slow), "llama"])
def test_transformers_plan_equals_the_run(family):
    pytest.importorskip("transformers", reason="transformers is not installed (uv sync installs the dev group)")
    from tests.test_hf import build, tokens

    model = build(family)
    ids = tokens()
    report = nvtp.plan(model, ids, labels=ids, plan="megatron", devices=2)
    ran, held, program = run_and_count(model, DeviceMesh.of_size(2), "megatron", (ids,), {"labels": ids},
                                       loss_of=lambda out: out.loss)
    assert program.traced.route == "fx"
    assert_plan_is_run(report, ran, held, program)


def test_plan_of_a_tied_model_counts_the_tied_weight_once():
    """A head tied to the embedding is one parameter: the memory per rank counts it once."""
    from tests.blocks import TiedGPT

    torch.manual_seed(0)
    tied = TiedGPT(tie=True)
    untied = TiedGPT(tie=False)
    idx = torch.randint(0, 64, (2, 8))
    a = nvtp.plan(tied, idx, devices=2, plan="replicate").memory_per_rank()["parameters"]
    b = nvtp.plan(untied, idx, devices=2, plan="replicate").memory_per_rank()["parameters"]
    head = untied.head.weight.nbytes
    assert b - a == head, (a, b, head)


# -- the backend seam ------------------------------------------------------------------------------


def test_asking_for_nvfuser_without_a_gpu_is_refused_before_any_work():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: nvFuser can run here")
    from nvtp.errors import InputError

    with pytest.raises(InputError, match=r"backend='nvfuser' runs nvFuser's kernels on CUDA GPUs, and torch sees none .*"
                                          r"backend='reference' \(or 'auto'\)"):
        nvtp.jit(_gpt(), backend="nvfuser")
    with pytest.raises(InputError, match="unknown backend 'nvfusr'; choose one of 'auto', 'reference', 'nvfuser'"):
        nvtp.jit(_gpt(), backend="nvfusr")
    assert nvtp.jit(_gpt()).backend == "reference"  # auto on a CPU model


def test_the_nvfuser_program_of_a_jit_model_builds_from_its_text(tmp_path):
    """What the nvFuser backend runs for each rank, written as nvFuser's own files and built by
    nvfuser_direct from the text (no GPU needed to build), for 1 and 2 devices."""
    from nvtp import driver
    from nvtp.execute.nvfuser import build_from_text, compare_definition
    from nvtp.ir.parser import parse

    model = _gpt()
    idx, tgt = gpt.example_tokens(GPT_CFG)
    for d in (1, 2):
        program = driver.compile(model, idx, tgt, plan="megatron", mesh=d, backend="nvfuser")
        paths = program.write_nvfuser(tmp_path / f"d{d}")
        assert [p.name for p in paths] == ["program_fwd.py", "program_bwd.py"]
        for path, sharded in zip(paths, (program.forward, program.backward)):
            text = path.read_text()
            assert f"plan megatron over {d} devices" in text
            fd = build_from_text(text, str(path))
            assert compare_definition(parse(text, str(path)).fusion, fd) == []
            assert text.count("fd.ops.set(") == sum(1 for op in sharded.fusion.ops if op.kind == "set")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvFuser executes on CUDA GPUs; this machine has none")
def test_jit_on_nvfuser_trains_like_eager():
    """nvtp.jit(model, backend="nvfuser") on one GPU: 3 SGD steps of the tiny GPT (fp32, no
    dropout) give eager's losses within 1e-4 and its parameters within 1e-4."""
    cfg = gpt.config("tiny", dropout=0.0)
    torch.manual_seed(0)
    eager = gpt.GPT(cfg).cuda()
    model = nvtp.jit(copy.deepcopy(eager), backend="nvfuser")
    assert model.backend == "nvfuser"
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    idx, tgt = (t.cuda() for t in gpt.example_tokens(cfg))
    for _ in range(3):
        losses = []
        for m, opt in zip((model, eager), opts):
            loss = m(idx, tgt)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-4 * abs(losses[1]), losses
    for a, b in zip(model.module.parameters(), eager.parameters()):
        assert (a.detach() - b.detach()).abs().max().item() <= 1e-4


def _comm_debug_worker(rank, world, init_method, out):
    from torch.distributed.tensor.debug import CommDebugMode

    from nvtp.execute.launch import init_group

    init_group(rank, world, init_method)
    model = nvtp.jit(_gpt(), plan="megatron")
    idx, tgt = gpt.example_tokens(GPT_CFG)
    model(idx, tgt).backward()  # the first step compiles (and checks its arguments)
    with CommDebugMode() as counted:
        model(idx, tgt).backward()
    if rank == 0:
        torch.save({str(k): v for k, v in counted.get_comm_counts().items()}, out)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


@pytest.mark.slow
def test_a_training_step_on_processes_issues_the_planned_collectives(tmp_path):
    """On 2 gloo processes, torch's CommDebugMode counts the collectives of one training step of
    nvtp.jit's GPT: they are nvtp.plan's, kind by kind."""
    from nvtp.execute.launch import spawn

    out = tmp_path / "counts.pt"
    assert spawn(_comm_debug_worker, 2, str(out)) == [0, 0]
    counted = torch.load(out)
    idx, tgt = gpt.example_tokens(GPT_CFG)
    planned = [c["kind"] for c in nvtp.plan(_gpt(), idx, tgt, plan="megatron", devices=2).collectives()]
    names = {"allreduce": "c10d.allreduce_", "allgather": "c10d.allgather_", "reduce_scatter": "c10d.reduce_scatter_"}
    want = {names[k]: planned.count(k) for k in set(planned)}
    assert {k: v for k, v in counted.items() if v} == want, (counted, want)


def test_plan_and_jit_refuse_an_undividable_head_count_in_the_same_words():
    """One driver, one validation: the message a user gets does not depend on the entry point."""
    from nvtp.execute.collectives import ThreadComm, ThreadGroup
    from nvtp.sharding.propagate import ShardingError

    cfg = gpt.config("tiny", n_embd=48, n_head=3)
    model = gpt.GPT(cfg)
    idx, tgt = gpt.example_tokens(cfg)
    with pytest.raises(ShardingError) as planned:
        nvtp.plan(model, idx, tgt, devices=2)
    with pytest.raises(ShardingError) as jitted:
        nvtp.jit(model, mesh=DeviceMesh.of_size(2), comm=ThreadComm(ThreadGroup(2), 0)).compile(idx, tgt)
    assert str(planned.value) == str(jitted.value)
    assert "2 devices do not divide the outer 3 (attention heads" in str(planned.value)


def test_a_misspelt_plan_is_refused_before_anything_is_traced(monkeypatch, capsys):
    from nvtp import cli, driver, explain
    from nvtp.sharding.propagate import ShardingError

    def must_not_trace(*a, **k):
        raise AssertionError("traced before the plan was checked")

    monkeypatch.setattr(driver, "trace", must_not_trace)
    monkeypatch.setattr(explain, "_trace_gpt", must_not_trace)
    idx, tgt = gpt.example_tokens(GPT_CFG)
    with pytest.raises(ShardingError, match="unknown plan 'megatorn'"):
        nvtp.plan(_gpt(), idx, tgt, plan="megatorn")
    code = cli.main(["explain", "--model", "nanogpt", "--config", "gpt3", "--layers", "96", "--plan", "megatorn", "--devices", "8"])
    err = capsys.readouterr().err
    assert code == 3 and "unknown plan 'megatorn'" in err, err


def test_writing_nvfuser_files_of_a_program_sharded_for_the_reference_target_says_what_to_plan_for(tmp_path):
    """A reference-target program may hold placements nvFuser's schedule cannot express (a
    partial through a reshape in the megatron-sp backward): the error names the backend to plan
    for, not the op nvFuser's schedule could not record."""
    from nvtp import driver
    from nvtp.dump import load
    from nvtp.sharding.schedule import ScheduleError
    from tests.dumps import tiny_dump

    _, bwd = tiny_dump("fp32", None)
    program = driver.compile(load(str(bwd)), plan="megatron-sp", mesh=2, backend="reference")
    with pytest.raises(ScheduleError, match=r"sharded for the reference backend's target.*backend='nvfuser'"):
        program.write_nvfuser(tmp_path)
    assert len(driver.compile(load(str(bwd)), plan="megatron-sp", mesh=2, backend="nvfuser").write_nvfuser(tmp_path)) == 2

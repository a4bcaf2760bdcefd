"""The compile driver: the one place nvtp traces and shards.

    traced = trace(model, (idx, targets))                        # Thunder (or the FX route), on meta tensors
    program = shard(traced, "megatron", make_mesh(4), "reference")  # a Program: fusions, placements, steps, bytes
    program = compile(model, idx, targets, plan="megatron", mesh=4)  # the two in one
    program = compile(dump.load("fwd.py"), plan="megatron-sp", mesh=4)  # a dump, paired with its forward

Every entry point goes through here: ``nvtp.jit`` (its first call), ``nvtp.plan`` and ``nvtp
explain``, ``nvtp shard`` and ``nvtp replay`` (a dump), ``nvtp dump`` (``trace`` alone), the demo
and the benchmarks; tests/test_driver.py fails if any other module calls the tracers or the
sharding passes. So the program a user plans is, by construction, the program that runs: the
same route, the same plan, the same placements, the same collectives, for the same backend.

Two stages, as in ``jax.stages`` (trace, then lower):

* ``trace`` picks the *route* in one place (``route``): TorchDynamo's graph then Thunder for
  transformers models (``nvtp.frontend.fx``); ``thunder.jit`` on the module for the rest, a chain
  of repeated blocks traced once and spliced (``nvtp.frontend.regional``); or a parsed dump. It
  returns a ``Traced``: the forward and backward fusions and what the module boundary is (which
  inputs are the caller's arguments, which are the module's weights).
* ``shard`` runs the passes (``nvtp.sharding.passes``) for each mesh axis by its name
  (``nvtp.mesh.roles``: the plan on "tp", the data plan on "dp"), for the facts of the backend's
  target (``nvtp.execute.backends``), and returns a ``Program`` (``nvtp.program``).

A module's boundary is whole on the model-parallel axis: its outputs and its arguments'
gradients are asked to land whole (the caller holds whole tensors); a dump has no boundary, so
its outputs stay where the plan puts them.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import time
import types
from typing import Any, Mapping
from pathlib import Path

import torch

from nvtp import fakeguard, tracecache
from nvtp.errors import InputError
from nvtp.frontend.attention import claim_flash, claim_for_ring
from nvtp.frontend.executor import rematerializing
from nvtp.frontend.parts import splitting
from nvtp.frontend.recompute import check_mode as recompute_mode, layers_of, recompute as recomputed, sequence_of
from nvtp.frontend.regional import capture_regional
from nvtp.frontend.tied import aliases, merge_tied, untie
from nvtp.gcpause import paused
from nvtp.ir.graph import Fusion, TensorValue
from nvtp.ir.parser import Dump, DumpError, load
from nvtp.mesh import make_mesh
from nvtp.pipeline.calls import loss_only
from nvtp.pipeline.program import PipelineProgram, check_pipeline
from nvtp.pipeline.stages import cut_stages
from nvtp.program import Program, join_parts
from nvtp.traced import Traced
from nvtp.sharding import axes
from nvtp.sharding.collective_matmul import check_mode, plan_rings
from nvtp.sharding.compose import compose
from nvtp.sharding.cost import MACHINES, default_machine
from nvtp.sharding.overlap import schedule_collectives
from nvtp.sharding.placements import DeviceMesh, Placement, REPLICATE
from nvtp.sharding.plans import check_plan
from nvtp.sharding.target import Target, as_target
from nvtp.frontend import fx, fx_regional, user_code
from nvtp.frontend.capture import capture

fakeguard.hold()  # on the thread that imports the driver (normally the main one): see nvtp/fakeguard.py

ROUTES = ("auto", "thunder", "fx")


# ---------------------------------------------------------------------------------------------
# trace


def route(module: torch.nn.Module, frontend: str = "auto") -> str:
    """The route a module is traced by: "fx" for transformers models and models with a weight
    computed at each call (weight_norm, a parametrization: ``user_code.reparametrized``), or when
    asked; else "thunder". Asked for "thunder" on the second kind: ``UserCodeError``."""
    if frontend not in ROUTES:
        raise ValueError(f"frontend must be one of {', '.join(map(repr, ROUTES))}, not {frontend!r}")
    if frontend == "thunder" and (refusal := user_code.thunder_refusal(module, "leave frontend out (or frontend='fx'): "
                                                                      "TorchDynamo's route traces it")):
        raise refusal
    if frontend != "auto":
        return frontend
    return "fx" if fx.wants_fx(module) or user_code.reparametrized(module) else "thunder"


def meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """The module with every parameter, buffer and plain tensor attribute (``tensor_attributes``)
    on the meta device (nothing copied; ties kept)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    for t in tensor_attributes(module).values():  # module state like a buffer: traced as an input
        memo.setdefault(id(t), torch.empty(t.shape, dtype=t.dtype, device="meta"))
    copied = copy.deepcopy(module, memo)
    _rebind_closures(copied, memo)
    return copied


def _rebind_closures(copied: torch.nn.Module, memo: dict[int, Any]) -> None:
    """Functions kept as module attributes whose closures hold parts of the original module
    (minGPT's ``self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))`` over ``m =
    self.mlp``) read the copy's parts instead: ``deepcopy`` shares functions, closures and all, so
    the meta copy would otherwise call the original's (real) weights."""
    for m in copied.modules():
        for name, f in list(vars(m).items()):
            if not isinstance(f, types.FunctionType) or not f.__closure__:
                continue
            cells, changed = [], False
            for cell in f.__closure__:
                try:
                    held = cell.cell_contents
                except ValueError:  # an empty cell
                    cells.append(cell)
                    continue
                mapped = memo.get(id(held), held)
                changed |= mapped is not held
                cells.append(types.CellType(mapped) if mapped is not held else cell)
            if changed:
                g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, tuple(cells))
                g.__kwdefaults__, g.__dict__ = f.__kwdefaults__, dict(f.__dict__)
                vars(m)[name] = g


def tensor_attributes(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Path -> tensor of every plain tensor attribute (neither parameter nor buffer) of
    ``module``'s modules, such as a rotary table kept as ``self.freqs_cis``: the trace names it
    by that path, and a call passes the module's tensor as it is then."""
    found = {}
    for prefix, m in module.named_modules():
        for name, value in vars(m).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                found[f"{prefix}.{name}" if prefix else name] = value
    return found


def _meta(x: Any, batch: int) -> Any:
    """A tensor argument as a meta tensor, its leading (batch) dimension ``batch`` times as large."""
    if not isinstance(x, torch.Tensor):
        return x
    shape = (x.shape[0] * batch, *x.shape[1:]) if x.ndim else tuple(x.shape)
    return torch.empty(shape, dtype=x.dtype, device="meta", requires_grad=x.requires_grad)


def trace(module: torch.nn.Module, args: tuple = (), kwargs: Mapping[str, Any] | None = None, *, frontend: str = "auto",
          regional: bool = True, split_parts: bool = False, batch: int = 1, on_meta: bool = True,
          like: torch.nn.Module | None = None, boundary: bool = True, ring: bool = False, tie: bool = True,
          flash: bool = False, remat: bool = True) -> Traced:
    """Trace ``module`` called with ``args``/``kwargs`` into a forward and a backward fusion.

    ``module`` is traced on the meta device (a meta copy unless ``on_meta=False``: then it must
    be one already, and ``like`` the module it copies), so nothing is computed and its parameters
    are untouched. ``batch``: each
    tensor argument's leading dimension is traced ``batch`` times as large (a dp mesh: each rank
    passes its own batch, the program is the whole step's). ``split_parts``: on either route,
    fused projections with parts of different sizes become one input per part
    (``nvtp.frontend.fused``, ``nvtp.frontend.parts``). Raises ``InputError`` for arguments that do not fit the module,
    ``CaptureError`` naming the op and line nvtp cannot trace or fuse. ``boundary=False``: a
    region of a model (a block whose output is the next block's input), not its whole: outputs
    and argument gradients stay where the plan places them. ``tie=False``: a tied parameter stays
    one input per name, each use's gradient its own output (pipeline stages hold each use).
    ``ring``: for a mesh with a "cp" axis, every causal or full attention is claimed whole
    (``sdpfa_fwd``), float32 too, so that axis can run it by ring (``nvtp.sharding.axes.cp``); the
    ones declined are in ``Traced.declined``. ``flash`` (the reference backend's targets,
    ``Target.flash_attention``): attention without mask, GQA or dropout is claimed whole the same way,
    so the backward reads its output and logsumexp (``nvtp.frontend.attention.claim_flash``).
    ``remat=False``: no forward value is recomputed in the backward from others (a pipeline's
    stages: ``nvtp.frontend.executor.rematerializing``)."""
    options = dict(frontend=frontend, regional=regional, split_parts=split_parts, batch=batch, on_meta=on_meta, like=like,
                   boundary=boundary, tie=tie)
    with contextlib.nullcontext() if remat else rematerializing(False):
        if ring:
            with claim_for_ring() as declined:
                traced = _trace(module, args, kwargs, **options)
            traced.declined = list(dict.fromkeys(declined))
            return traced
        with claim_flash() if flash else contextlib.nullcontext():
            return _trace(module, args, kwargs, **options)


def _trace(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None, *, frontend: str, regional: bool,
           split_parts: bool, batch: int, on_meta: bool, like: torch.nn.Module | None, boundary: bool, tie: bool) -> Traced:
    """``trace``'s work, under whichever attention claim ``trace`` set."""
    kwargs = dict(kwargs or {})
    meta = meta_copy(module) if on_meta else module
    module = like if like is not None else module
    way = route(module, frontend)
    meta.train(module.training)
    margs = tuple(_meta(a, batch) for a in args)
    mkwargs = {k: _meta(a, batch) for k, a in kwargs.items()}
    start = time.perf_counter()
    weights = frozenset(n for n, _ in module.named_parameters(remove_duplicate=False))
    tied = aliases(module) if tie else {}
    if way == "fx":
        if not tie and on_meta:
            untie(meta)  # dynamo reads a tied weight once: one input per name from a copy untied
        if regional:  # a transformers model's decoder layers traced once, then spliced (nvtp/frontend/fx_regional.py)
            call, captured = fx_regional.trace(meta, margs, mkwargs, split_parts=split_parts)
            how = captured.regional
        else:
            call, captured = fx.trace(meta, margs, mkwargs, split_parts=split_parts)
            how = "whole trace (regional=False): dynamo's graph of the whole forward, traced by Thunder"
        forward, backward = merge_tied(captured.forward, captured.backward, tied)
        return Traced(forward, backward, "fx", how, captured, call, call.arg_names + list(call.constants), weights,
                      seconds=time.perf_counter() - start, split_parts=split_parts, tied=tied, boundary=boundary)
    if kwargs:
        raise TypeError("on Thunder's route a call's keywords are bound to positions first: driver.bind_call")

    with splitting(split_parts):  # the same split on Thunder's route (nvtp/frontend/parts.py)
        if regional:  # a deep model's repeated block traced once, then spliced (nvtp/frontend/regional.py)

            captured = capture_regional(meta, *margs)
        else:
            captured = capture(meta, *margs)
    names = _argument_names(module, len(args))
    forward, backward = merge_tied(captured.forward, captured.backward, tied)  # one input and one gradient per tied weight
    return Traced(forward, backward, "thunder", captured.regional or "thunder.jit of the whole module",
                  captured, None, names, weights, seconds=time.perf_counter() - start, split_parts=split_parts, tied=tied,
                  boundary=boundary)


def bind_call(module: torch.nn.Module, way: str, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """A call's arguments as the route traces them: positions on Thunder's route (``model(idx,
    targets=t)`` binds ``t`` to its position, defaults filled up to the last given); on the FX
    route keywords stay, with a transformers model's KV cache off (nvtp trains: ``use_cache=False``
    unless the call asks for it, which is refused)."""
    if way == "fx":  # TorchDynamo's route
        return fx.without_cache(module, args, kwargs)
    if not kwargs:
        return tuple(args), {}
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise InputError(f"{type(module).__name__}.forward: {e}") from None
    bound.apply_defaults()
    if bound.kwargs:
        raise InputError(f"{type(module).__name__}.forward: keyword-only arguments ({', '.join(bound.kwargs)}) "
                         "are not supported on the thunder.jit route; pass them positionally")
    return tuple(bound.args), {}


def _argument_names(module: torch.nn.Module, n: int) -> list[str]:
    try:
        return list(inspect.signature(module.forward).parameters)[:n]
    except (TypeError, ValueError):
        return [f"arg{i}" for i in range(n)]


def of_fusions(forward: Fusion, backward: Fusion | None = None, how: str = "") -> Traced:
    """Fusions traced already (a dump's, or a block's): no module boundary."""
    return Traced(forward, backward, "dump", how or forward.name, boundary=False)


def trace_dump(dump: Any) -> Traced:
    """A parsed dump (``nvtp.ir.parser.Dump``) as a ``Traced``: a backward file is paired with the
    forward its ``nvtp_info`` names (next to it), as a backward is sharded with its forward."""

    fusion = dump.fusion
    if fusion.attrs.get("role") != "backward":
        return of_fusions(fusion, None, dump.path or fusion.name)
    fwd_name = fusion.attrs.get("forward")
    if not fwd_name:
        raise DumpError("a backward fusion is sharded with its forward, but the file does not name one (nvtp_info 'forward')", dump.path)
    forward = load(Path(dump.path or ".").with_name(fwd_name)).fusion
    return of_fusions(forward, fusion, dump.path or fusion.name)


# ---------------------------------------------------------------------------------------------
# shard


def shard(traced: Traced, plan: str | Mapping[str, Any], mesh: DeviceMesh, backend: str | Target = "reference", *,
          fsdp: bool = False, placed: Mapping[str, Any] | None = None, overlap: bool = True,
          collective_matmul: bool | str = "auto", machine: Any = None, recompute: str = "none",
          axis_options: Mapping[str, Any] | None = None) -> Program:
    """Shard ``traced`` over ``mesh`` by ``plan`` for ``backend``'s target: one loop over the
    mesh's axis strategies (``nvtp.sharding.axes``), in their order (the plan on "tp", the data
    plan on "dp", the sequence on "cp"), forward and backward alike, each pass sharding what the
    one before it left; ``compose`` joins them. ``fsdp``: weights split over the data axis too.
    ``placed`` (label -> placement): parameters already placed by an earlier compile of the same
    module stay there. ``overlap``: schedule the collectives (``nvtp.sharding.overlap``: started
    as soon as their inputs exist, small ones bucketed, FSDP's gathers prefetched a bucket
    ahead); False: each blocks where it stands. ``collective_matmul`` (with ``overlap``): a gather
    before a matmul and a reduce-scatter after one run as ring steps beside the matmul's blocks
    (``collective_matmul.plan_rings``): "auto" where the cost model says it pays on ``machine``
    (an ``cost.Machine`` or its name; by default the backend's: ``cost.default_machine``),
    True everywhere it applies, False nowhere. ``recompute`` ("none", "selective", "block"): the
    backward recomputes activations instead of reading them (``nvtp.frontend.recompute``).
    ``axis_options``: the mesh axes' own options given (``Strategy.options``: ep's ``capacity_factor``).
    Raises ``ShardingError`` before any work when the plan or mesh does not fit."""

    traced = recomputed(traced, recompute)
    target = as_target(backend)
    order = axes.passes(mesh)
    start = time.perf_counter()
    with paused():
        for s, axis in order:
            s.check_traced(traced, mesh, axis, fsdp)
        out_hints, grad_hints = _boundary_hints(traced)
        plan_name = plan if isinstance(plan, str) else "explicit"
        run = axes.AxisPass(traced, plan, mesh, target, fsdp, _annotations(traced, placed, mesh), out_hints, grad_hints,
                            options=dict(axis_options or {}))
        for s, axis in order:
            run.done.append((axis, s.forward(run, axis)))
        forward = compose(run.done, mesh, traced.forward, plan_name)
        backward = None
        if traced.backward is not None:
            run.done = []
            for s, axis in order:
                run.done.append((axis, s.backward(run, axis, forward)))
            backward = compose(run.done, mesh, traced.backward, forward.plan)
        schedules = {}
        if overlap and mesh.size > 1:
            check_mode(collective_matmul)
            on = MACHINES[machine] if isinstance(machine, str) else machine or default_machine(target.name)
            schedules = {phase: schedule_collectives(s, rings=plan_rings(s, on, collective_matmul))
                         for phase, s in (("forward", forward), ("backward", backward)) if s is not None}
    parameters = join_parts(_placed_inputs(forward), traced.parts, mesh)
    return Program(forward, backward, mesh, plan_name, target.name, fsdp, traced.record(),
                   parameters, schedules, list(run.notes), {"trace": traced.seconds, "shard": time.perf_counter() - start})


def adopt(sharded: Any, backend: str | Target = "reference", *, overlap: bool = True) -> Program:
    """A fusion sharded already (a file with its own device schedule: ``nvtp.dump.sharded.from_dump``)
    as a Program of one phase, its collectives scheduled as every program's are: what ``nvtp
    replay`` runs through the backend."""
    traced = of_fusions(sharded.source, None, sharded.source.name)
    schedules = {"forward": schedule_collectives(sharded)} if overlap and sharded.mesh.size > 1 else {}
    return Program(sharded, None, sharded.mesh, sharded.plan, as_target(backend).name, False, traced.record(),
                   join_parts(_placed_inputs(sharded), {}, sharded.mesh), schedules, [], {})


def _annotations(traced: Traced, placed: Mapping[str, Any] | None, mesh: DeviceMesh) -> dict[str, tuple[Placement, ...]]:
    """Forward inputs that are parameters placed already (a new call shape of a compiled module),
    one placement per mesh axis."""
    out = {}
    if placed:
        f = traced.forward
        for v in f.inputs:
            label = f.label(v.name)
            if label in placed:
                p = placed[label]
                out[v.name] = p if isinstance(p, tuple) else (p,) * mesh.ndim
    return out


def _boundary_hints(traced: Traced) -> tuple[dict[str, Placement], dict[str, Placement]]:
    """(forward output hints, backward output hints): a module's outputs and its arguments'
    gradients whole on the model-parallel axis; nothing for a dump."""
    if not traced.boundary:
        return {}, {}
    f, b = traced.forward, traced.backward
    outputs = {v.name: REPLICATE for v in f.outputs if f.role(v.name) == "output"}
    grads = {} if b is None else {v.name: REPLICATE for v in b.outputs if b.grad_of(v.name) in traced.arguments}
    return outputs, grads


def _placed_inputs(forward) -> list[tuple[str, Any]]:
    """(label, placement) of each forward input: one placement on a 1-D mesh, one per axis else."""
    src = forward.source
    one = forward.mesh.ndim == 1
    return [(src.label(v.name), forward.placement(v.name) if one else forward.sharding(v.name))
            for v in src.inputs if isinstance(v, TensorValue)]


# ---------------------------------------------------------------------------------------------
# both


def compile(source: Any, *args: Any, plan: str | Mapping[str, Any] = "megatron", mesh: Any = None, backend: str | Target = "reference",
            fsdp: bool = False, frontend: str = "auto", regional: bool = True, placed: Mapping[str, Any] | None = None,
            overlap: bool = True, collective_matmul: bool | str = "auto", machine: Any = None,
            axis_options: Mapping[str, Any] | None = None, cached: Any = None, **kwargs: Any) -> Program:
    """``shard(trace(...))``: ``source`` a module called with ``args``/``kwargs`` (on a dp mesh one
    rank's batch, as ``nvtp.jit`` takes it), or a parsed dump. ``mesh``: anything ``make_mesh``
    takes. The plan is checked against the module's names before anything is traced. ``overlap``,
    ``collective_matmul``, ``machine``: the schedule's, ``axis_options`` the axes', as ``shard`` takes them.
    ``cached`` (``traced -> bool``, as ``nvtp.tracecache.trace`` takes it): the trace is kept on disk and read back."""
    schedule = dict(overlap=overlap, collective_matmul=collective_matmul, machine=machine, axis_options=axis_options)

    mesh = make_mesh(mesh, fsdp=fsdp)
    if isinstance(source, Dump):
        if isinstance(plan, str) and "=" not in plan:  # a plan name; entries naming the file's values are checked by annotate
            check_plan(plan, [])
        return shard(trace_dump(source), plan, mesh, backend, fsdp=fsdp, **schedule)
    check_plan(plan, plan_names(source), type(source).__name__)
    way = route(source, frontend)
    args, kwargs = bind_call(source, way, args, kwargs)
    options = dict(frontend=way, regional=regional, flash=as_target(backend).flash_attention, **axes.trace_options(mesh, plan))
    if cached is None:
        traced = trace(source, args, kwargs, **options)
    else:  # the options nvtp.jit traces with: the same key, the same entry
        traced = tracecache.trace(source, args, kwargs, options, lambda: trace(source, args, kwargs, **options), cached)
    return shard(traced, plan, mesh, backend, fsdp=fsdp, placed=placed, **schedule)


def compile_pipeline(source: torch.nn.Module, *args: Any, plan: str | Mapping[str, Any] = "megatron", mesh: Any = None,
                     microbatches: int = 1, schedule: str = "1f1b", cut: Any = None, backend: str | Target = "reference",
                     frontend: str = "auto", recompute: str = "none", cached: Any = None, **kwargs: Any):
    """A pipeline's program (``nvtp.pipeline.PipelineProgram``): ``source`` called with one dp
    rank's batch ``args`` on a (pp, dp, tp) ``mesh`` (``nvtp.sharding.axes.pp``), traced whole for
    one microbatch of the whole dp group (tied weights one input per name), cut into pp stages at
    block boundaries (``nvtp.pipeline.stages``: balanced by cost, or at ``cut``), and each stage
    sharded by this driver over its (dp, tp) sub-mesh, a weight tied across stages placed alike in
    both. Bad input (fewer blocks than stages, a batch the microbatches do not divide, an unknown
    schedule) is refused before anything is traced. ``recompute``: each stage's backward
    recomputes activations (``nvtp.frontend.recompute``; blocks as the whole trace knows them).
    ``cached`` (``traced -> bool``: whether the first-call check will compare the program with
    eager): the trace is kept on disk and read back where it says so (``nvtp.tracecache``)."""

    recompute_mode(recompute)

    layout, repeated, mb_args = check_pipeline(source, args, mesh, microbatches, schedule)
    check_plan(plan, plan_names(source), type(source).__name__)
    way = route(source, frontend)
    mb_args, kwargs = bind_call(source, way, mb_args, kwargs)
    # one trace for every stage, as a stage's sub-mesh asks (a stage holds each fused projection
    # whole, and a weight tied across stages as one input per name)
    options = axes.trace_options(layout.submesh(0), plan) | {"split_parts": False}
    options |= {"frontend": way, "tie": False, "remat": False}  # a stage's backward recomputes nothing of another's
    if cached is None:
        traced = trace(source, mb_args, kwargs, **options)
    else:
        traced = tracecache.trace(source, mb_args, kwargs, options | {"pipeline": True},
                                  lambda: trace(source, mb_args, kwargs, **options), cached)
    traced = loss_only(traced, type(source).__name__)  # the loss alone; an output object's .loss too (nvtp/pipeline/calls.py)
    staged = cut_stages(traced, repeated.prefix, repeated.count, layout.pp, cut)
    tied = aliases(source)
    programs, placed = [], {}
    for stage in staged.stages:
        # a weight tied across stages: every stage places its name as the first stage placed it
        same = {a: placed[n] for a, n in tied.items() if n in placed} | {n: placed[a] for a, n in tied.items() if a in placed}
        stage_traced = recomputed(stage.traced, recompute, layers_of(traced), sequence_of(traced))
        program = shard(stage_traced, plan, layout.submesh(stage.index), backend, placed=same)
        placed.update(program.parameters)
        programs.append(program)
    return PipelineProgram(staged, programs, layout, microbatches, schedule, traced.record(), tuple(tuple(a.shape) for a in args
                           if isinstance(a, torch.Tensor)), plan if isinstance(plan, str) else "explicit", as_target(backend).name,
                           tied, frozenset(n for n, _ in source.named_parameters(remove_duplicate=False)))


def plan_names(module: torch.nn.Module) -> list[str]:
    """What a plan may name in ``module``: its parameters (tied ones under every name), buffers and arguments."""
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)] + [n for n, _ in module.named_buffers(remove_duplicate=False)]
    try:
        return names + list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):  # a forward without a Python signature
        return names


def default_mesh(world: int | None = None) -> DeviceMesh:
    """A 1-D mesh over every rank of the default process group (one device without one)."""
    return make_mesh(None, world=world)


__all__ = ["Traced", "Program", "adopt", "trace", "trace_dump", "of_fusions", "shard", "compile", "compile_pipeline", "route", "bind_call", "meta_copy",
           "tensor_attributes", "plan_names", "default_mesh"]

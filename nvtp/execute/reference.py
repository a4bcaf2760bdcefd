"""The reference backend: runs a fusion with torch ops, on one device or as one rank of a mesh.

Every op has a torch implementation in ``IMPLS``. On a mesh, each rank holds only its part of
each value (its placement says which global indices), ops run on those local parts, and ``set``
ops whose operand and result placements differ reshard through collectives. Ops whose result
depends on where an element sits (``iota``, random numbers, vocab-sharded lookups) ask the
``Context`` for the global indices this rank holds, so a sharded run computes the same numbers
as a single-device run: random tensors are drawn whole from a seeded generator and sliced.

``compute_dtype=torch.float64`` evaluates the fusion in double precision (the check of
``nvtp replay --check``): inputs and every floating-point result are float64, while random
numbers are drawn in the declared dtype first, so both runs see the same dropout masks.

The op table and ``Context`` are ``impls.py``'s; the implementations ``impls_tensor.py``,
``impls_nn.py`` and ``sets.py``'s (imported here, so every op is registered once this module is).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from nvtp.execute import impls_nn, impls_tensor, moe, sets  # noqa: F401 - registers every op in IMPLS
from nvtp.execute import ep
from nvtp.execute import fastcall, kernels
from nvtp.execute.buckets import Bucket
from nvtp.execute.collectives import Comm, Communication, SoloComm
from nvtp.execute.impls import IMPLS, Context, ExecutionError, Impl, as_tensor  # noqa: F401 - the table, as callers import it
from nvtp import cachedir
from nvtp.execute import precompile
from nvtp.execute.inductor import compile_module
from nvtp.execute.lower import lower, taking_list, value_args
from nvtp.execute.sets import keeps_bucket, ring_for, set_is_local, start_for
from nvtp.ir.dtypes import as_input
from nvtp.ir.graph import Fusion, Op, TensorValue, Value, is_value
from nvtp.ir.ops import RANDOM
from nvtp.sharding.placements import DeviceMesh, Placement


IMPLS.update(moe.IMPLS)  # topk, gather_mm, gather_mm_wgrad (nvtp/execute/moe.py)


# ---------------------------------------------------------------------------------------------
# running a fusion: lowered once to a torch.fx GraphModule (nvtp/execute/lower.py), then called


def _local_part(ctx: Context, v: Value, r: torch.Tensor) -> torch.Tensor:
    """This rank's part of result ``v`` when the implementation computed all of it.

    A factor that appears only in an op's results may be split with the operands whole (the
    rules' "results computed locally": a ``cat`` of unequal parts, ``gather``, ``index_select``,
    ``scatter`` or a ``reshape`` without a common refinement whose output axis is split); the
    torch implementation then computes the whole result from the whole operands and each rank
    keeps its slice."""
    if isinstance(v, TensorValue) and tuple(r.shape) == tuple(v.shape) != ctx.local_shape(v):
        return ctx.take_local(r, v)
    return r


def execute_op(ctx: Context, op: Op, args: dict[str, Any], strict: bool = False) -> tuple[torch.Tensor, ...]:
    """Run one op's implementation on resolved ``args``: its results as this rank holds them, in
    the dtypes the op table infers (``strict``: raise instead of casting). Errors name the op."""
    ctx.op = op
    fn = IMPLS.get(op.kind)
    if fn is None:
        raise ExecutionError(f"the reference backend has no implementation of fd.ops.{op.kind}; add one to nvtp/execute/reference.py")
    try:
        if ctx.experts is not None and ctx.experts.runs(op):  # on the rows an ep axis holds on its experts' ranks
            return ctx.experts.execute(ctx, op, args, fn)
        result = fn(ctx, op, args)
    except ExecutionError:
        raise
    except Exception as e:  # name the op, keep the cause
        raise ExecutionError(f"while executing {op}: {type(e).__name__}: {e}") from e
    results = result if isinstance(result, tuple) else (result,)
    if len(results) != len(op.outputs):
        raise ExecutionError(f"{op.kind} implementation returned {len(results)} results, expected {len(op.outputs)}")
    out = []
    for v, r in zip(op.outputs, results):
        r = _local_part(ctx, v, as_tensor(r))
        want = ctx.dtype(v.dtype)
        if strict and (r.dtype != want or tuple(r.shape) != ctx.local_shape(v)):
            raise ExecutionError(f"while executing {op}: the implementation gave {v.name} as {r.dtype}{list(r.shape)}, "
                                 f"the op table infers {want}{list(ctx.local_shape(v))}")
        if r.dtype != want:
            r = r.to(want)
        out.append(r)
    return tuple(out)


def input_value(ctx: Context, v: Value, x: Any) -> Any:
    """A fusion input as the run holds it (scalars as 0-d tensors of their dtype); checks tensors."""
    if isinstance(v, TensorValue):
        if not isinstance(x, torch.Tensor):
            raise ExecutionError(f"input {v.name} must be a tensor, got {type(x).__name__}")
        if ctx.compute_dtype is not None and x.is_floating_point():
            x = x.to(ctx.compute_dtype)
        return x
    return as_tensor(x).to(ctx.dtype(v.dtype))


def constant_value(ctx: Context, op: Op) -> torch.Tensor | None:
    """The 0-d tensor a ``define_scalar`` with a value defines (None for a scalar input)."""
    if op.arg("value") is None:
        return None
    return as_tensor(op.arg("value")).to(ctx.dtype(op.outputs[0].dtype))


def _call_for(strict: bool, settled: Context | None = None, experts: frozenset[str] = frozenset()) -> Callable[[Op], Callable[..., Any]]:
    """How a lowered module calls ``op``: its implementation through ``execute_op``, the values
    it reads passed positionally (the node's arguments), every other argument bound here.
    ``settled`` (the lowering's context, for a module whose kernels are fused): the ops of the
    forms ``fastcall.py`` settles for this mesh position are called in that form instead, except
    those an ep axis runs on its experts' rows (``experts``)."""

    def call_for(op: Op) -> Callable[..., Any]:
        if settled is not None and not (op.outputs and op.outputs[0].name in experts):
            fast = fastcall.specialised(settled, op)
            if fast is not None:
                return fast
        names = value_args(op)
        static = {name: a for name, a in op.args if name not in names}
        single = len(op.outputs) == 1

        def call(ctx: Context, *values: Any) -> Any:
            args = dict(static)
            args.update(zip(names, values))
            results = execute_op(ctx, op, args, strict)
            return results[0] if single else results

        call.__name__ = call.__qualname__ = f"fd_ops_{op.kind}"
        return call

    return call_for


_FOLD_LIMIT = 4 << 20  # bytes a folded constant may keep alive


class _Position(SoloComm):
    """The mesh position a module is lowered for; lowering never communicates."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def _constants(ctx: Context, fold: bool) -> dict[str, Any]:
    """Every ``define_scalar`` value, and (``fold``) the results of ops that read only
    constants, are not random and are small (e.g. the causal mask's iota, broadcasts, compare):
    computed once, by their implementations, while lowering."""
    constants: dict[str, Any] = {}
    for op in ctx.fusion.ops:
        if op.kind == "define_scalar":
            c = constant_value(ctx, op)
            if c is not None:
                constants[op.outputs[0].name] = c
        elif fold and op.kind not in RANDOM and op.kind not in ("set", "segment_set", "define_tensor") and \
                all(v.name in constants for v in op.operands):
            args = {name: _resolve(a, constants) for name, a in op.args}
            try:
                results = execute_op(ctx, op, args)
            except ExecutionError:
                continue  # the run raises it, in its place
            if all(r.untyped_storage().nbytes() <= _FOLD_LIMIT for r in results):
                constants.update((v.name, r) for v, r in zip(op.outputs, results))
    return constants


def _resolve(x: Any, env: Mapping[str, Any]) -> Any:
    if is_value(x):
        return env[x.name]
    if isinstance(x, tuple) and any(is_value(e) for e in x):
        return tuple(_resolve(e, env) for e in x)
    return x


@dataclass
class Lowered:
    """A fusion lowered for one mesh position: ``module(ctx, *inputs)`` runs it."""

    module: Callable[..., Any]  # a torch.fx GraphModule (with all_values: the graph run by fx's Interpreter)
    inputs: list[tuple[Value, tuple[int, ...], torch.dtype]]  # declared local shape and dtype of each input
    shapes: dict[str, tuple[int, ...]]  # local shapes, filled as the runs ask (Context.local_shape)
    fused: dict[str, int]  # pattern name -> times fused
    folded: int  # ops computed while lowering
    held: dict[str, list[Any]] = field(default_factory=dict)  # the global indices held, filled as the runs ask (Context.indices)
    compiled: Any = None  # with compile="inductor": its pieces compiled (nvtp.execute.inductor.Compiled), made on first use
    taking: Any = None  # the module as run([ctx, *inputs]), the list emptied (lower.taking_list), made on first use

    def accepts(self, inputs: Sequence[Any]) -> bool:
        """True when ``inputs`` have the local shapes and dtypes the module was lowered for."""
        return len(inputs) == len(self.inputs) and all(
            not isinstance(v, TensorValue) or (isinstance(x, torch.Tensor) and x.dtype == dtype and tuple(x.shape) == shape)
            for (v, shape, dtype), x in zip(self.inputs, inputs))


def lower_fusion(fusion: Fusion, shardings: Mapping[str, tuple[Placement, ...]] | None = None, mesh: DeviceMesh | None = None,
                 rank: int = 0, size: int = 1, *, compute_dtype: torch.dtype | None = None, strict: bool = False,
                 fuse: bool = True, all_values: bool = False, schedule: Any = None, experts: frozenset[str] = frozenset()) -> Lowered:
    """Lower ``fusion`` for mesh position ``rank`` of ``size``: constants folded, and with ``fuse``
    every group with a fused torch kernel replaced by it (``kernels.py``: cross-entropy, the
    embedding's gradient, LayerNorm, RMSNorm, softmax, GELU, SiLU).
    ``schedule`` (``nvtp.sharding.overlap.Schedule``): collectives start where it says, each waited
    for where its ``set`` stands. ``experts``: the ops (first results) an ep axis runs on its
    experts' rows (``ep.Layout.runs``): no kernel takes them, and their nodes carry
    ``meta["experts"]`` (``inductor.py`` leaves them Python)."""
    ctx = Context(fusion, shardings, mesh, _Position(rank, size), 0, compute_dtype)
    constants = _constants(ctx, fold=not all_values)
    folded = sum(1 for op in fusion.ops if op.kind != "define_scalar" and op.outputs and all(v.name in constants for v in op.outputs))
    fused: dict[str, int] = {}
    producers = fusion.producers()

    def on_experts(node) -> bool:
        op = node.meta.get("op")
        return op is not None and bool(op.outputs) and op.outputs[0].name in experts

    def rewrite(graph):
        fused.update(kernels.fuse(graph, ctx.local_shape, ctx.acting_sharding, ctx.dtype, lambda op: set_is_local(ctx, op), size,
                                  lambda v: producers.get(v.name), on_experts))

    starts = schedule.by_position() if schedule is not None and size > 1 else None
    rings = getattr(schedule, "rings", ()) if starts is not None else ()
    module = lower(fusion, _call_for(strict, ctx if fuse and not (strict or all_values) else None, experts), constants, rewrite=rewrite if fuse else None, all_values=all_values,
                   starts=starts, start_for=lambda issue, ops: start_for(issue, ops, keeps_bucket(fusion, issue)),
                   rings=rings, ring_for=ring_for)
    for node in getattr(module, "graph", fx.Graph()).nodes if experts else ():
        if on_experts(node):
            node.meta["experts"] = True
    inputs = [(v, ctx.local_shape(v) if isinstance(v, TensorValue) else (), ctx.dtype(v.dtype)) for v in fusion.inputs]
    return Lowered(module, inputs, ctx.shapes, fused, folded)


@dataclass
class _Entry:
    fusion: "weakref.ref[Fusion]"
    key: tuple
    lowered: Lowered
    shardings: Any = None  # held, so its id in ``key`` is not reused by another mapping while the entry lives


_CACHE: dict[int, list[_Entry]] = {}
_CACHE_LOCK = threading.RLock()
_PER_FUSION = 8


def lowered_for(fusion: Fusion, shardings: Mapping[str, tuple[Placement, ...]] | None, mesh: DeviceMesh | None,
                rank: int, size: int, **options: Any) -> Lowered:
    """The lowered module of ``fusion`` for this mesh position and options (lowered on first use)."""
    key = (id(shardings), mesh, rank, size, tuple(sorted((k, id(v) if k == "schedule" else v) for k, v in options.items())))
    with _CACHE_LOCK:  # simulated ranks are threads: two lowering one fusion at once must not drop each other's entry
        entries = _CACHE.get(id(fusion))
        for e in entries or ():
            if e.fusion() is fusion and e.key == key and e.shardings is shardings:
                return e.lowered
        lowered = lower_fusion(fusion, shardings, mesh, rank, size, **options)
        if not entries or entries[0].fusion() is not fusion:
            entries = _CACHE[id(fusion)] = []
            weakref.finalize(fusion, _CACHE.pop, id(fusion), None)
        entries.append(_Entry(weakref.ref(fusion), key, lowered, shardings))
        del entries[:-_PER_FUSION]
        return lowered


def fused_patterns(fusion: Fusion) -> dict[str, int]:
    """How many groups of each pattern ``fusion``'s lowered modules run as one kernel (summed over
    the mesh positions and options it was lowered for so far; ``"set"``: the sets taken out)."""
    counts: dict[str, int] = {}
    for e in _CACHE.get(id(fusion), ()):
        if e.fusion() is fusion:
            for name, n in e.lowered.fused.items():
                counts[name] = counts.get(name, 0) + n
    return counts


def kept_buckets(fusion: Fusion, rank: int | None = None) -> list[Bucket]:
    """The buffers ``fusion``'s lowered modules keep between steps (``nvtp.execute.buckets``: a
    backward's gradient buckets), of mesh position ``rank`` (None: every position lowered so far)."""
    out = []
    for e in _CACHE.get(id(fusion), ()):
        if e.fusion() is fusion and (rank is None or e.key[2] == rank):
            for node in getattr(e.lowered.module, "graph", fx.Graph()).nodes:
                bucket = getattr(node.target, "bucket", None)
                if bucket is not None:
                    out.append(bucket)
    return out


_UNCOMPILED: dict[int, dict[str, int]] = {}  # id(fusion) -> why compile="inductor" ran it op by op -> runs


def _uncompiled(fusion: Fusion, why: str, warn: bool = True) -> None:
    """A run that asked for ``inductor`` and runs ``fusion`` op by op: counted (``compiled_pieces``),
    and warned about once per fusion and reason (``warn``: asked for by ``compile="inductor"``;
    under ``"auto"`` only counted)."""
    seen = _UNCOMPILED.get(id(fusion))
    if seen is None:
        seen = _UNCOMPILED[id(fusion)] = {}
        weakref.finalize(fusion, _UNCOMPILED.pop, id(fusion), None)
    if why not in seen and warn:
        warnings.warn(f"nvtp compile='inductor': {fusion.name or 'a fusion'} runs op by op, not compiled: {why} "
                      "(nvtp/execute/inductor.py compiles a rank's fused run only)", stacklevel=3)
    seen[why] = seen.get(why, 0) + 1


def compiled_pieces(fusion: Fusion) -> dict[str, Any]:
    """With ``compile="inductor"``: how ``fusion``'s lowered modules ran (summed over the mesh
    positions it was lowered for): ``"compiled"`` pieces, ``"python"`` pieces by why
    (``nvtp/execute/inductor.py``; a run of the whole fusion op by op, as ``"op by op: <why>"``
    with its count of runs), and ``"seconds"`` spent tracing and compiling them."""
    out: dict[str, Any] = {"compiled": 0, "python": {f"op by op: {why}": n for why, n in _UNCOMPILED.get(id(fusion), {}).items()},
                           "seconds": 0.0}
    for e in _CACHE.get(id(fusion), ()):
        c = e.lowered.compiled
        if e.fusion() is fusion and c is not None:
            out["compiled"] += c.pieces
            out["seconds"] += c.seconds
            for why, n in c.python.items():
                out["python"][why] = out["python"].get(why, 0) + n
    return out


# Fused kernels stand in for the patterns' ops only while those ops run their own implementations:
# a changed table (a test's monkeypatch, an implementation registered at run time) runs unfused.
_PRISTINE_IMPLS: dict[str, Impl] = {}


def run(
    fusion: Fusion,
    inputs: Sequence[Any],
    *,
    shardings: Mapping[str, tuple[Placement, ...]] | None = None,
    mesh: DeviceMesh | None = None,
    comm: Comm | None = None,
    seed: int = 0,
    compute_dtype: torch.dtype | None = None,
    log: list[Communication] | None = None,
    strict: bool = False,
    values: dict[str, Any] | None = None,
    compiled: bool = True,
    steps: Mapping[str, Any] | None = None,
    schedule: Any = None,
    rings: Mapping[str, int] | None = None,
    axis_options: Mapping[str, Any] | None = None,
    inductor: bool = False,
    ahead: bool = False,
    take: bool = False,
) -> list[Any]:
    """Run ``fusion`` on ``inputs`` (this rank's parts when ``shardings`` are given) and return its outputs.

    The fusion is lowered once per mesh position and options to a torch.fx GraphModule
    (``lower_fusion``): one call per op, each op exactly as its implementation here says, each
    value dropped after its last use. Results are cast to the dtype the op table infers; with
    ``strict`` an implementation whose result has another dtype or shape raises instead (the op
    tests use it to keep the table and the implementations in agreement). ``values``, if given,
    receives every value of the run by name (inputs, constants and op results, as this rank holds
    them; scalars as 0-d tensors), e.g. for the rule tests, which re-run each op on its own.

    By default the groups with a fused torch kernel (``kernels.py``) run as that kernel (rounding
    as eager PyTorch does); ``compiled=False``, ``strict``, ``values`` and ``compute_dtype`` run every op
    by its own implementation, and so do inputs of other shapes or dtypes than declared.
    ``steps`` (a ``ShardedFusion``'s ``set_steps``) say what each ``set`` does: run as planned.
    ``schedule`` (``nvtp.sharding.overlap.Schedule``): when collectives start and which go together.
    ``rings``: the attentions the program runs by ring (first result -> mesh axis; its steps).
    ``axis_options``: the axis options the program was planned with (``ShardedFusion.options``).
    ``inductor`` (with the kernels): the lowered module's compute between collectives and random
    draws compiled by Inductor (``nvtp/execute/inductor.py``), where the inputs are as declared;
    with ``ahead`` (``compile="auto"``) only where an earlier run compiled them all, the rest
    queued for a background compile (``nvtp/execute/precompile.py``), and not at all where nvtp's
    cache is off (``NVTP_CACHE=0``: the kernels).
    ``take``: ``inputs`` is a list the run empties, so that each input is dropped after its last
    use (a backward frees the activations its forward saved as it goes, as eager autograd does);
    the caller must hold no other reference to what it wants freed.
    """
    comm = comm or SoloComm()
    if ahead and cachedir.root() is None:  # compile="auto" with nvtp's cache off: nowhere to keep the work, the kernels
        inductor = False
    if len(inputs) != len(fusion.inputs):
        raise ExecutionError(f"{fusion.name} takes {len(fusion.inputs)} inputs, got {len(inputs)}")
    given = inputs
    inputs = [as_input(x, v.shape, v.dtype) if isinstance(v, TensorValue) else x for v, x in zip(fusion.inputs, inputs)]
    if take:
        given.clear()
    options = dict(compute_dtype=compute_dtype, strict=strict, all_values=values is not None, schedule=schedule)
    experts = ep.experts_for(fusion, shardings, mesh, comm, axis_options)  # None: no expert rows to move (nvtp/execute/ep.py)
    options["experts"] = experts.layout.runs if experts is not None else frozenset()  # they run as their ops (ep.Experts)
    fuse = compiled and not strict and values is None and compute_dtype is None and IMPLS == _PRISTINE_IMPLS
    lowered = lowered_for(fusion, shardings, mesh, comm.rank, comm.size, fuse=fuse, **options)
    if fuse and lowered.fused and not lowered.accepts(inputs):
        lowered = lowered_for(fusion, shardings, mesh, comm.rank, comm.size, fuse=False, **options)
    if inductor and not (fuse and lowered.accepts(inputs)):
        _uncompiled(fusion, "strict" if strict else "values=" if values is not None else "compute_dtype" if compute_dtype is not None
                    else "compile='none'" if not compiled else "the op table changed" if IMPLS != _PRISTINE_IMPLS
                    else "inputs of other shapes or dtypes than declared", warn=not ahead)
    ctx = Context(fusion, shardings, mesh, comm, seed, compute_dtype, shapes=lowered.shapes, held=lowered.held, steps=steps,
                  rings=dict(rings or {}), options=dict(axis_options or {}), experts=experts)
    if log is not None:
        ctx.log = log
    try:
        # The GraphModule's forward, not its __call__: a fusion is no module of the user's, so module
        # hooks (torch's CommDebugMode / ModTracker track every module called) must not see it.
        run = getattr(lowered.module, "forward", lowered.module)
        pieces = None
        if inductor and fuse and lowered.accepts(inputs):
            if lowered.compiled is None:
                lowered.compiled = compile_module(lowered.module, ahead=precompile.Ahead(precompile.directory()) if ahead else None)
            pieces = lowered.compiled
            run = pieces.run
        if take and values is None:  # each input dropped after its last use (lower.taking_list)
            if pieces is None and lowered.taking is None:
                lowered.taking = taking_list(lowered.module)
            run = pieces.taking if pieces is not None else lowered.taking
            box = [ctx, *(input_value(ctx, v, x) for v, x in zip(fusion.inputs, inputs))]
            del inputs
            out = run(box)
        else:
            out = run(ctx, *(input_value(ctx, v, x) for v, x in zip(fusion.inputs, inputs)))
        if pieces is not None and pieces.ahead is not None and not pieces.decided:
            pieces.decide(comm)  # compile="auto": compile now from the cache on every rank, or leave it for later
    except ExecutionError:
        raise
    except Exception as e:  # a fused kernel: name the fusion, keep the cause
        raise ExecutionError(f"while running {fusion.name}: {type(e).__name__}: {e}") from e
    if values is not None:
        values.update(out)
        out = [out[v.name] for v in fusion.outputs]
    return [x if isinstance(v, TensorValue) else x.item() for v, x in zip(fusion.outputs, out)]


_PRISTINE_IMPLS.update(IMPLS)

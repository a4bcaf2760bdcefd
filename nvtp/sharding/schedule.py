"""Shardings as nvFuser device schedules, and back.

nvFuser expresses a sharding on a TensorView's *loop domain*: the mesh is set, an axis is split
(``outer_split(axis, d)``) and the piece of size d is parallelised over devices
(``axis(i).parallelize(ParallelType.mesh_x)``, printed ``deviceIdx.x``). ``_StridedShard(dim, k)``
is an outer split by k first, then by d. A partial sum is a *reduction* axis split the same
way (``rdeviceIdx.x``): nvFuser then lowers the reduction across devices to the collective.

Loop domains include reduction axes: a ``sum`` keeps its reduced axes in place, ``linear`` and
``matmul`` append the contracted axis, ``var_mean``'s mean keeps them and its variance does not
(``loop_axes``; checked against nvfuser_direct in the tests).

A mesh of several axes is one nvFuser ``DeviceMesh`` of that shape
(``DeviceMesh(torch.tensor([[0, 1], [2, 3]]))`` for (dp, tp) = (2, 2)); each mesh axis splits its
own dimension of a tensor and parallelizes the piece with its own parallel type: the last mesh
axis ``mesh_x`` (DIDx), the one before ``mesh_y`` (DIDy), as nvFuser's
``DeviceMesh::parallelTypeToAxis`` maps them. In a schedule step the mesh is its devices, nested
by the mesh's shape (a flat tuple on a 1-D mesh).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from nvtp.ir.graph import Fusion, Op, TensorValue
from nvtp.ir.loops import loop_axes, loop_extents
from nvtp.ir.graph import ScheduleStep
from nvtp.sharding.placements import REPLICATE, DeviceMesh, Partial, Placement, axis_split, is_partial, make_shard
from nvtp.sharding.rules import factors_of
from nvtp.sharding.sharded import ShardedFusion


class ScheduleError(ValueError):
    pass


def _partial_axis(op: Op, result: int, sharded_operand_axis: int | None) -> int:
    axes = loop_axes(op, result)
    reduce = [i for i, (kind, j) in enumerate(axes) if kind == "reduce" and (sharded_operand_axis is None or j == sharded_operand_axis)]
    if not reduce:
        raise ScheduleError(f"{op}: nvFuser has no reduction axis to hold a partial {op.outputs[result].name}; "
                            "only sums, max/min and matmuls lower partial results to nvFuser")
    return reduce[0]


PARALLEL_TYPES = ("mesh_x", "mesh_y", "mesh_z")  # nvFuser's device parallel types, from the mesh's last axis


def parallel_type(mesh_ndim: int, axis: int) -> str:
    """nvFuser's parallel type for mesh axis ``axis`` of a mesh of ``mesh_ndim`` axes (the last is mesh_x)."""
    offset = mesh_ndim - 1 - axis
    if not 0 <= offset < len(PARALLEL_TYPES):
        raise ScheduleError(f"nvFuser parallelizes meshes of at most {len(PARALLEL_TYPES)} axes; mesh axis {axis} of {mesh_ndim} has no parallel type")
    return PARALLEL_TYPES[offset]


def mesh_args(mesh: DeviceMesh) -> tuple:
    """A mesh as a schedule step holds it: its devices, nested by its shape (flat on a 1-D mesh)."""
    def nest(flat: tuple[int, ...], shape: tuple[int, ...]) -> tuple:
        if len(shape) == 1:
            return tuple(flat)
        step = len(flat) // shape[0]
        return tuple(nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0]))

    return nest(tuple(mesh.devices), tuple(mesh.shape))


def mesh_of_args(args: tuple) -> DeviceMesh:
    """The mesh a schedule step's nested devices describe (axis names are not in nvFuser's schedule)."""
    shape, level = [], args
    while isinstance(level, tuple) and level and isinstance(level[0], tuple):
        shape.append(len(level))
        level = level[0]
    shape.append(len(level))
    flat: list[int] = []

    def walk(x, depth: int) -> None:
        if depth == len(shape) - 1:
            if len(x) != shape[-1] or not all(isinstance(d, int) for d in x):
                raise ScheduleError(f"device mesh {list(args)} is not a rectangular array of device ids")
            flat.extend(x)
            return
        if not isinstance(x, tuple) or len(x) != shape[depth]:
            raise ScheduleError(f"device mesh {list(args)} is not a rectangular array of device ids")
        for item in x:
            walk(item, depth + 1)

    walk(args, 0)
    return DeviceMesh(tuple(flat), tuple(shape))


def _split_steps(name: str, axis: int, split_factor: int, d: int, ptype: str = "mesh_x") -> list[ScheduleStep]:
    if split_factor == 1:
        return [ScheduleStep(name, "split", (axis, d, False)), ScheduleStep(name, "parallelize", (axis, ptype))]
    return [ScheduleStep(name, "split", (axis, split_factor, False)), ScheduleStep(name, "split", (axis + 1, d, False)),
            ScheduleStep(name, "parallelize", (axis + 1, ptype))]


def _axis_view(sharded: ShardedFusion, axis: int) -> ShardedFusion:
    """Mesh axis ``axis`` of ``sharded`` as a 1-D sharded fusion, with that axis's own pass's source
    and propagation (its partial-sum decisions)."""
    if sharded.mesh.ndim == 1:
        return sharded
    view = sharded.view(axis)
    if sharded.axes:
        own = sharded.axes[axis]
        view = replace(view, source=own.source, propagation=own.propagation)
    return view


def device_axis(sharded: ShardedFusion, op: Op | None, result: int, v: TensorValue,
                made_by: Mapping[str, int] | None = None) -> tuple[int, int] | None:
    """(loop axis, split factor) nvtp splits over devices for value ``v``; None if replicated.
    ``made_by``: the index in ``sharded.source.ops`` of the op making each first result (built
    here if not given; ``schedule_steps`` builds it once, as a scan per partial sum was quadratic)."""
    p = sharded.placement(v.name)
    split = axis_split(p)
    axes = loop_axes(op, result) if op is not None else [("dim", i) for i in range(v.ndim)]
    if split is not None:
        dim, sf = split
        return axes.index(("dim", dim)), sf
    if is_partial(p):
        index = (made_by if made_by is not None else _made_by(sharded.source)).get(op.outputs[0].name)
        decision = sharded.propagation.decisions.get(index)
        if decision is None or decision.factor is None:
            raise ScheduleError(f"{op}: no decision recorded for partial {v.name}")
        f = factors_of(op)
        operand_axis = None
        for ax_i, factors in enumerate(f.operands[0]):
            if decision.factor in factors:
                operand_axis = ax_i
        return _partial_axis(op, result, operand_axis), decision.split
    return None


def _made_by(fusion: Fusion) -> dict[str, int]:
    """Each op's first result -> the op's index (the first op, where two make one name)."""
    found: dict[str, int] = {}
    for i, o in enumerate(fusion.ops):
        if o.outputs:
            found.setdefault(o.outputs[0].name, i)
    return found


def schedule_steps(sharded: ShardedFusion) -> list[ScheduleStep]:
    """The device schedule of a sharded fusion: the calls that end its definition, as data
    (``nvtp.ir.printer.format_schedule`` prints them, ``nvfuser.build_definition`` applies them).

    A partial sum resolved into a split (a reduce-scatter) also gets the destination's split on
    its own loop domain, next to its split reduction axis: that is how nvFuser says
    reduce-scatter (its ``test_linear_reduce_scatter``); with the reduction axis alone nvFuser
    would all-reduce and the ``set`` would slice.

    On a mesh of several axes each axis contributes its own split, parallelized with its own
    parallel type (``parallel_type``); two mesh axes never split the same loop axis (nvtp splits
    a dimension over one mesh axis only)."""
    mesh = sharded.mesh
    views = [_axis_view(sharded, a) for a in range(mesh.ndim)]
    made_by = [_made_by(view.source) for view in views]
    ptypes = [parallel_type(mesh.ndim, a) for a in range(mesh.ndim)]
    scattered = [{s.value: axis_split(s.dst) for s in sharded.set_steps.values()
                  if s.axis == a and is_partial(s.src) and axis_split(s.dst) is not None} for a in range(mesh.ndim)]
    devices = mesh_args(mesh)
    steps: list[ScheduleStep] = []
    for op in sharded.fusion.ops:
        for r, v in enumerate(op.outputs):
            if not isinstance(v, TensorValue) or v.name not in sharded.shardings:
                continue
            steps.append(ScheduleStep(v.name, "mesh", devices))
            if mesh.ndim == 1 and mesh.size == 1:
                continue  # a 2-D mesh keeps an axis of extent 1 in the schedule, so the file says which axis splits what
            splits: list[tuple[int, int, int]] = []  # (loop axis, split factor, mesh axis)
            for a, view in enumerate(views):
                where = device_axis(view, None if op.kind == "define_tensor" else op, r, v, made_by[a])
                if where is None:
                    continue
                splits.append((*where, a))
                if v.name in scattered[a]:  # a reduce-scatter's destination split, beside its split reduction axis
                    dim, sf = scattered[a][v.name]
                    splits.append((loop_axes(op, r).index(("dim", dim)), sf, a))
            extents = loop_extents(None if op.kind == "define_tensor" else op, r, v)
            for axis in sorted({axis for axis, _, _ in splits}, reverse=True):  # the later loop axis first: the earlier ones' indices stay put
                on_axis = [(sf, mesh.shape[a], ptypes[a]) for x, sf, a in splits if x == axis]
                steps.extend(_nested_split_steps(v, axis, extents[axis], on_axis, sharded.sharding(v.name)))
    return steps


def _nested_split_steps(v: TensorValue, axis: int, extent: int, splits: list[tuple[int, int, str]], sharding) -> list[ScheduleStep]:
    """Outer splits of loop axis ``axis`` (of ``extent``) for each mesh axis that splits it,
    ``splits`` holding (split factor, mesh extent, parallel type) each.

    A mesh axis with split factor k over d devices cuts the loop axis as ``[k, d, rest]`` and owns
    the middle digit. When several mesh axes split one loop axis (the batch and the sequence of a
    flattened ``[B*T, C]``: dp ``Shard(0)``, tp ``_StridedShard(0, B)``) each must own a different
    digit of one mixed-radix chain, outermost first; nvFuser then holds ``[dp, tp, rest]`` with
    each digit parallelized by its axis. On one mesh axis this is ``_split_steps``."""
    name = v.name
    if len(splits) == 1:
        sf, d, ptype = splits[0]
        return _split_steps(name, axis, sf, d, ptype)
    spans = []
    for sf, d, ptype in splits:
        if sf <= 0 or extent % sf or (extent // sf) % d:
            raise ScheduleError(f"{v.describe()}: loop axis {axis} of extent {extent} cannot be split by {sf} and then over {d} devices ({sharding})")
        hi = extent // sf  # the stride above this mesh axis's digit; hi // d below it
        spans.append((hi, hi // d, d, ptype))
    steps: list[ScheduleStep] = []
    current, pos = extent, axis
    for hi, lo, d, ptype in sorted(spans, key=lambda s: (-s[0], -s[1])):
        if hi > current or current % hi:
            raise ScheduleError(f"{v.describe()}: mesh axes split loop axis {axis} over the same entries ({sharding}); "
                                "two mesh axes may split one axis only along different factors of it")
        if hi < current:  # the digits between the previous mesh axis's and this one's stay on each device
            steps.append(ScheduleStep(name, "split", (pos, current // hi, False)))
            pos += 1
        steps += [ScheduleStep(name, "split", (pos, d, False)), ScheduleStep(name, "parallelize", (pos, ptype))]
        pos, current = pos + 1, lo
    return steps


@dataclass
class _LoopAxis:
    origin: tuple[str, int]  # ("dim", i) or ("reduce", j)
    outer: int  # product of the extents split off outside this axis
    size: int


def placements_from_schedule(fusion: Fusion, steps: list[ScheduleStep]) -> tuple[dict[str, Placement], tuple[int, ...] | None]:
    """Placements (and the mesh's devices) a parsed device schedule on a 1-D mesh gives each tensor."""
    shardings, mesh = shardings_from_schedule(fusion, steps)
    if mesh is not None and mesh.ndim != 1:
        raise ScheduleError(f"the schedule's mesh is {mesh}; placements_from_schedule reads 1-D meshes: use shardings_from_schedule")
    return {k: s[0] for k, s in shardings.items()}, (tuple(mesh.devices) if mesh is not None else None)


def shardings_from_schedule(fusion: Fusion, steps: list[ScheduleStep]) -> tuple[dict[str, tuple[Placement, ...]], DeviceMesh | None]:
    """The sharding (one placement per mesh axis) a parsed device schedule gives each tensor it
    names, and its mesh (None if the schedule sets none). A split parallelized with ``mesh_x`` is
    on the mesh's last axis, ``mesh_y`` the one before; a parallelized reduction axis is a partial sum."""
    producers = fusion.producers()
    values = fusion.values
    loops: dict[str, list[_LoopAxis]] = {}
    marks: dict[str, dict[str, Placement]] = {}  # tensor -> parallel type -> placement
    named: list[str] = []
    devices: tuple | None = None

    def loop_of(name: str) -> list[_LoopAxis]:
        if name not in loops:
            op = producers[name]
            v = values[name]
            source = op if op.kind != "define_tensor" else None
            axes = loop_axes(op, op.outputs.index(v)) if source is not None else [("dim", i) for i in range(v.ndim)]
            loops[name] = [_LoopAxis(a, 1, n) for a, n in zip(axes, loop_extents(source, op.outputs.index(v), v))]
        return loops[name]

    for step in steps:
        if step.tensor not in values:
            raise ScheduleError(f"the schedule names {step.tensor}, which the fusion does not define")
        if step.tensor not in marks:
            marks[step.tensor] = {}
            named.append(step.tensor)
        if step.kind == "mesh":
            if devices is not None and tuple(step.args) != devices:
                raise ScheduleError(f"{step.tensor} uses mesh {list(step.args)}, another tensor {list(devices)}; nvtp handles one mesh")
            devices = tuple(step.args)
            continue
        axes = loop_of(step.tensor)
        if step.kind == "split":
            axis, factor, inner = step.args
            axis = axis % len(axes)
            a = axes[axis]
            if factor <= 0 or a.size % factor:
                raise ScheduleError(f"{step.tensor}: cannot split loop axis {axis} of extent {a.size} by {factor}")
            outer_size = a.size // factor if inner else factor
            axes[axis:axis + 1] = [_LoopAxis(a.origin, a.outer, outer_size), _LoopAxis(a.origin, a.outer * outer_size, a.size // outer_size)]
        elif step.kind == "parallelize":
            axis, ptype = step.args[0] % len(axes), step.args[1]
            if ptype == "stream":  # blocks run on streams, one after another on each device: no placement
                continue
            a = axes[axis]
            kind, j = a.origin
            mark = marks[step.tensor]
            if ptype not in PARALLEL_TYPES:
                raise ScheduleError(f"{step.tensor}: parallel type {ptype} is not a device axis; nvtp reads {', '.join(PARALLEL_TYPES)}")
            if kind == "reduce":
                # A split reduction axis makes the value a partial sum in nvtp's terms, even when an
                # iteration axis is split too (nvFuser's reduce-scatter, resolved by the next set).
                mark[ptype] = Partial("sum") if producers[step.tensor].kind != "max" else Partial("max")
            elif not isinstance(mark.get(ptype), Partial):
                mark[ptype] = make_shard(j, a.outer)
    if devices is None:
        return {name: (placement,) for name, placement in _one_axis(marks).items()}, None
    mesh = mesh_of_args(devices)
    types = {parallel_type(mesh.ndim, a): a for a in range(mesh.ndim)}
    shardings: dict[str, tuple[Placement, ...]] = {}
    for name in named:
        per_axis: list[Placement] = [REPLICATE] * mesh.ndim
        for ptype, p in marks[name].items():
            if ptype not in types:
                raise ScheduleError(f"{name} is parallelized with {ptype}, but the mesh {list(devices)} has {mesh.ndim} "
                                    f"axis(es): {', '.join(types)} only")
            per_axis[types[ptype]] = p
            split = axis_split(p)
            if split is not None:
                dim, sf = split
                par = [x for x in loops.get(name, []) if x.origin == ("dim", dim) and x.outer == sf]
                extent = mesh.shape[types[ptype]]
                if par and par[0].size != extent:
                    raise ScheduleError(f"{name}: axis {dim} is split into {par[0].size} device pieces but the mesh axis "
                                        f"parallelized with {ptype} has {extent} devices")
        shardings[name] = tuple(per_axis)
    return shardings, mesh


def _one_axis(marks: dict[str, dict[str, Placement]]) -> dict[str, Placement]:
    """Placements of a schedule that parallelizes without setting a mesh (mesh_x only)."""
    return {name: mark.get("mesh_x", REPLICATE) for name, mark in marks.items()}

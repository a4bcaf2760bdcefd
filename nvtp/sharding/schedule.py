"""Shardings as nvFuser device schedules, and back.

nvFuser expresses a sharding on a TensorView's *loop domain*: the mesh is set, an axis is split
(``outer_split(axis, d)``) and the piece of size d is parallelised over devices
(``axis(i).parallelize(ParallelType.mesh_x)``, printed ``deviceIdx.x``). ``_StridedShard(dim, k)``
is an outer split by k first, then by d. A partial sum is a *reduction* axis split the same
way (``rdeviceIdx.x``): nvFuser then lowers the reduction across devices to the collective.

Loop domains include reduction axes: a ``sum`` keeps its reduced axes in place, ``linear`` and
``matmul`` append the contracted axis, ``var_mean``'s mean keeps them and its variance does not
(``loop_axes``; checked against nvfuser_direct in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

from nvtp.ir.graph import Fusion, Op, TensorValue
from nvtp.ir.ops import norm_dim, spec
from nvtp.ir.parser import ScheduleStep
from nvtp.sharding.placements import REPLICATE, Partial, Placement, axis_split, is_partial, make_shard
from nvtp.sharding.rules import factors_of, tensor_operands
from nvtp.sharding.sharded import ShardedFusion


class ScheduleError(ValueError):
    pass


def loop_axes(op: Op, result: int) -> list[tuple[str, int]]:
    """nvFuser's loop domain of ``op``'s result ``result`` before scheduling: ("dim", i) for
    logical axis i, ("reduce", j) for a reduction over operand axis j."""
    v = op.outputs[result]
    dims = [("dim", i) for i in range(len(v.shape))]
    if result in spec(op.kind).loop_reduce:
        x = tensor_operands(op)[0]
        if op.arg_dict.get("keepdim"):
            return dims
        red = op.arg("dims")
        red = set(range(x.ndim)) if red is None else {norm_dim(d, x.ndim) for d in red}
        out, k = [], 0
        for j in range(x.ndim):
            if j in red and x.shape[j] == 1:
                continue  # nvFuser squeezes a reduced broadcast (size-1) axis instead of reducing it
            if j in red:
                out.append(("reduce", j))
            else:
                out.append(("dim", k))
                k += 1
        return out
    if spec(op.kind).loop_contract:
        return dims + [("reduce", tensor_operands(op)[0].ndim - 1)]
    return dims


def _partial_axis(op: Op, result: int, sharded_operand_axis: int | None) -> int:
    axes = loop_axes(op, result)
    reduce = [i for i, (kind, j) in enumerate(axes) if kind == "reduce" and (sharded_operand_axis is None or j == sharded_operand_axis)]
    if not reduce:
        raise ScheduleError(f"{op}: nvFuser has no reduction axis to hold a partial {op.outputs[result].name}; "
                            "only sums, max/min and matmuls lower partial results to nvFuser")
    return reduce[0]


def _split_steps(name: str, axis: int, split_factor: int, d: int) -> list[ScheduleStep]:
    if split_factor == 1:
        return [ScheduleStep(name, "split", (axis, d, False)), ScheduleStep(name, "parallelize", (axis, "mesh_x"))]
    return [ScheduleStep(name, "split", (axis, split_factor, False)), ScheduleStep(name, "split", (axis + 1, d, False)),
            ScheduleStep(name, "parallelize", (axis + 1, "mesh_x"))]


def device_axis(sharded: ShardedFusion, op: Op | None, result: int, v: TensorValue) -> tuple[int, int] | None:
    """(loop axis, split factor) nvtp splits over devices for value ``v``; None if replicated."""
    p = sharded.placement(v.name)
    split = axis_split(p)
    axes = loop_axes(op, result) if op is not None else [("dim", i) for i in range(v.ndim)]
    if split is not None:
        dim, sf = split
        return axes.index(("dim", dim)), sf
    if is_partial(p):
        index = next((i for i, o in enumerate(sharded.source.ops) if o.outputs and o.outputs[0].name == op.outputs[0].name), None)
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


def schedule_steps(sharded: ShardedFusion) -> list[ScheduleStep]:
    """The device schedule of a sharded fusion: the calls that end its definition, as data
    (``nvtp.ir.printer.format_schedule`` prints them, ``nvfuser.build_definition`` applies them).

    A partial sum resolved into a split (a reduce-scatter) also gets the destination's split on
    its own loop domain, next to its split reduction axis: that is how nvFuser says
    reduce-scatter (its ``test_linear_reduce_scatter``); with the reduction axis alone nvFuser
    would all-reduce and the ``set`` would slice."""
    d = sharded.mesh.size
    scattered = {s.value: axis_split(s.dst) for s in sharded.set_steps.values() if is_partial(s.src) and axis_split(s.dst) is not None}
    steps: list[ScheduleStep] = []
    for op in sharded.fusion.ops:
        for r, v in enumerate(op.outputs):
            if not isinstance(v, TensorValue) or v.name not in sharded.shardings:
                continue
            steps.append(ScheduleStep(v.name, "mesh", tuple(sharded.mesh.devices)))
            if d == 1:
                continue
            where = device_axis(sharded, None if op.kind == "define_tensor" else op, r, v)
            if where is None:
                continue
            splits = [where]
            if v.name in scattered:  # a reduce-scatter's destination split, beside its split reduction axis
                dim, sf = scattered[v.name]
                splits.append((loop_axes(op, r).index(("dim", dim)), sf))
            for axis, split in sorted(splits, reverse=True):  # the later loop axis first: the earlier one's index stays put
                steps.extend(_split_steps(v.name, axis, split, d))
    return steps


@dataclass
class _LoopAxis:
    origin: tuple[str, int]  # ("dim", i) or ("reduce", j)
    outer: int  # product of the extents split off outside this axis
    size: int


def placements_from_schedule(fusion: Fusion, steps: list[ScheduleStep]) -> tuple[dict[str, Placement], tuple[int, ...] | None]:
    """Placements (and the mesh's devices) a parsed device schedule gives each tensor."""
    producers = fusion.producers()
    values = fusion.values
    loops: dict[str, list[_LoopAxis]] = {}
    placements: dict[str, Placement] = {}
    devices: tuple[int, ...] | None = None

    def loop_of(name: str) -> list[_LoopAxis]:
        if name not in loops:
            op = producers[name]
            v = values[name]
            axes = loop_axes(op, op.outputs.index(v)) if op.kind != "define_tensor" else [("dim", i) for i in range(v.ndim)]
            sizes = []
            for kind, j in axes:
                if kind == "dim":
                    sizes.append(v.shape[j])
                else:
                    sizes.append(tensor_operands(op)[0].shape[j])  # j: the reduced axis of the first operand (its last, contracted)
            loops[name] = [_LoopAxis(a, 1, n) for a, n in zip(axes, sizes)]
        return loops[name]

    for step in steps:
        if step.tensor not in values:
            raise ScheduleError(f"the schedule names {step.tensor}, which the fusion does not define")
        if step.kind == "mesh":
            if devices is not None and tuple(step.args) != devices:
                raise ScheduleError(f"{step.tensor} uses mesh {list(step.args)}, another tensor {list(devices)}; nvtp handles one mesh")
            devices = tuple(step.args)
            placements.setdefault(step.tensor, REPLICATE)
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
            axis = step.args[0] % len(axes)
            a = axes[axis]
            kind, j = a.origin
            if kind == "reduce":
                # A split reduction axis makes the value a partial sum in nvtp's terms, even when an
                # iteration axis is split too (nvFuser's reduce-scatter, resolved by the next set).
                placements[step.tensor] = Partial("sum") if producers[step.tensor].kind != "max" else Partial("max")
            elif not isinstance(placements.get(step.tensor), Partial):
                placements[step.tensor] = make_shard(j, a.outer)
    if devices is not None:
        for name, p in placements.items():
            split = axis_split(p)
            if split is not None:
                dim, sf = split
                loop = loops.get(name, [])
                par = [a for a in loop if a.origin == ("dim", dim) and a.outer == sf]
                if par and par[0].size != len(devices):
                    raise ScheduleError(f"{name}: axis {dim} is split into {par[0].size} device pieces but the mesh has {len(devices)} devices")
    return placements, devices

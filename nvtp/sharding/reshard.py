"""Resharding: where a consumer needs a value placed differently from where it lives, an
explicit ``set`` op converts it. Planned as data first (``ReshardStep``s), then inserted.

    Partial  -> Replicate   allreduce
    Partial  -> Shard       reduce_scatter
    Shard    -> Replicate   allgather
    Shard    -> Shard'      allgather, then a local slice
    Replicate-> Shard       slice (local, no communication)
    Replicate-> Partial     partition (local: rank 0 keeps the value, the others hold zeros)

``bytes`` is what each rank sends with ring algorithms (the figure Megatron's papers count):
2(d-1)/d of the tensor for an allreduce, (d-1)/d for an allgather or a reduce-scatter, 0 for the
local ones. Consumers needing the same value in the same placement share one ``set``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nvtp.ir.build import make_op
from nvtp.ir.graph import Fusion, Op, TensorValue, defines_input, fresh_names
from nvtp.ir.ops import spec
from nvtp.sharding.placements import DeviceMesh, Placement, axis_split, is_partial, is_replicate, REPLICATE
from nvtp.sharding.propagate import as_decision, implied, Propagation, reshard_bytes
from nvtp.sharding.rules import factors_of

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter")


def reshard_kind(src: Placement, dst: Placement) -> str:
    if is_partial(src):
        return "reduce_scatter" if axis_split(dst) else "allreduce"
    if axis_split(src) is not None:
        return "allgather"
    if is_replicate(src):
        return "partition" if is_partial(dst) else "slice"
    raise ValueError(f"no reshard from {src} to {dst}")


@dataclass(frozen=True)
class ReshardStep:
    """Convert ``value`` from ``src`` to ``dst`` for the ops ``consumers`` (indices; -1: a fusion output)."""

    value: str
    src: Placement
    dst: Placement
    consumers: tuple[int, ...]
    tensor_bytes: int
    bytes: int  # sent per rank
    axis: int = 0  # the mesh axis whose process group runs it

    @property
    def kind(self) -> str:
        return reshard_kind(self.src, self.dst)

    @property
    def is_communication(self) -> bool:
        return self.kind in COLLECTIVES and self.bytes > 0  # on one device nothing moves


OUTPUT = -1


def plan_reshards(fusion: Fusion, prop: Propagation, mesh: DeviceMesh, output_hints: dict[str, Placement] | None = None) -> list[ReshardStep]:
    """The reshards ``prop`` needs, in op order. Outputs left Partial are resolved (to their hint,
    else Replicate): a fusion hands back whole or sharded tensors, never partial sums."""
    values = fusion.values
    wanted: dict[tuple[str, Placement], list[int]] = {}
    for r in prop.requirements:
        have = prop.placements[r.value]
        if have != r.placement:
            wanted.setdefault((r.value, r.placement), []).append(r.op_index)
    for v in fusion.outputs:
        if not isinstance(v, TensorValue):
            continue
        have = prop.placements[v.name]
        hint = (output_hints or {}).get(v.name)
        target = hint if hint is not None else (REPLICATE if is_partial(have) else have)
        if have != target:
            wanted.setdefault((v.name, target), []).append(OUTPUT)
    steps = []
    for (name, dst), consumers in wanted.items():
        v = values[name]
        src = prop.placements[name]
        steps.append(ReshardStep(name, src, dst, tuple(sorted(set(consumers))), v.nbytes, round(reshard_bytes(src, dst, v.nbytes, mesh.size))))
    order = {op.outputs[0].name: i for i, op in enumerate(fusion.ops) if op.outputs}
    return sorted(steps, key=lambda s: (min(c for c in s.consumers if c >= 0) if any(c >= 0 for c in s.consumers) else len(fusion.ops), order.get(s.value, 0)))


def insert_reshards(fusion: Fusion, prop: Propagation, steps: list[ReshardStep]) -> tuple[Fusion, dict[str, Placement], dict[str, ReshardStep], dict[int, int]]:
    """Insert one ``set`` per step before its first consumer and rewire the consumers.

    Requires: steps from ``plan_reshards`` for ``prop``. Ensures: every op reads its operands in
    the placement its decision requires; returns the new fusion, the placement of every tensor,
    which step each new ``set`` result implements, and where each old op went.
    """
    names = fresh_names(fusion)
    ops = list(fusion.ops)
    placements = dict(prop.placements)
    made: dict[str, ReshardStep] = {}
    rewired: dict[int, Op] = {}
    before: dict[int, list[Op]] = {}
    outputs = list(fusion.outputs)
    for step in steps:
        src_value = fusion.value(step.value)
        set_op = make_op("set", (src_value,), {}, [next(names)])
        result = set_op.outputs[0]
        placements[result.name] = step.dst
        made[result.name] = step
        first = min((c for c in step.consumers if c >= 0), default=len(ops))
        before.setdefault(first, []).append(set_op)
        for c in step.consumers:
            if c == OUTPUT:
                outputs = [result if v.name == step.value else v for v in outputs]
                continue
            op = rewired.get(c, ops[c])
            rewired[c] = op.renamed(lambda v: result.name if v.name == step.value else v.name)  # a set keeps shape and dtype
    new_ops: list[Op] = []
    index_map: dict[int, int] = {}
    for i, op in enumerate(ops):
        new_ops.extend(before.get(i, []))
        index_map[i] = len(new_ops)
        new_ops.append(rewired.get(i, op))
    new_ops.extend(before.get(len(ops), []))
    return fusion.with_ops(tuple(new_ops), tuple(outputs)), placements, made, index_map


def communications(steps: list[ReshardStep]) -> list[ReshardStep]:
    return [s for s in steps if s.is_communication]


def hoist_gathers(fusion: Fusion, placements: dict[str, Placement], made: dict[str, ReshardStep], mesh: DeviceMesh) -> tuple[Fusion, dict[str, Placement], dict[str, ReshardStep]]:
    """Move an all-gather above the layout op that produced its input (one that only moves data,
    ``OpSpec.layout == "moves"``: a gather after it is a gather before it), when that lets two
    gathers of the same data become one or makes the gathered tensor smaller:

        v = permute(u); r = set(v)  [S -> R]      becomes      u' = set(u) [S -> R]; r' = permute(u')

    Requires: the output of ``insert_reshards``. Ensures: the same values on every rank, each
    op's operands still in the placements it needs, and no more bytes communicated.
    """
    from nvtp.ir.simplify import dead_code  # lazy: kept off nvtp --help's path

    names = fresh_names(fusion)
    changed = True
    while changed:  # a scan can make a gather an earlier set may share: scan again until none moves
        ops, changed = _hoist_scan(list(fusion.ops), placements, made, names, mesh)
        fusion = dead_code(fusion.with_ops(tuple(ops)))
    return fusion, placements, made


def _hoist_scan(ops: list[Op], placements, made, names, mesh) -> tuple[list[Op], bool]:
    """One pass of ``hoist_gathers`` over ``ops`` (edited in place), in time linear in the fusion:
    after a hoist the scan goes on from the same place, since the new gather may move up again."""
    producers = {v.name: op for op in ops for v in op.outputs}
    values = {v.name: v for op in ops for v in op.outputs}
    gathers = {(s.value, s.dst): r for r, s in made.items()}
    before: set[str] = set()  # values defined before position idx
    changed = False
    idx = 0
    while idx < len(ops):
        op = ops[idx]
        r = op.outputs[0].name if op.outputs else None
        step = made.get(r) if op.kind == "set" else None
        hoist = None
        if step is not None and axis_split(step.src) is not None:
            v = op.arg("arg")
            p_op = producers.get(v.name)
            if p_op is not None and spec(p_op.kind).layout == "moves" and len(p_op.operands) == 1 and p_op.outputs[0].name not in made:
                u = p_op.operands[0]
                f = factors_of(p_op)
                dec = as_decision(f.results[0], f, step.dst, mesh.size)
                if dec is not None:
                    want = implied(f.operands[0], f, dec, result=False)
                    have = placements[u.name]
                    if want != have and axis_split(have) is not None:
                        existing = gathers.get((u.name, want))
                        if existing is not None or u.nbytes <= v.nbytes:
                            hoist = (p_op, u, want, existing)
        if hoist is None:
            before.update(v.name for v in op.outputs)
            idx += 1
            continue
        p_op, u, want, existing = hoist
        new_ops: list[Op] = []
        if existing is None:
            gather = make_op("set", (u,), {}, [next(names)])
            src = placements[u.name]
            g = gather.outputs[0]
            made[g.name] = ReshardStep(u.name, src, want, (), u.nbytes, round(reshard_bytes(src, want, u.nbytes, mesh.size)))
            placements[g.name] = want
            gathers[(u.name, want)] = g.name
            producers[g.name], values[g.name] = gather, g
            new_ops.append(gather)
            gathered = g
        else:
            gathered = values[existing]
        old_result = op.outputs[0]
        # The same op on the gathered operand, named as the old set's result (shapes and dtypes agree).
        again = p_op.renamed(lambda v: gathered.name if v.name == u.name else v.name, lambda v: old_result.name)
        producers[old_result.name] = again
        # The hoisted pair replaces the old set in place; its result keeps the old name.
        ops[idx:idx + 1] = new_ops + [again]
        old = made.pop(old_result.name)
        if gathers.get((old.value, old.dst)) == old_result.name:
            del gathers[(old.value, old.dst)]
        # An existing gather defined later than this point must move up to here.
        if existing is not None and existing not in before:
            here = idx + len(new_ops)
            pos = next(i for i in range(here + 1, len(ops)) if ops[i].outputs and ops[i].outputs[0].name == existing)
            ops.insert(here, ops.pop(pos))
        changed = True  # look at position idx again: the gather there may move up once more
    return ops, changed

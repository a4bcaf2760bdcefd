"""Which projection pairs with which: a projection P's weight split along its outputs is
propagated (``propagate_locally``), and its row-parallel partner Q is the first projection whose
contracted input P's split reaches without communication on the way."""

from __future__ import annotations

from typing import Mapping

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.ir.printer import format_op
from nvtp.sharding.placements import REPLICATE, DeviceMesh, Placement, Shard, axis_split, make_shard
from nvtp.sharding.plans.base import Projection, reshape_group
from nvtp.sharding.propagate import ShardingError, propagate_locally, reshard_bytes


class Paired:
    """The pairs found so far, to pair a renamed copy of a block (``Op.template``: the regional
    splice) as its first copy was paired without probing again. A pair P -> Q is taken again for P'
    only where the ops from P' to Q' are, one for one, copies of the same ops as those from P to Q:
    what a probe reaches between them is then the same computation, with everything outside it
    replicated in the probe alike. Anything else is probed (``row_partner``)."""

    def __init__(self, fusion: Fusion, projs: list[Projection]):
        self.fusion = fusion
        self.at = {p.op_index: p for p in projs}
        self.first: dict[int, tuple[int, int]] = {}  # id(template of P's op) -> (P's op index, Q's op index)

    def remember(self, p: Projection, q: Projection | None) -> None:
        if q is not None and p.op.template is not None and q.op_index > p.op_index:
            self.first.setdefault(id(p.op.template), (p.op_index, q.op_index))

    def again(self, p: Projection) -> Projection | None:
        if p.op.template is None or id(p.op.template) not in self.first:
            return None
        p0, q0 = self.first[id(p.op.template)]
        ops, n = self.fusion.ops, q0 - p0
        if p.op_index + n >= len(ops) or p.op_index == p0:
            return None
        if not all(ops[p.op_index + k].template is not None and ops[p.op_index + k].template is ops[p0 + k].template
                   for k in range(n + 1)):
            return None
        return self.at.get(p.op_index + n)


def pays_to_split(fusion: Fusion, mesh: DeviceMesh, p: Projection) -> bool:
    """An unpaired projection is split along its outputs when everything that then has to be
    communicated is smaller than gathering its output would be."""
    d = mesh.size if mesh.size > 1 else 2
    w = fusion.value(p.weight)
    if w.shape[p.out_axis] % (p.split_factor * d):
        return False
    prop = _trial(fusion, DeviceMesh.of_size(d), p, {v.name: REPLICATE for v in fusion.outputs if isinstance(v, TensorValue)})
    comm = sum(reshard_bytes(prop.placements[r.value], r.placement, fusion.value(r.value).nbytes, d)
               for r in prop.requirements if r.op_index > p.op_index)
    out = p.op.outputs[0]
    return comm < (d - 1) / d * out.nbytes


def row_partner(fusion: Fusion, mesh: DeviceMesh, p: Projection, projs: list[Projection]) -> Projection | None:
    """The projection whose contracted input P's split output reaches without communication.

    Pairing is structural, so it is probed on a mesh of the mesh's size when that divides P's
    output features, else on the smallest size that does (the plan's divisibility is checked
    separately, with a message saying what to change)."""
    features = fusion.value(p.weight).shape[p.out_axis] // p.split_factor
    sizes = [mesh.size] if mesh.size > 1 and features % mesh.size == 0 else []
    sizes += [k for k in range(2, 8) if features % k == 0]
    if not sizes:
        return None
    probe = DeviceMesh.of_size(sizes[0])
    partner = _partner_on(fusion, probe, p, projs)
    if partner is None:
        # Does it pair on another mesh size? Then some axis on the way (heads, KV heads) does not
        # divide by this one, and the pair is never silently dropped: on this mesh the plan is
        # refused, saying why; probed on another size (this one does not divide the features),
        # the pair stands and the divisibility check refuses it. The sizes tried: the factors of
        # the outer sizes the split output is blocked at (3 heads on 2 devices: 3, a larger
        # mesh), then the smallest divisor of the features below the probed size.
        others = [k for k in _blocking_factors(fusion, probe, p) if features % k == 0]
        others += [k for k in sizes[1:2] if k < probe.size]
        for k in dict.fromkeys(k for k in others if k != probe.size):
            q = _partner_on(fusion, DeviceMesh.of_size(k), p, projs)
            if q is not None and probe.size != mesh.size:
                return q
            if q is not None:
                raise ShardingError(_blocked_pair(fusion, mesh, p, q, k))
    return partner



def _blocking_factors(fusion: Fusion, mesh: DeviceMesh, p: Projection) -> list[int]:
    """The smallest prime factor of each outer size P's split output cannot be split along on
    ``mesh``: a reshape of the split axis into ``[h, ...]`` with ``h`` not divisible by the mesh."""
    prop = _trial(fusion, mesh, p)
    found = []
    for r in prop.requirements:
        if r.op_index < p.op_index:
            continue
        v = fusion.value(r.value)
        op = fusion.ops[r.op_index]
        split = axis_split(prop.placements[r.value])
        if op.kind != "reshape" or split is None or not reshard_bytes(prop.placements[r.value], r.placement, v.nbytes, mesh.size):
            continue
        group = reshape_group(v.shape, op.outputs[0].shape, split[0])
        if group and len(group) > 1 and group[0] % mesh.size and group[0] > 1:
            found.append(next(k for k in range(2, group[0] + 1) if group[0] % k == 0))
    return found


def _trial(fusion: Fusion, d_mesh: DeviceMesh, p: Projection, output_hints: Mapping[str, Placement] | None = None):
    """Propagation with only P column-parallel (its weight and bias split along their outputs,
    the other non-parameter inputs replicated): where P's split output goes by itself."""
    trial = {p.weight: make_shard(p.out_axis, p.split_factor)}
    if p.bias:
        trial[p.bias] = make_shard(0, p.split_factor)
    for v in fusion.inputs:
        if isinstance(v, TensorValue) and v.name not in trial and fusion.role(v.name) != "parameter":
            trial[v.name] = REPLICATE
    return propagate_locally(fusion, d_mesh, trial, output_hints)  # linear in what P's split reaches


def _blocked_pair(fusion: Fusion, mesh: DeviceMesh, p: Projection, q: Projection, paired_on: int) -> str:
    """Why P's split output cannot reach Q on ``mesh`` (it does on ``paired_on`` devices): the
    first op that would communicate, and the two ways out."""

    prop = _trial(fusion, mesh, p)
    d = mesh.size
    head = (f"{fusion.label(p.weight)} ({fusion.value(p.weight).describe()}) cannot be column-parallel with row-parallel "
            f"{fusion.label(q.weight)} over {d} devices")
    whole = (f"or an explicit plan that leaves {fusion.label(p.weight)} and {fusion.label(q.weight)} whole (replicated; "
             "docs/plans.md)")
    for r in prop.requirements:
        if not p.op_index <= r.op_index <= q.op_index:
            continue
        v = fusion.value(r.value)
        if not reshard_bytes(prop.placements[r.value], r.placement, v.nbytes, d):
            continue
        op = fusion.ops[r.op_index]
        split = axis_split(prop.placements[r.value])
        if op.kind == "reshape" and split is not None:
            group = reshape_group(v.shape, op.outputs[0].shape, split[0])
            if group and len(group) > 1 and group[0] % d:
                return (f"{head}: its split output reaches `{format_op(op)}`, which splits axis {split[0]} (size "
                        f"{v.shape[split[0]]}) into {group}, and {d} devices do not divide the outer {group[0]} (attention "
                        f"heads, or KV heads with grouped-query attention); choose a mesh size that divides {group[0]}, {whole}")
        return (f"{head}: its split output reaches `{format_op(op)}`, which would need {v.name} as {r.placement} instead of "
                f"{prop.placements[r.value]} (a communication inside the pair); choose a mesh size that divides the "
                f"axes on the way (it pairs over {paired_on} devices), {whole}")
    return f"{head}; choose a mesh size that divides the axes between them (it pairs over {paired_on} devices), {whole}"



def _partner_on(fusion: Fusion, d_mesh: DeviceMesh, p: Projection, projs: list[Projection]) -> Projection | None:
    prop = _trial(fusion, d_mesh, p)
    for q in projs:
        if q is p or q.op_index < p.op_index:
            continue
        x = q.op.arg("arg1")
        placed = prop.placements.get(x.name)
        if placed != Shard(x.ndim - 1):
            continue
        # No communication may happen on the way from P to Q.
        comm = 0.0
        for r in prop.requirements:
            if p.op_index <= r.op_index <= q.op_index:
                comm += reshard_bytes(prop.placements[r.value], r.placement, fusion.value(r.value).nbytes, d_mesh.size)
        if comm == 0:
            return q
    return None

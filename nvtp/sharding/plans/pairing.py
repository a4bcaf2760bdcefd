"""Which projection pairs with which: a projection P's weight split along its outputs is
propagated (``propagate_locally``), and its row-parallel partner Q is the first projection whose
contracted input P's split reaches without communication on the way.

Each probe (a weight split one way on d devices) is propagated once per fusion and indexed by op
(``Probes``): the projections whose contracted input it splits, and the ops where it would
communicate, each a sorted list. So a weight read by many projections (a recurrent cell unrolled
over 10^5 ops) is propagated once, not once per projection, and each projection's partner is two
binary searches: the plan costs what the probes touch plus O(log n) per projection (it was cubic
in the ops for a chain reusing one weight: 200 ops 46 s).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from nvtp.ir.graph import Fusion, TensorValue
from nvtp.ir.printer import format_op
from nvtp.sharding.placements import REPLICATE, DeviceMesh, Shard, axis_split, make_shard
from nvtp.sharding.plans.base import Projection, reshape_group
from nvtp.sharding.propagate import Propagation, ShardingError, propagate_locally, reshard_bytes


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


@dataclass(frozen=True)
class Trial:
    """One probe: where a weight's split goes by itself on ``d`` devices, indexed by op.

    ``readers``: (op index, Q) for the projections Q whose contracted input the probe splits along
    its last axis, in op order. ``comm_at``: the op indices of the requirements that communicate,
    sorted; ``after``: (op index, bytes) of those, sorted, with ``suffix[i]`` the bytes of entries
    i and later. ``blocked``: per smallest factor of an outer size the split cannot pass (a reshape
    into heads the mesh does not divide), its (op index, position in the requirements) entries,
    sorted by op index, with the least position from each entry on."""

    prop: Propagation
    d: int
    readers: list[tuple[int, Projection]]
    comm_at: list[int]
    after: list[int]
    suffix: list[float]
    blocked: dict[int, tuple[list[int], list[int]]]


class Probes:
    """The probes of one fusion, each propagated once (``trial``), and the questions the plan asks
    of them: P's partner on d devices, the factors that block it, what splitting P alone costs."""

    def __init__(self, fusion: Fusion, projs: list[Projection]):
        self.fusion = fusion
        # Every input but the parameters is replicated in a probe (looked up once: per probe it
        # was quadratic in the inputs of a deep MLP).
        self.open = [v.name for v in fusion.inputs if isinstance(v, TensorValue) and fusion.role(v.name) != "parameter"]
        self.reading: dict[str, list[Projection]] = {}  # activation value -> the projections contracting it
        for q in projs:
            self.reading.setdefault(q.op.arg("arg1").name, []).append(q)
        self.outputs = {v.name: REPLICATE for v in fusion.outputs if isinstance(v, TensorValue)}
        self._trials: dict[tuple, Trial] = {}

    def trial(self, p: Projection, d: int, to_outputs: bool = False) -> Trial:
        """Propagation with only P column-parallel (its weight and bias split along their outputs,
        the other non-parameter inputs replicated) on ``d`` devices: where P's split output goes by
        itself; ``to_outputs`` asks for every output replicated, to price what the split then
        communicates. Once per weight, bias, split and ``d``."""
        key = (p.weight, p.bias, p.out_axis, p.split_factor, d, to_outputs)
        hit = self._trials.get(key)
        if hit is None:
            hit = self._trials[key] = self._index(self._propagate(p, d, to_outputs), d)
        return hit

    def _propagate(self, p: Projection, d: int, to_outputs: bool) -> Propagation:
        trial = {p.weight: make_shard(p.out_axis, p.split_factor)}
        if p.bias:
            trial[p.bias] = make_shard(0, p.split_factor)
        for name in self.open:
            trial.setdefault(name, REPLICATE)
        return propagate_locally(self.fusion, DeviceMesh.of_size(d), trial, self.outputs if to_outputs else None)

    def _index(self, prop: Propagation, d: int) -> Trial:
        fusion = self.fusion
        readers = sorted((q.op_index, id(q), q) for name, placed in prop.placements.items() if name in self.reading
                         for q in self.reading[name] if placed == Shard(fusion.value(name).ndim - 1))
        moved = []
        blocked: dict[int, list[tuple[int, int]]] = {}
        for pos, r in enumerate(prop.requirements):
            v = fusion.value(r.value)
            nbytes = reshard_bytes(prop.placements[r.value], r.placement, v.nbytes, d)
            if not nbytes:
                continue
            moved.append((r.op_index, nbytes))
            k = _blocking_factor(fusion, prop, r, d)
            if k is not None:
                blocked.setdefault(k, []).append((r.op_index, pos))
        moved.sort(key=lambda e: e[0])
        suffix = [0.0] * (len(moved) + 1)
        for i in range(len(moved) - 1, -1, -1):
            suffix[i] = moved[i][1] + suffix[i + 1]
        indexed = {}
        for k, entries in blocked.items():
            entries.sort()
            least = [e[1] for e in entries]
            for i in range(len(least) - 2, -1, -1):
                least[i] = min(least[i], least[i + 1])
            indexed[k] = ([e[0] for e in entries], least)
        at = [e[0] for e in moved]
        return Trial(prop, d, [(i, q) for i, _, q in readers], at, at, suffix, indexed)

    def partner_on(self, p: Projection, d: int) -> Projection | None:
        """The first projection after P whose contracted input P's split reaches on ``d`` devices
        along its last axis, if nothing on the way from P to it communicates (communication only
        grows with the distance, so a later projection cannot do better)."""
        t = self.trial(p, d)
        i = bisect_right(t.readers, p.op_index, key=lambda e: e[0])
        if i == len(t.readers):
            return None
        at, q = t.readers[i]
        j = bisect_left(t.comm_at, p.op_index)
        return q if j == len(t.comm_at) or t.comm_at[j] > at else None

    def communicated_after(self, p: Projection, d: int) -> float:
        """Bytes each rank sends after P when only P is split on ``d`` devices and the outputs are replicated."""
        t = self.trial(p, d, to_outputs=True)
        return t.suffix[bisect_right(t.after, p.op_index)]

    def blocking_factors(self, p: Projection, d: int) -> list[int]:
        """The smallest prime factor of each outer size P's split output cannot be split along on
        ``d`` devices (a reshape of the split axis into ``[h, ...]`` with ``h`` not divisible by d),
        from P on, in the order the probe met them."""
        t = self.trial(p, d)
        first = {}
        for k, (at, least) in t.blocked.items():
            i = bisect_left(at, p.op_index)
            if i < len(at):
                first[k] = least[i]
        return sorted(first, key=first.__getitem__)


def _blocking_factor(fusion: Fusion, prop: Propagation, r, d: int) -> int | None:
    """For a requirement that communicates: the smallest prime factor of the outer size of a
    reshape that splits the probe's split axis into sizes ``d`` does not divide; else None."""
    op = fusion.ops[r.op_index]
    split = axis_split(prop.placements[r.value])
    if op.kind != "reshape" or split is None:
        return None
    group = reshape_group(fusion.value(r.value).shape, op.outputs[0].shape, split[0])
    if group and len(group) > 1 and group[0] % d and group[0] > 1:
        return next(k for k in range(2, group[0] + 1) if group[0] % k == 0)
    return None


def pays_to_split(probes: Probes, mesh: DeviceMesh, p: Projection) -> bool:
    """An unpaired projection is split along its outputs when everything that then has to be
    communicated is smaller than gathering its output would be."""
    d = mesh.size if mesh.size > 1 else 2
    w = probes.fusion.value(p.weight)
    if w.shape[p.out_axis] % (p.split_factor * d):
        return False
    return probes.communicated_after(p, d) < (d - 1) / d * p.op.outputs[0].nbytes


def row_partner(probes: Probes, mesh: DeviceMesh, p: Projection) -> Projection | None:
    """The projection whose contracted input P's split output reaches without communication.

    Pairing is structural, so it is probed on a mesh of the mesh's size when that divides P's
    output features, else on the smallest size that does (the plan's divisibility is checked
    separately, with a message saying what to change)."""
    fusion = probes.fusion
    features = fusion.value(p.weight).shape[p.out_axis] // p.split_factor
    sizes = [mesh.size] if mesh.size > 1 and features % mesh.size == 0 else []
    sizes += [k for k in range(2, 8) if features % k == 0]
    if not sizes:
        return None
    probe = sizes[0]
    partner = probes.partner_on(p, probe)
    if partner is None:
        # Does it pair on another mesh size? Then some axis on the way (heads, KV heads) does not
        # divide by this one, and the pair is never silently dropped: on this mesh the plan is
        # refused, saying why; probed on another size (this one does not divide the features),
        # the pair stands and the divisibility check refuses it. The sizes tried: the factors of
        # the outer sizes the split output is blocked at (3 heads on 2 devices: 3, a larger
        # mesh), then the smallest divisor of the features below the probed size.
        others = [k for k in probes.blocking_factors(p, probe) if features % k == 0]
        others += [k for k in sizes[1:2] if k < probe]
        for k in dict.fromkeys(k for k in others if k != probe):
            q = probes.partner_on(p, k)
            if q is not None and probe != mesh.size:
                return q
            if q is not None:
                raise ShardingError(_blocked_pair(probes, mesh, p, q, k))
    return partner


def _blocked_pair(probes: Probes, mesh: DeviceMesh, p: Projection, q: Projection, paired_on: int) -> str:
    """Why P's split output cannot reach Q on ``mesh`` (it does on ``paired_on`` devices): the
    first op that would communicate, and the two ways out."""
    fusion = probes.fusion
    prop = probes.trial(p, mesh.size).prop
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

"""Sharding propagation: from annotated inputs to a placement for every value, both directions.

Each op *decides* which of its factors (see ``rules.py``) is split over the mesh axis, or none.
The decision fixes where the op's results live (``produced``) and where it needs its operands
(``required``); a value whose home placement differs from what a consumer requires gets a
reshard (``reshard.py``). An op decides as soon as a neighbour tells it something:

* forward, from the placements of its operands (producer to consumer), and
* backward, from what its results' consumers require (consumer to producer),

sweeping the fusion in order and in reverse until nothing changes. Values created inside the
fusion (``iota``, ``full``, ``uniform``) have no operands, so they take their placement from
their consumers; so do inputs the plan leaves open. ``Partial`` operands do not drive a decision:
where a partial sum is resolved (all-reduce or reduce-scatter) is decided by its consumers.

Conflicts (operands that imply different splits) are settled by one documented rule: the
decision that communicates the fewest bytes wins (ring-algorithm bytes per rank, see
``reshard_bytes``); ties go to the decision the plan's annotations support, then to sharding
over replicating (less compute and memory), then to the first candidate. Plan annotations are
never changed: an annotated input keeps its placement and is resharded where a consumer needs
another.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Mapping

from nvtp.ir.graph import Fusion, Op, TensorValue, defines_input
from nvtp.ir.ops import spec
from nvtp.sharding.placements import (
    REPLICATE, DeviceMesh, Partial, Placement, axis_split, is_partial, is_replicate, make_shard,
)
from nvtp.sharding.rules import OpFactors, factors_of, tensor_operands
from nvtp.sharding.placements import divisibility_error

SUM = Partial("sum")


class ShardingError(ValueError):
    """A plan or fusion nvtp cannot shard; says which tensor, axis and sizes, and what to change."""


@dataclass(frozen=True)
class Decision:
    """Factor ``factor`` of the op split over the mesh with inner split factor ``split``; None: replicated.

    ``partial`` (positions of tensor operands) marks a partial sum passing through a linear op:
    those operands are partial sums, the others whole, and every result is a partial sum."""

    factor: int | None
    split: int = 1
    partial: tuple[int, ...] = ()


NONE = Decision(None)


@dataclass
class Requirement:
    op_index: int
    value: str
    placement: Placement


@dataclass
class Propagation:
    placements: dict[str, Placement]
    decisions: dict[int, Decision]
    requirements: list[Requirement]
    sources: dict[str, str] = field(default_factory=dict)  # value -> "plan" | "propagated" | ...


def reshard_bytes(src: Placement, dst: Placement, nbytes: int, d: int) -> float:
    """Bytes each rank sends to turn ``src`` into ``dst`` with ring collectives (0 for local ops)."""
    if src == dst or d == 1:
        return 0.0
    frac = (d - 1) / d
    if is_replicate(src):
        return 0.0  # slicing out a shard, or keeping the value on one rank for a partial sum
    if is_partial(src):
        return 2 * frac * nbytes if not axis_split(dst) else frac * nbytes
    return frac * nbytes  # all-gather (then slice or zero locally)


def _axis_placement(axes: list[tuple[int, ...]], f: OpFactors, decision: Decision) -> Placement | None:
    """The placement a tensor with factor ``axes`` gets under ``decision`` (None: replicated)."""
    if decision.factor is None:
        return None
    for dim, axis in enumerate(axes):
        if decision.factor in axis:
            pos = axis.index(decision.factor)
            outer = 1
            for g in axis[:pos]:
                outer *= f.sizes[g]
            return make_shard(dim, outer * decision.split)
    return None


def implied(axes: list[tuple[int, ...]] | None, f: OpFactors, decision: Decision, *, result: bool, position: int = -1) -> Placement:
    """Where a tensor of the op lives under ``decision``: results of a split reduce factor are
    partial; operands without the split factor are whole (a bias is then added on one rank,
    as nvFuser does for a row-parallel linear with a bias). ``position`` is an operand's index."""
    if decision.partial:
        return SUM if result or position in decision.partial else REPLICATE
    if axes is None:
        return REPLICATE
    p = _axis_placement(axes, f, decision)
    if p is not None:
        return p
    if result and decision.factor is not None and f.kinds[decision.factor] == "reduce":
        return Partial(f.reduce_ops.get(decision.factor, "sum"))
    return REPLICATE


def as_decision(axes: list[tuple[int, ...]], f: OpFactors, placement: Placement, d: int) -> Decision | None:
    """The decision under which a tensor with factor ``axes`` has ``placement``; None if none does."""
    split = axis_split(placement)
    if split is None:
        return NONE if is_replicate(placement) else None
    dim, sf = split
    if dim >= len(axes):
        return None
    outer = 1
    for g in axes[dim]:
        size = f.sizes[g]
        if sf % outer == 0:
            inner = sf // outer
            if inner < size and size % (inner * d) == 0 and f.kinds[g] != "blocked":
                return Decision(g, inner)
        outer *= size
    return None


def _valid(f: OpFactors, decision: Decision, d: int) -> bool:
    if decision.factor is None:
        return True
    g = decision.factor
    return f.kinds[g] != "blocked" and f.sizes[g] % (decision.split * d) == 0


_GATHER_PENALTY = 1e6


class _Propagator:
    def __init__(self, fusion: Fusion, mesh: DeviceMesh, annotations: Mapping[str, Placement], output_hints: Mapping[str, Placement],
                 partial_pass: bool = True, keep_splits: bool = False):
        self.fusion, self.d = fusion, mesh.size
        self.partial_pass = partial_pass
        self.keep_splits = keep_splits
        self.placement: dict[str, Placement] = dict(annotations)
        self.source = {name: "plan" for name in annotations}
        self.hints: dict[str, list[Placement]] = {name: [p] for name, p in output_hints.items()}
        # The same, each placement once (in first-asked order): what a value's consumers ask of it
        # as a set, so asking whether one more consumer's want is among them is O(1), not O(users)
        # (a weight read by 10^5 ops made the propagation quadratic).
        self.hinted: dict[str, dict[Placement, None]] = {name: {p: None} for name, p in output_hints.items()}
        self.decisions: dict[int, Decision] = {}
        self.requirements: list[Requirement] = []
        self._factors: dict[int, OpFactors] = {}
        self._chosen: dict[tuple, tuple[Decision, list[Placement | None], list[Placement]]] = {}  # see ``choose``
        index = _index(fusion)
        self.compute, self._users, self._maker, self._position = index.compute, index.users, index.maker, index.position
        self.inputs = index.inputs
        self._input_names = index.input_names
        self._hinted_inputs: set[str] = {name for name in output_hints if name in index.input_names}
        # Positions (in ``compute``) of the ops a neighbour has told something: only these can
        # become informed, so a sweep visits them alone and a propagation costs what it touches.
        self.pending: set[int] = set()
        self._touched: set[int] = set()
        for name in list(annotations) + list(output_hints):
            self._touch(name)

    def factors(self, i: int, op: Op) -> OpFactors:
        if i not in self._factors:
            self._factors[i] = factors_of(op)
        return self._factors[i]

    # -- one op ---------------------------------------------------------------------------

    def informed(self, op: Op, split_only: bool) -> bool:
        """An op decides once an operand is split or a consumer has said where a result should be.

        Replicated operands never make an op decide: they fit any decision for free (slicing a
        replicated tensor is local). In the first phase only *split* requirements from consumers
        count either, so splits spread as far as they reach before replication settles the rest
        (a gradient reduced over a split sequence becomes a small partial sum, not a gathered
        activation)."""
        known = [self.placement.get(v.name) for v in tensor_operands(op)]
        if any(p is not None and axis_split(p) is not None for p in known):
            return True
        if self.partial_pass and partial_passes(op):
            if sum(p == SUM for p in known) >= 2:
                return True  # partial sums meeting: add them before resolving
            if known and known[0] == SUM and _shrinks_or_keeps(op):
                return True  # a layout op passes a partial sum on at no cost
        for v in op.outputs:
            if isinstance(v, TensorValue):
                hints = self.hints.get(v.name, [])
                if any(axis_split(h) is not None for h in hints) if split_only else hints:
                    return True
        return False

    def candidates(self, op: Op, f: OpFactors) -> list[Decision]:
        found: list[Decision] = [NONE]
        for axes, v in zip(f.operands, tensor_operands(op)):
            p = self.placement.get(v.name)
            if p is not None and axes is not None:
                dec = as_decision(axes, f, p, self.d)
                if dec is not None and dec not in found:
                    found.append(dec)
        for axes, v in zip(f.results, op.outputs):
            for p in self.hints.get(v.name, []):
                if axes is not None:
                    dec = as_decision(axes, f, p, self.d)
                    if dec is not None and dec not in found:
                        found.append(dec)
        if self.partial_pass and partial_passes(op):
            partial = [pos for pos, v in enumerate(tensor_operands(op)) if self.placement.get(v.name) == SUM]
            style = spec(op.kind).linear
            # A number added to a partial sum would be added on every rank.
            all_tensors = all(isinstance(op.arg(p.name), TensorValue) for p in spec(op.kind).params if p.kind == "operand")
            options = {"all": [tuple(range(len(tensor_operands(op))))] if partial and all_tensors else [],
                       # (an op's integer operand, such as gather_mm's expert index, selects: no sum passes it)
                       "one": [(pos,) for pos in partial if tensor_operands(op)[pos].dtype.is_float],
                       "first": [(0,)] if 0 in partial else []}[style]
            found += [Decision(None, 1, o) for o in options if Decision(None, 1, o) not in found]
        return [c for c in found if _valid(f, c, self.d)]

    def cost(self, op: Op, f: OpFactors, dec: Decision) -> tuple[float, int, int, int]:
        total, support = 0.0, 0
        placement, hints, hinted, d = self.placement, self.hints, self.hinted, self.d
        for pos, (axes, v) in enumerate(zip(f.operands, op.tensor_operands)):
            p = placement.get(v.name)
            if p is None:
                continue
            want = implied(axes, f, dec, result=False, position=pos)
            if p is want or p == want:
                if self.source.get(v.name) == "plan":
                    support += 1
            elif want not in hinted.get(v.name, ()):  # a reshard another consumer needs is shared
                moved = reshard_bytes(p, want, v.nbytes, d)
                if self.keep_splits and axis_split(p) is not None:
                    moved *= _GATHER_PENALTY  # a data axis never gathers the batch: it reduces the results instead
                total += moved
        for axes, v in zip(f.results, op.outputs):
            if not isinstance(v, TensorValue):
                continue
            have = implied(axes, f, dec, result=True)
            wanted = hints.get(v.name)
            if wanted:
                for hint in wanted:
                    total += reshard_bytes(have, hint, v.nbytes, d)
            elif dec.partial:
                total += reshard_bytes(SUM, REPLICATE, v.nbytes, d)  # a partial sum is resolved later
        sharded = 0 if dec.factor is not None else 1
        # Ties: decisions the plan supports, then splitting over replicating; a partial sum is
        # carried through layout ops (it can only shrink there) but otherwise resolved early,
        # where Megatron resolves it.
        carry = 0 if dec.partial and _shrinks_or_keeps(op) else (2 if dec.partial else 1)
        return total, -support, sharded, carry

    def choose(self, op: Op, f: OpFactors) -> tuple[Decision, list[Placement | None], list[Placement]]:
        """The cheapest candidate decision, the placements of its results (None: not a tensor) and
        those it needs of its operands. What ``candidates`` and ``cost`` read is the op's structure
        (the same for every renamed copy: ``Op.template``; else ``Op.structure``) and, for its operands and results, the
        placements, hints and plan sources: a deep model's blocks repeat the choice with that key."""
        operands, placement, hints, hinted = op.tensor_operands, self.placement, self.hints, self.hinted
        key = (id(op.template) if op.template is not None else op.structure,
               tuple([placement.get(v.name) for v in operands]),
               tuple([tuple(hinted.get(v.name, ())) for v in operands]),  # ``cost`` asks only what is among them
               tuple([tuple(hints.get(v.name, ())) for v in op.outputs]),
               tuple([self.source.get(v.name) == "plan" for v in operands]))
        hit = self._chosen.get(key)
        if hit is not None:
            return hit
        cands = self.candidates(op, f)
        best = cands[0] if len(cands) == 1 else min(cands, key=lambda c: self.cost(op, f, c))
        results = [implied(axes, f, best, result=True) if isinstance(v, TensorValue) else None for v, axes in zip(op.outputs, f.results)]
        wants = [implied(axes, f, best, result=False, position=pos) for pos, axes in enumerate(f.operands)]
        self._chosen[key] = hit = (best, results, wants)
        return hit

    def decide(self, i: int, op: Op) -> None:
        f = self.factors(i, op)
        best, results, wants = self.choose(op, f)
        self.decisions[i] = best
        for v, p in zip(op.outputs, results):
            if p is not None:
                self.placement[v.name] = p
                self.source.setdefault(v.name, "propagated")
                self._touch(v.name)
        for v, want in zip(op.tensor_operands, wants):
            self._hint(v.name, want)
            self.requirements.append(Requirement(i, v.name, want))
            self._touch(v.name, users=False)
            if v.name in self._input_names:
                self._hinted_inputs.add(v.name)

    def _hint(self, name: str, want: Placement) -> None:
        self.hints.setdefault(name, []).append(want)
        self.hinted.setdefault(name, {})[want] = None

    # -- sweeps ---------------------------------------------------------------------------

    def _touch(self, name: str, users: bool = True) -> None:
        """``name`` got a placement (``users``) or a hint: its consumers and its producer may now
        decide. A hint informs only the producer (``informed`` reads operands' placements and
        results' hints), so a value read by every op of a chain, told something by each reader,
        does not wake all its readers each time (that made the sweeps quadratic)."""
        if users:
            self._touched.update(self._users.get(name, ()))
        pos = self._maker.get(name)
        if pos is not None:
            self._touched.add(pos)

    def sweep(self, forward: bool, split_only: bool, window: tuple[int, int] | None = None) -> bool:
        """One pass over the fusion in order (``forward``) or in reverse, deciding every op that
        is informed when the pass reaches it. Only touched ops can be informed, so only they are
        visited, in the order a pass over every op would visit them: the result is the plain
        sweep's, at the cost of what the propagation touches."""
        changed = False
        sign = 1 if forward else -1
        heap = [sign * pos for pos in self.pending | self._touched]
        heapq.heapify(heap)
        self._touched = set()
        later: set[int] = set()
        seen: set[int] = set()
        while heap:
            pos = sign * heapq.heappop(heap)
            if pos in seen:
                continue
            seen.add(pos)
            i, op = self.compute[pos]
            if i in self.decisions or (window is not None and not window[0] <= pos <= window[1]):
                continue
            if not self.informed(op, split_only):
                later.add(pos)
                continue
            self.decide(i, op)
            changed = True
            for q in self._touched:  # told something by this decision: later in this pass, or in the next
                if sign * q > sign * pos:
                    heapq.heappush(heap, sign * q)
                else:
                    later.add(q)
            self._touched = set()
        self.pending = later
        return changed

    def settle_inputs(self) -> bool:
        """Open inputs take the placement their consumers ask for (the first, by op order)."""
        changed = False
        for name in self._open_inputs():
            wanted = [p for p in self.hinted[name] if not is_partial(p)]  # in first-asked order
            self.placement[name] = wanted[0] if wanted else REPLICATE  # inputs are never partial
            self.source[name] = "propagated"
            self._touch(name)
            changed = True
        return changed

    def _open_inputs(self) -> list[str]:
        """Inputs with a hint and no placement yet (``decide`` records the hinted inputs)."""
        found = [name for name in self._hinted_inputs if name not in self.placement]
        self._hinted_inputs = set()
        return found

    def _to_fixed_point(self, split_only: bool, window: tuple[int, int] | None = None) -> None:
        while True:
            changed = self.sweep(True, split_only, window)
            changed |= self.settle_inputs()
            changed |= self.sweep(False, split_only, window)
            changed |= self.settle_inputs()
            if not changed:
                break

    def run(self) -> Propagation:
        for split_only in (True, False):
            self._to_fixed_point(split_only)
        # Ops nothing informed (e.g. a factory feeding only outputs) run replicated.
        for i, op in self.compute:
            if i not in self.decisions:
                self.decide(i, op)
        for name in self.inputs:
            self.placement.setdefault(name, REPLICATE)
            self.source.setdefault(name, "default")
        self.refine()
        return Propagation(self.placement, self.decisions, self.requirements, self.source)

    def run_local(self) -> Propagation:
        """Where the annotated splits go by themselves, and what that costs up to the ops that
        resolve them: the split phase to its fixed point, then replication settled only inside
        the region the splits reached (plus one op past it, where a partial sum is resolved).
        Values the region reads from outside it are taken as replicated. Linear in the size of
        the region, not of the fusion: the plans probe one projection at a time with it."""
        self._to_fixed_point(True)
        positions = [self._position[i] for i in self.decisions]
        if positions:
            lo, hi = min(positions), max(positions)
            for i in list(self.decisions):
                for v in self.compute[self._position[i]][1].outputs:
                    hi = max([hi, *self._users.get(v.name, ())])
            self._to_fixed_point(False, (lo, hi))
        for r in self.requirements:
            self.placement.setdefault(r.value, REPLICATE)
        self.refine(local=True)
        return Propagation(self.placement, self.decisions, self.requirements, self.source)

    def refine(self, local: bool = False) -> None:
        """Revisit partial sums carried through ops, now that every consumer has spoken: where the
        operand is resolved anyway for another consumer, use the resolved value instead (e.g. a
        bias gradient summed from an activation gradient that is all-reduced for the LayerNorm
        backward needs no all-reduce of its own)."""
        ops = self.compute if not local else [self.compute[self._position[i]] for i in sorted(self.decisions)]
        for i, op in ops:
            dec = self.decisions.get(i)
            if dec is None or not dec.partial:
                continue
            f = self.factors(i, op)
            if self.cost(op, f, NONE)[0] >= self.cost(op, f, dec)[0]:
                continue
            self.decisions[i] = NONE
            for v, axes in zip(op.outputs, f.results):
                if isinstance(v, TensorValue):
                    self.placement[v.name] = implied(axes, f, NONE, result=True)
            self.requirements = [r for r in self.requirements if r.op_index != i]
            for pos, (axes, v) in enumerate(zip(f.operands, tensor_operands(op))):
                want = implied(axes, f, NONE, result=False, position=pos)
                self.requirements.append(Requirement(i, v.name, want))
                self._hint(v.name, want)


def propagate_shardings(fusion: Fusion, mesh: DeviceMesh, annotations: Mapping[str, Placement],
                        output_hints: Mapping[str, Placement] | None = None, *, partial_pass: bool = True,
                        keep_splits: bool = False) -> Propagation:
    """Placements for every tensor of ``fusion`` on a 1-D ``mesh``.

    Requires: a verified fusion; ``annotations`` (input name -> placement) that divide evenly
    (see ``check_annotations``). Ensures: every tensor value has a placement, annotated inputs
    keep theirs, every op has a decision, and each operand use records the placement it needs.
    ``output_hints`` says where outputs should end up (e.g. a gradient where its parameter is).
    ``partial_pass`` lets partial sums flow through linear ops (``OpSpec.linear``) when that
    communicates less; nvFuser holds a partial sum only on a split reduction axis, so programs
    for nvFuser resolve each partial sum where it is produced.
    ``keep_splits`` (a data-parallel axis) makes gathering a split operand the last resort: an op
    contracting the split batch leaves a partial sum (DDP's gradient all-reduce) instead.
    """
    return _Propagator(fusion, mesh, annotations, output_hints or {}, partial_pass, keep_splits).run()


def propagate_locally(fusion: Fusion, mesh: DeviceMesh, annotations: Mapping[str, Placement],
                      output_hints: Mapping[str, Placement] | None = None) -> Propagation:
    """Where ``annotations``' splits reach by themselves, without settling the rest of the fusion
    (``_Propagator.run_local``): placements of the values the splits reach and of what those ops
    read, decisions and requirements of those ops. For probing a plan one tensor at a time in time
    linear in what the probe touches."""
    return _Propagator(fusion, mesh, annotations, output_hints or {}).run_local()


@dataclass(frozen=True)
class _Index:
    compute: list[tuple[int, Op]]  # (op index, op) of the ops that compute, in order
    users: dict[str, tuple[int, ...]]  # value -> positions in ``compute`` of the ops reading it
    maker: dict[str, int]  # value -> position in ``compute`` of the op making it
    position: dict[int, int]  # op index -> position in ``compute``
    inputs: list[str]  # tensor inputs, in order
    input_names: frozenset[str]


_INDEXES: dict[int, tuple[Fusion, _Index]] = {}


def _index(fusion: Fusion) -> _Index:
    """Use-def index of ``fusion``, built once per fusion (the plans propagate it many times)."""
    hit = _INDEXES.get(id(fusion))
    if hit is not None and hit[0] is fusion:
        return hit[1]
    compute = [(i, op) for i, op in enumerate(fusion.ops) if not defines_input(op) and op.kind != "define_scalar"]
    users: dict[str, list[int]] = {}
    maker: dict[str, int] = {}
    for pos, (_, op) in enumerate(compute):
        for v in tensor_operands(op):
            users.setdefault(v.name, []).append(pos)
        for v in op.outputs:
            maker[v.name] = pos
    inputs = [v.name for v in fusion.inputs if isinstance(v, TensorValue)]
    index = _Index(compute, {k: tuple(dict.fromkeys(v)) for k, v in users.items()}, maker, {i: pos for pos, (i, _) in enumerate(compute)},
                   inputs, frozenset(inputs))
    if len(_INDEXES) >= 8:
        _INDEXES.pop(next(iter(_INDEXES)))
    _INDEXES[id(fusion)] = (fusion, index)
    return index


def partial_passes(op: Op) -> bool:
    """Whether a partial sum may flow through ``op``: an op linear in some operands
    (``OpSpec.linear``) computing in floating point (integer division truncates, casts to and
    from integers round)."""
    s = spec(op.kind)
    if not s.linear or not op.outputs or not isinstance(op.outputs[0], TensorValue) or not op.outputs[0].dtype.is_float:
        return False
    if s.linear == "first" and not isinstance(op.args[0][1], TensorValue):
        return False  # 2 / (a + b) is not 2 / a + 2 / b: only the dividend may be partial
    return not s.layout or tensor_operands(op)[0].dtype.is_float  # a cast from integers rounds


def _shrinks_or_keeps(op: Op) -> bool:
    """A layout op (``OpSpec.layout``) whose result is no bigger than its operand (so carrying a
    partial sum through it never costs more bytes later); callers have checked ``partial_passes``."""
    xs = tensor_operands(op)
    return bool(spec(op.kind).layout) and len(xs) == 1 and op.outputs[0].nbytes <= xs[0].nbytes


def check_annotations(fusion: Fusion, mesh: DeviceMesh, annotations: Mapping[str, Placement]) -> None:
    """Raise ``ShardingError`` for an annotation that names no input or does not divide."""
    values = fusion.values
    inputs = {v.name for v in fusion.inputs}
    for name, p in annotations.items():
        if name not in values:
            raise ShardingError(f"the plan annotates {name!r}, which {fusion.name} does not define")
        if name not in inputs:
            raise ShardingError(f"the plan annotates {name!r}, which is not an input of {fusion.name}; plans place inputs only")
        v = values[name]
        if not isinstance(v, TensorValue):
            raise ShardingError(f"the plan annotates scalar {name!r}; only tensors can be sharded")
        split = axis_split(p)
        if split is not None:
            dim, _ = split
            label = fusion.label(name)
            if dim >= v.ndim:
                raise ShardingError(f"{label} ({v.describe()}): the plan shards axis {dim}, but it has only {v.ndim} axes")
            why = divisibility_error(v.shape[dim], p, mesh.size)
            if why:
                raise ShardingError(f"{label} ({v.describe()}): axis {dim} {why}; choose a mesh size that divides it or replicate {label}")
        elif is_partial(p):
            raise ShardingError(f"{fusion.label(name)}: inputs cannot be Partial; annotate Shard or Replicate")
